"""Architecture adapters: what a KV-cache strategy needs from a model, read from the model itself.

A strategy needs, per decoder layer, the queries the layer attends with (attention-aware scoring: SnapKV, H2O,
TOVA...), the attention's scaling, soft-cap and sink logits, and how many tokens the layer can ever attend to
(global, a sliding window, or Llama-4's chunks). kvbench decides from what a model *does*, not from its name:
:func:`capabilities` lists the attention features each layer uses, and a model runs when every one of them is
in :data:`VERIFIED` — features ``tests/test_arch_matrix.py`` verifies on tiny checkpoints (the queries
kvbench computes equal the ones the layer attends with, ``full``'s bytes equal transformers' cache, greedy
tokens equal ``model.generate``). A family nobody listed (GLM-4, Granite, ...) runs when it is built only of
verified features; anything else is refused with one line naming the feature kvbench lacks
(:func:`describe`), never a traceback halfway through a run.

================  =======================================================================================
query projection  separate ``q_proj`` (Llama, Mistral, Qwen, Gemma, OLMo) or fused ``qkv_proj`` whose first
                  ``num_attention_heads * head_dim`` outputs are the queries (Phi-3)
q norm            RMSNorm over ``head_dim`` after the head split (Qwen3, Gemma-3, OLMo-3, EXAONE-4) or over
                  the whole projection before it (OLMo-2) — told apart by the norm's weight size; Llama-4's
                  weightless L2 norm after RoPE
rotary            found by behaviour (:func:`rope_layers`): in one short forward, the function of the modeling
                  module each layer hands the position embeddings it was given (``cos``/``sin``, or a complex
                  ``freqs_cis``: Llama-4, DeepSeek-V2) is its rotary function, replayed in the form it was
                  called (queries and keys together, or one tensor with ``unsqueeze_dim``: Gemma-3n/4) — partial
                  rotary and per-layer-type bases come for free; a layer that hands them to none is NoPE
                  (SmolLM3's and Llama-4's NoPE layers, Cohere2's global layers, Kimi-Linear's MLA)
layer type        transformers' own cache layout (``get_layer_types_and_kwargs``): ``layer_types`` or each
                  layer's ``sliding_window`` / ``attention_chunk_size``; a chunked layer, like a sliding one,
                  never attends to more than ``window - 1`` past tokens, and a window bounds a sequence only
                  when shorter than it (Mistral's 4,096 tokens over 512 hold every token: the strategy's);
                  MLP/MoE-only layers (Nemotron-H) and layers reading another layer's K/V (Gemma-3n/4's
                  ``kv_sharing_modes``: the reader attends over the source layer's store, bytes counted once)
                  hold no cache
scaling, soft-cap the module's ``scaling`` and ``attn_logit_softcapping`` (Gemma-2); GPT-OSS's per-head
sinks            learned sink logits ``module.sinks``, one extra softmax column that takes probability mass
                  and is then dropped (:mod:`kvbench.attention`, ``strategies._eviction``)
hybrids           linear-attention / state-space layers (Qwen3-Next, Jamba, MiniMax, OLMo-Hybrid, Kimi-Linear,
                  Nemotron-H) keep transformers' own ``LinearAttentionLayer`` in kvbench's cache (MiniMax's
                  own cache class is honoured); each layer is judged by its type, so their linear blocks'
                  query projections are not taken for attention; strategies hold the attention layers only,
                  and the state's bytes are reported beside the KV bytes. Falcon-H1 (attention and Mamba side
                  by side in one layer) is refused, as is DeepSeek-V3.2's indexed (sparse) attention, whose
                  indexer keeps keys of its own
latent attention  DeepSeek-V2/V3's (Kimi-Linear's, MiniCPM3's, GLM-4.7-Flash's, LongCat-Flash's: two per layer, low-rank
                  queries scaled by ``mla_scale_q_lora``) MLA: transformers caches the compressed latent (keys slot) and
                  the one shared rotary key (values slot) per token, so kvbench's stores hold exactly those;
                  queries come from the (low-rank) projection with RoPE on their rotary part, and query/key
                  heads may be wider than value heads (DeepSeek-V3: 192 and 128); strategies
                  that score with queries or give keys and values one shape are refused
                  (:func:`strategy_refusal`)
value width       value heads of another width than query/key heads: narrower in MLA (DeepSeek-V3: 192/128)
                  or in plain GQA (MiMo-V2-Flash: the same widths, more KV heads on its sliding layers), read
                  from the ``k_proj`` / ``v_proj`` widths; attention outputs and stores' value rows take the
                  value width, and the fused reader leaves such steps to the blocks
================  =======================================================================================
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvbench.errors import KVBenchError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
#: Layer types of hybrids' non-attention blocks (Qwen3-Next's gated delta rule, Jamba's and Nemotron-H's Mamba,
#: MiniMax's lightning attention, LFM2's convolutions): a fixed-size recurrent state, not per-token K/V, kept by
#: transformers' own ``LinearAttentionLayer`` in kvbench's cache.
RECURRENT_TYPES = ("linear_attention", "conv")
#: Layers that hold no cache at all (transformers' ``DummyLayer``): Nemotron-H's MLP / MoE layers, and Gemma-3n's and
#: Gemma-4's layers that attend over another layer's K/V (``kv_sharing_modes`` ``reuse``).
NO_CACHE = "dummy"
#: Falcon-H1's layers run attention and Mamba side by side in one block (one cache layer holding both).
PARALLEL_TYPES = ("hybrid", "hybrid_sliding")

# -- capabilities ------------------------------------------------------------------------------------------------
Q_PROJ = "separate q_proj"
QKV_PROJ = "fused qkv_proj"
Q_NORM_HEAD = "q norm over head_dim"
Q_NORM_FULL = "q norm over the whole projection"
ROPE = "rotary position embeddings (cos/sin)"
ROPE_COMPLEX = "complex rotary position embeddings (freqs_cis)"
NOPE = "layers without rotary position embeddings (NoPE)"
L2_NORM = "L2 q/k norm after RoPE"
TEMPERATURE = "query temperature scaling on NoPE layers"
GLOBAL = "global attention"
SLIDING_WINDOW = "sliding-window attention"
CHUNKED_ATTENTION = "chunked attention"
SOFTCAP = "attention logit soft-capping"
SINKS = "attention sinks (learned sink logits)"
GATED_Q = "a gated query projection (q_proj also yields an output gate)"
PARALLEL_HYBRID = "attention and a state-space block in parallel in one layer"
MLA = "multi-head latent attention (the cache holds a compressed KV latent and one shared rotary key)"
RECURRENT = "linear-attention / state-space layers (a recurrent state instead of K/V)"
VALUE_WIDTH = "value heads of another width than query/key heads"

#: Every capability the test matrix verifies on tiny checkpoints (``tests/test_arch_matrix.py`` checks that
#: each is used by at least one family there, so nothing here is claimed unverified).
VERIFIED = frozenset({Q_PROJ, QKV_PROJ, Q_NORM_HEAD, Q_NORM_FULL, ROPE, ROPE_COMPLEX, NOPE, L2_NORM, TEMPERATURE,
                      GLOBAL, SLIDING_WINDOW, CHUNKED_ATTENTION, SOFTCAP, SINKS, GATED_Q, RECURRENT, MLA,
                      VALUE_WIDTH})

_PROJECTIONS = ("q_proj", "qkv_proj", "kv_a_proj_with_mqa")  # separate, fused, MLA's latent projection


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer attends: ``window`` bounds what it can attend to (``None``: global attention).

    Chunked attention (Llama-4) is bounded like a sliding window: a query sees its own chunk only, so at most
    ``chunk - 1`` past tokens, and transformers caches it as a sliding window of that size. A window bounds a
    sequence only when the sequence is longer (:meth:`bounds`): Mistral's 4,096-token window over 512 tokens
    holds every token, as a global layer does.
    """

    attention: str = FULL
    window: int | None = None

    @property
    def sliding(self) -> bool:
        """Window-bounded (sliding or chunked): the layer holds at most ``window - 1`` past tokens."""
        return self.attention in (SLIDING, CHUNKED)

    @property
    def recurrent(self) -> bool:
        """A hybrid's linear-attention / state-space layer: a fixed-size state, no K/V, no strategy."""
        return self.attention in RECURRENT_TYPES

    @property
    def kv(self) -> bool:
        """The layer holds per-token K/V of its own (a strategy's store, or a dense window)."""
        return self.attention in (FULL, SLIDING, CHUNKED)

    def bounds(self, tokens: int | None) -> bool:
        """Its window is shorter than a sequence of ``tokens`` (``None``: any length), so it drops tokens."""
        return self.sliding and self.window is not None and (tokens is None or self.window - 1 < tokens)


def layer_kinds(config: Any) -> list[LayerKind]:
    """Per-layer type from the config alone, as transformers' own cache reads it
    (``transformers.cache_utils.get_layer_types_and_kwargs``: ``layer_types``, or each layer's
    ``sliding_window`` / ``attention_chunk_size``; MLP / MoE-only layers and layers reusing another layer's K/V
    become cache-less ``dummy`` layers), so kvbench's cache has the layout of the model's."""
    n = int(config.num_hidden_layers)
    if hasattr(config, "per_layer_config"):  # a transformers config
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
        types = list(types)
    else:  # a bare stand-in (tests): every layer global
        types, kwargs = [FULL] * n, [{}] * n
    if len(types) != n:
        raise KVBenchError(f"config.layer_types has {len(types)} entries for {n} layers")
    parallel = sorted(set(types) & set(PARALLEL_TYPES))
    if parallel:
        raise KVBenchError(f"it uses {PARALLEL_HYBRID} (layer types {', '.join(parallel)}), which kvbench does not "
                           "handle yet")
    known = (FULL, SLIDING, CHUNKED, *RECURRENT_TYPES, NO_CACHE)
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise KVBenchError(f"layer type(s) {', '.join(unknown)} are not supported; kvbench handles "
                           f"{', '.join(known)} layers")
    kinds = []
    for i, (t, kw) in enumerate(zip(types, kwargs, strict=True)):
        window = kw.get("sliding_window") if t in (SLIDING, CHUNKED) else None
        if t in (SLIDING, CHUNKED) and not window:
            raise KVBenchError(f"layer {i} is a {t} layer but the config sets no window (sliding_window / "
                               "attention_chunk_size)")
        kinds.append(LayerKind(t, None if window is None else int(window)))
    return kinds


def _attention_kinds(config: Any, mods: list[nn.Module]) -> list[LayerKind]:
    """The kinds of the layers holding K/V, one per attention module (hybrids' recurrent layers, MLP layers and
    layers reading another layer's K/V hold none)."""
    kinds = layer_kinds(config)
    count = sum(k.kv for k in kinds)
    if len(mods) != count:
        raise KVBenchError(f"found {len(mods)} attention modules with q_proj/qkv_proj and a layer_idx for "
                           f"{count} attention layers")
    return [kinds[m.layer_idx] for m in mods]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer that holds K/V, in layer order. A hybrid's
    linear-attention blocks (MiniMax, OLMo-Hybrid, Kimi-Linear) have query projections too: a module is taken
    by what its layer is (:func:`layer_kinds`), not by its attributes."""
    kinds = layer_kinds(model.config)
    # Submodules looked up in ``_modules`` directly: ``hasattr`` on an nn.Module walks ``__getattr__`` and raises
    # for every module that lacks the name, and this runs on every entry (cache attach, QueryRecorder).
    mods = [m for m in model.modules()
            if any(p in m._modules for p in _PROJECTIONS) and isinstance(getattr(m, "layer_idx", None), int)
            and 0 <= m.layer_idx < len(kinds) and kinds[m.layer_idx].kv]
    return sorted(mods, key=lambda m: m.layer_idx)


@dataclass(frozen=True)
class Rotary:
    """How one layer rotates its queries, as observed (:func:`rope_layers`): the modeling module's function the
    layer handed its position embeddings to, and the form of that call — queries and keys together
    (``apply_rotary_pos_emb(q, k, cos, sin)``, Llama-4's and DeepSeek-V2's complex ``apply_rotary_emb(q, k,
    freqs_cis)``) or one tensor (Gemma-3n / Gemma-4's ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2)``),
    heads before or after tokens, and the call's other arguments."""

    fn: Callable[..., Any]
    pair: bool
    heads_first: bool
    rest: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    complex: bool = False  # complex ``freqs_cis`` (Llama-4, DeepSeek-V2) rather than ``(cos, sin)``

    def __call__(self, q: torch.Tensor, embeddings: Any) -> torch.Tensor:
        """``q`` ``[batch, heads, tokens, dim]`` rotated by ``embeddings`` (``(cos, sin)`` or ``freqs_cis``)."""
        x = q if self.heads_first else q.transpose(1, 2)
        emb = (embeddings,) if isinstance(embeddings, torch.Tensor) else tuple(embeddings)
        out = self.fn(*((x, x) if self.pair else (x,)), *emb, *self.rest, **dict(self.kwargs))
        out = out[0] if self.pair else out
        return out if self.heads_first else out.transpose(1, 2)


_ROPE_LAYERS: weakref.WeakKeyDictionary[nn.Module, dict[int, Rotary]] = weakref.WeakKeyDictionary()


def rope_layers(model: nn.Module) -> dict[int, Rotary]:
    """The layers whose attention rotates its queries, each with how (:class:`Rotary`), found by behaviour in one
    short forward: every function of the attention's modeling module is wrapped, and the first one a layer
    hands the position embeddings it was given (those very tensors: ``(cos, sin)`` or ``freqs_cis``) is its
    rotary function, whatever its name. A layer that hands them to none is NoPE (SmolLM3's and Llama-4's NoPE
    layers, Cohere2's global layers, Kimi-Linear's latent attention)."""
    if model in _ROPE_LAYERS:
        return _ROPE_LAYERS[model]
    mods = attention_modules(model)
    found = _observe_rotary(model, mods) if mods else {}
    _ROPE_LAYERS[model] = found
    return found


def _observe_rotary(model: nn.Module, mods: list[nn.Module]) -> dict[int, Rotary]:
    config = model.config
    # Tokens of the observation: a count no head count equals, so [b, heads, t, d] and [b, t, heads, d] differ.
    heads = {int(getattr(config, a, 0) or 0) for a in ("num_attention_heads", "num_key_value_heads")}
    tokens = next(t for t in range(5, 64) if t not in heads)
    modelings = [sys.modules[n] for n in sorted({type(m).__module__ for m in mods}) if n in sys.modules]
    running: list[tuple[int, list[torch.Tensor]]] = []
    found: dict[int, Rotary] = {}
    problems: list[str] = []

    def observe(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if running and running[-1][1] and running[-1][0] not in found:
                layer, emb = running[-1]
                at = [i for i, a in enumerate(args) if any(a is e for e in emb)]
                if at:
                    first, rest = at[0], args[at[0] + len(emb):]
                    if at != list(range(first, first + len(emb))) or first not in (1, 2) or any(
                            isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values())):
                        problems.append(f"layer {layer} rotates with {fn.__name__}, called in a form kvbench "
                                        "cannot replay")
                    else:
                        x = args[0]
                        found[layer] = Rotary(fn, pair=first == 2, heads_first=x.shape[2] == tokens,
                                              rest=tuple(rest), kwargs=tuple(sorted(kwargs.items())),
                                              complex=emb[0].is_complex())
            return fn(*args, **kwargs)
        return wrapped

    def enter(m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        emb = kwargs.get("position_embeddings")
        running.append((m.layer_idx, [] if emb is None else [emb] if isinstance(emb, torch.Tensor) else list(emb)))

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        running.pop()

    originals = [(mod, name, fn) for mod in modelings for name, fn in vars(mod).items()
                 if inspect.isfunction(fn) and fn.__module__ == mod.__name__]
    handles = [m.register_forward_pre_hook(enter, with_kwargs=True) for m in mods]
    handles += [m.register_forward_hook(leave) for m in mods]
    for mod, name, fn in originals:
        setattr(mod, name, observe(fn))
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.ones(1, tokens, dtype=torch.long, device=device), use_cache=False)
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)
        for h in handles:
            h.remove()
    if problems:
        raise KVBenchError(problems[0])
    return found


@dataclass
class AttentionAdapter:
    """One attention module, seen the way a strategy needs it."""

    module: nn.Module
    kind: LayerKind
    num_heads: int
    head_dim: int
    num_kv_groups: int
    scaling: float
    softcap: float | None
    sinks: torch.Tensor | None  # GPT-OSS: one learned logit per query head, an extra softmax column
    rotary: Rotary | None  # how the layer rotates its queries (None: NoPE)
    _norm_before_split: bool
    _gated: bool = False  # Qwen3-Next: each head's q_proj outputs are [query | output gate]
    _rope_dims: int | None = None  # MLA: only the last ``qk_rope_head_dim`` dims of a query head rotate

    @property
    def layer_idx(self) -> int:
        return int(self.module.layer_idx)

    @property
    def rope(self) -> bool:
        return self.rotary is not None

    def raw_queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """Queries before RoPE, ``[batch, heads, tokens, head_dim]``, exactly as the module computes them."""
        m = self.module
        if self._rope_dims is not None and getattr(m, "q_a_proj", None) is not None:  # MLA's low-rank queries
            q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden)))
            # LongCat-Flash scales its low-rank queries by sqrt(hidden / q_lora_rank) before RoPE (a rotation is
            # linear: scaling before the split and rotation is the same).
            q = q * getattr(m, "mla_scale_q_lora", 1.0)
            return q.view(*hidden.shape[:-1], -1, self.head_dim).transpose(1, 2)
        # A fused projection's queries are its first num_heads * head_dim outputs (Phi-3).
        q = m.q_proj(hidden) if hasattr(m, "q_proj") else m.qkv_proj(hidden)[..., : self.num_heads * self.head_dim]
        if self._gated:
            q = q.view(*hidden.shape[:-1], -1, 2 * self.head_dim)[..., : self.head_dim].reshape(*hidden.shape[:-1], -1)
        norm = getattr(m, "q_norm", None)
        if norm is not None and self._norm_before_split:
            q = norm(q)
        q = q.view(*hidden.shape[:-1], -1, self.head_dim)
        if norm is not None and not self._norm_before_split:
            q = norm(q)
        return q.transpose(1, 2)

    def queries(self, hidden: torch.Tensor, position_embeddings: Any, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The queries ``[batch, heads, tokens, head_dim]`` the layer attends with, for ``hidden``
        ``[batch, tokens, hidden]``: rotated by the model's own rotary function on the layer's
        ``position_embeddings`` (``(cos, sin)``, or a complex ``freqs_cis``) where the layer rotates.
        ``positions`` (absolute, ``[tokens]``) serve Llama-4's temperature scaling of NoPE layers."""
        q = self.raw_queries(hidden)
        m = self.module
        if self.rotary is not None:
            if self._rope_dims is not None:  # MLA: [no-RoPE part | rotary part] per head
                q_pass, q_rot = q.split([q.shape[-1] - self._rope_dims, self._rope_dims], dim=-1)
                q = torch.cat((q_pass, self.rotary(q_rot, position_embeddings)), dim=-1)
            else:
                q = self.rotary(q, position_embeddings)
        if hasattr(m, "qk_norm"):  # Llama-4's L2 norm, after RoPE
            q = m.qk_norm(q)
        if getattr(m, "attn_temperature_tuning", False) and self.rotary is None:
            assert positions is not None, "Llama-4's NoPE layers scale queries by position"
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / m.floor_scale)) * m.attn_scale + 1.0
            q = (q * scales.view(1, 1, -1, 1)).to(q.dtype)
        return q


def _norm_width(module: nn.Module) -> int | None:
    norm = getattr(module, "q_norm", None)
    return None if norm is None or getattr(norm, "weight", None) is None else norm.weight.numel()


def _mla(module: nn.Module) -> bool:
    return hasattr(module, "kv_a_proj_with_mqa")


def _missing(module: nn.Module) -> list[str]:
    """What the layout lacks for kvbench to read it at all (not a capability: a structural gap)."""
    if _mla(module):
        return [f"attention attribute {a}" for a in ("qk_head_dim", "qk_rope_head_dim", "scaling")
                if getattr(module, a, None) is None]
    need = []
    if not (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
        need.append("a q_proj or fused qkv_proj query projection")
    for attr in ("head_dim", "num_key_value_groups", "scaling"):
        if getattr(module, attr, None) is None:
            need.append(f"attention attribute {attr}")
    return need


def _rope_capability(rotary: Rotary | None) -> str:
    return NOPE if rotary is None else ROPE_COMPLEX if rotary.complex else ROPE


def _value_width_differs(module: nn.Module) -> bool:
    """Its value heads are not as wide as its query/key heads (DeepSeek-V3's MLA: 192 and 128; MiMo-V2-Flash's
    GQA: the same), read from the projections that write them: the attention's output and the stores' value
    rows then have the value width."""
    if _mla(module):
        v = getattr(module, "v_head_dim", None)
        return v is not None and int(v) != int(module.qk_head_dim)
    k, v = getattr(module, "k_proj", None), getattr(module, "v_proj", None)
    return isinstance(k, nn.Linear) and isinstance(v, nn.Linear) and k.out_features != v.out_features


def layer_capabilities(module: nn.Module, kind: LayerKind, config: Any, rotary: Rotary | None) -> list[str]:
    """The attention features one layer uses (names from this module's constants)."""
    window = {FULL: GLOBAL, SLIDING: SLIDING_WINDOW, CHUNKED: CHUNKED_ATTENTION}[kind.attention]
    widths = [VALUE_WIDTH] if _value_width_differs(module) else []
    if _mla(module):  # DeepSeek-V2/V3, Kimi-Linear: queries from a (low-rank) projection, RoPE on part of a head
        return [MLA, _rope_capability(rotary), window, *widths]
    caps = [QKV_PROJ if not hasattr(module, "q_proj") and hasattr(module, "qkv_proj") else Q_PROJ]
    heads, head_dim = int(config.num_attention_heads), getattr(module, "head_dim", None)
    proj = getattr(module, "q_proj", None)
    if head_dim and isinstance(proj, nn.Linear) and proj.out_features == 2 * heads * int(head_dim):
        caps.append(GATED_Q)  # Qwen3-Next: queries and a sigmoid gate from one projection
    width = _norm_width(module)
    if width is not None:
        caps.append(Q_NORM_FULL if head_dim and width == heads * int(head_dim) and width != head_dim else Q_NORM_HEAD)
    caps.append(_rope_capability(rotary))
    if rotary is not None and hasattr(module, "qk_norm"):
        caps.append(L2_NORM)
    if rotary is None and getattr(module, "attn_temperature_tuning", False):
        caps.append(TEMPERATURE)
    caps.append(window)
    if getattr(module, "attn_logit_softcapping", None) is not None:
        caps.append(SOFTCAP)
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        caps.append(SINKS)
    return caps + widths


def capabilities(model: nn.Module) -> dict[str, list[int]]:
    """Every attention feature ``model`` uses, with the layers that use it, each layer judged by what it is and
    does (raises :class:`KVBenchError` for a layout kvbench cannot read: no query projection, parallel hybrid
    layers, unknown layer types)."""
    config = model.config
    kinds = layer_kinds(config)
    mods = attention_modules(model)
    if not mods:
        raise KVBenchError("it lacks attention modules with a q_proj or qkv_proj and a layer_idx")
    for m in mods:
        need = _missing(m)
        if need:
            raise KVBenchError(f"its attention (layer {m.layer_idx}, {type(m).__name__}) lacks {', '.join(need)}")
    rotating = rope_layers(model)
    caps: dict[str, list[int]] = {}
    for m, kind in zip(mods, _attention_kinds(config, mods), strict=True):
        for c in layer_capabilities(m, kind, config, rotating.get(m.layer_idx)):
            caps.setdefault(c, []).append(m.layer_idx)
    recurrent = [i for i, k in enumerate(kinds) if k.recurrent]
    if recurrent:
        caps[RECURRENT] = recurrent
    return caps


def adapt(module: nn.Module, kind: LayerKind, config: Any, rotary: Rotary | None) -> AttentionAdapter:
    """The adapter of one attention module; :class:`KVBenchError` naming what is missing."""
    need = _missing(module)
    if need:
        raise KVBenchError(f"{type(module).__name__} lacks {', '.join(need)}")
    if _mla(module):
        return AttentionAdapter(
            module=module, kind=kind, num_heads=int(config.num_attention_heads), head_dim=int(module.qk_head_dim),
            num_kv_groups=int(config.num_attention_heads), scaling=float(module.scaling), softcap=None, sinks=None,
            rotary=rotary, _norm_before_split=False, _rope_dims=int(module.qk_rope_head_dim))
    head_dim = int(module.head_dim)
    num_heads = int(config.num_attention_heads)
    width = _norm_width(module)
    if width not in (None, head_dim, num_heads * head_dim):
        raise KVBenchError(f"{type(module).__name__}.q_norm normalises {width} features, neither head_dim "
                           f"({head_dim}) nor the whole projection ({num_heads * head_dim})")
    own_window = getattr(module, "sliding_window", None)
    if getattr(module, "is_sliding", True) is False:  # EXAONE-4 keeps the config's window on global layers too
        own_window = None
    if own_window is not None and own_window != kind.window:
        raise KVBenchError(f"layer {module.layer_idx}: its attention uses a {own_window}-token window but the "
                           f"config says {kind}")
    softcap = getattr(module, "attn_logit_softcapping", None)
    sinks = getattr(module, "sinks", None)
    return AttentionAdapter(
        module=module, kind=kind, num_heads=num_heads, head_dim=head_dim,
        num_kv_groups=int(module.num_key_value_groups), scaling=float(module.scaling),
        softcap=None if softcap is None else float(softcap),
        sinks=sinks if isinstance(sinks, torch.Tensor) else None, rotary=rotary,
        _norm_before_split=width == num_heads * head_dim and width != head_dim,
        _gated=GATED_Q in layer_capabilities(module, kind, config, rotary))


def adapters(model: nn.Module) -> list[AttentionAdapter]:
    """Adapters of every attention layer of ``model``, in layer order (no capability check: see
    :func:`describe`)."""
    config = model.config
    mods = attention_modules(model)
    kinds = _attention_kinds(config, mods)
    rotating = rope_layers(model)
    return [adapt(m, kind, config, rotating.get(m.layer_idx)) for m, kind in zip(mods, kinds, strict=True)]


def unsupported(model: nn.Module) -> str | None:
    """The one line refusing ``model``, or ``None`` when every capability it uses is verified."""
    config = model.config
    family = str(getattr(config, "model_type", "") or type(model).__name__)
    head = f"{type(model).__name__} (model_type {family!r}) is not supported"
    try:
        caps = capabilities(model)
        missing = [c for c in caps if c not in VERIFIED]
        if not missing:
            adapters(model)
            return None
    except KVBenchError as exc:
        return f"{head}: {exc}"
    what = "; ".join(f"{c} (layers {_span(caps[c])})" for c in missing)
    return f"{head}: it uses {what}, which kvbench does not handle yet"


def strategy_refusal(model: nn.Module, strategy: Any) -> str | None:
    """The line refusing ``strategy`` (a :class:`strategies.base.Strategy`) on ``model``, or ``None``.

    A multi-head latent attention cache holds one compressed latent and one shared rotary key per token, not
    per-head keys: a strategy that scores tokens with the model's queries (``query_window != 0``: SnapKV, H2O,
    TOVA, ...) has nothing to score them against. Strategies that read no queries apply to the latent as to any
    cache: quantizers quantize it, token evictions drop a token's latent and rotary key together."""
    if not any(_mla(m) for m in attention_modules(model)):
        return None
    config = model.config
    head = (f"strategy {strategy.name} does not apply to {type(model).__name__} (model_type "
            f"{getattr(config, 'model_type', '')!r}), which uses {MLA}")
    if strategy.query_window != 0:
        return (f"{head}: it scores tokens with the model's queries, and the cache holds no per-head keys to score; "
                "strategies that read no queries apply (quantizers, streaming_llm, random, knorm, ...)")
    widths = (int(config.kv_lora_rank), int(config.qk_rope_head_dim))
    if getattr(strategy, "same_kv_width", False) and widths[0] != widths[1]:
        return (f"{head}: its store gives keys and values one shape, and the latent ({widths[0]} wide) and the "
                f"shared rotary key ({widths[1]} wide) differ")
    return None


def describe(model: nn.Module, strategies: Any = ()) -> list[AttentionAdapter]:
    """Check that kvbench supports ``model``'s architecture (and each of ``strategies`` on it) and return its
    adapters: one model check for every entry point (the CLI and lm-eval after
    :func:`kvbench.models.load_model`, :func:`kvbench.generate`, :meth:`kvbench.cache.KVBenchCache.attach`).
    One :class:`KVBenchError` line otherwise, naming what the layout lacks or the capability kvbench does not
    handle."""
    line = unsupported(model)
    if line is None:
        line = next((r for r in (strategy_refusal(model, s) for s in strategies) if r is not None), None)
    if line is not None:
        raise KVBenchError(line)
    return adapters(model)


def nothing_to_compress(config: Any, names: list[str], tokens: int | None = None) -> str | None:
    """The line saying that ``names`` (strategies other than ``full``) can change nothing, when every layer
    holding K/V attends within a window shorter than ``tokens`` (the shortest sequence of the run; ``None``:
    any length): kvbench leaves those windows dense, as transformers caches them, so each such strategy holds
    exactly ``full``'s bytes (0% reduction by construction, not measured). A window at least as long as the
    sequence bounds nothing: the layer holds every token, and the strategy compresses it like a global one."""
    kinds = [k for k in layer_kinds(config) if k.kv]
    others = [n for n in names if n != "full"]
    if not others or not kinds or not all(k.bounds(tokens) for k in kinds):
        return None
    windows = sorted({k.window for k in kinds if k.window is not None})
    return (f"every layer of this model attends within a window ({'/'.join(map(str, windows))} tokens) shorter "
            f"than the sequences, which kvbench leaves dense: {', '.join(others)} cannot change its cache "
            "(0% reduction by construction)")


def own_cache_class(config: Any) -> type | None:
    """The cache class a model's modeling module defines for its linear-attention state (``get_linear_cache`` /
    ``set_linear_cache``: MiniMax), which its forward insists on; ``None`` for every other model."""
    import importlib

    from transformers.cache_utils import Cache

    kind = str(getattr(config, "model_type", "") or "")
    if not kind.isidentifier():
        return None
    try:
        modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:
        return None
    return next((c for c in vars(modeling).values() if inspect.isclass(c) and issubclass(c, Cache)
                 and c.__module__ == modeling.__name__ and hasattr(c, "set_linear_cache")), None)


def _span(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}-{layers[-1]} ({len(layers)})"
