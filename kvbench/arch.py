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
rotary            the modeling module's own ``apply_rotary_pos_emb`` on the ``cos``/``sin`` the model hands
                  the layer (partial rotary, per-layer-type bases come for free), or Llama-4's complex
                  ``apply_rotary_emb``; *which* layers rotate is read from the module (``use_rope``: SmolLM3,
                  Llama-4) or, without that flag, observed in one 4-token forward (Cohere2 rotates only on
                  its sliding layers): a layer that never calls the rotary function is NoPE
attention type    ``config.layer_types`` (global / sliding / chunked) or, without it, every layer sliding
                  when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3); a chunked layer, like a
                  sliding one, never attends to more than ``attention_chunk_size - 1`` past tokens
scaling, soft-cap the module's ``scaling`` and ``attn_logit_softcapping`` (Gemma-2); GPT-OSS's per-head
sinks            learned sink logits ``module.sinks``, one extra softmax column that takes probability mass
                  and is then dropped (:mod:`kvbench.attention`, ``strategies._eviction``)
hybrids           linear-attention / state-space layers (Qwen3-Next, Jamba: ``layer_types``
                  ``linear_attention``) keep transformers' own ``LinearAttentionLayer`` in kvbench's cache;
                  strategies hold the attention layers only, and the state's bytes are reported beside the KV
                  bytes. Falcon-H1 (attention and Mamba side by side in one layer) is refused
latent attention  DeepSeek-V2/V3's MLA: transformers caches the compressed latent (keys slot) and the one
                  shared rotary key (values slot) per token, so kvbench's stores hold exactly those; queries
                  come from the low-rank projection with (interleaved) RoPE on their rotary part; strategies
                  that score with queries or give keys and values one shape are refused
                  (:func:`strategy_refusal`)
================  =======================================================================================
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvbench.errors import KVBenchError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
#: Layer types of hybrids' non-attention blocks (Qwen3-Next's gated delta rule, Jamba's Mamba): a fixed-size
#: recurrent state, not per-token K/V, kept by transformers' own ``LinearAttentionLayer`` in kvbench's cache.
RECURRENT_TYPES = ("linear_attention", "mamba", "mamba2")
#: Falcon-H1's layers run attention and Mamba side by side in one block (one cache layer holding both).
PARALLEL_TYPES = ("hybrid",)

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

#: Every capability the test matrix verifies on tiny checkpoints (``tests/test_arch_matrix.py`` checks that
#: each is used by at least one family there, so nothing here is claimed unverified).
VERIFIED = frozenset({Q_PROJ, QKV_PROJ, Q_NORM_HEAD, Q_NORM_FULL, ROPE, ROPE_COMPLEX, NOPE, L2_NORM, TEMPERATURE,
                      GLOBAL, SLIDING_WINDOW, CHUNKED_ATTENTION, SOFTCAP, SINKS, GATED_Q, RECURRENT, MLA})

_ROTARY = ("apply_rotary_pos_emb", "apply_rotary_emb")  # cos/sin form, Llama-4's complex form
_PROJECTIONS = ("q_proj", "qkv_proj", "kv_a_proj_with_mqa")  # separate, fused, MLA's latent projection


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer attends: ``window`` bounds what it can attend to (``None``: global attention).

    Chunked attention (Llama-4) is bounded like a sliding window: a query sees its own chunk only, so at most
    ``chunk - 1`` past tokens, and transformers caches it as a sliding window of that size.
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


def layer_kinds(config: Any) -> list[LayerKind]:
    """Per-layer attention type from the config alone (caches are built from the config, not the model)."""
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        # Mistral / Mixtral / Phi-3 build the sliding mask for every layer when ``sliding_window`` is set.
        types = [SLIDING if window else FULL] * n
    if len(types) != n:
        raise KVBenchError(f"config.layer_types has {len(types)} entries for {n} layers")
    parallel = sorted(set(types) & set(PARALLEL_TYPES))
    if parallel:
        raise KVBenchError(f"it uses {PARALLEL_HYBRID} (layer types {', '.join(parallel)}), which kvbench does not "
                           "handle yet")
    unknown = sorted(set(types) - {FULL, SLIDING, CHUNKED, *RECURRENT_TYPES})
    if unknown:
        raise KVBenchError(f"layer type(s) {', '.join(unknown)} are not supported; kvbench handles "
                           f"{', '.join((FULL, SLIDING, CHUNKED, *RECURRENT_TYPES))} layers")
    if SLIDING in types and not window:
        raise KVBenchError("config.layer_types names sliding_attention layers but config.sliding_window is unset")
    chunk = getattr(config, "attention_chunk_size", None)
    if CHUNKED in types and not chunk:
        raise KVBenchError("config.layer_types names chunked_attention layers but config.attention_chunk_size "
                           "is unset")
    return [LayerKind(t, int(window) if t == SLIDING else int(chunk) if t == CHUNKED else None) for t in types]


def _attention_kinds(config: Any, mods: list[nn.Module]) -> list[LayerKind]:
    """The kinds of the attention layers (hybrids' recurrent layers have no attention module)."""
    kinds = [k for k in layer_kinds(config) if not k.recurrent]
    if len(mods) != len(kinds):
        raise KVBenchError(f"found {len(mods)} attention modules with q_proj/qkv_proj and a layer_idx for "
                           f"{len(kinds)} attention layers")
    return [layer_kinds(config)[m.layer_idx] for m in mods]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    # Submodules looked up in ``_modules`` directly: ``hasattr`` on an nn.Module walks ``__getattr__`` and raises
    # for every module that lacks the name, and this runs on every entry (cache attach, QueryRecorder).
    mods = [m for m in model.modules()
            if any(p in m._modules for p in _PROJECTIONS) and getattr(m, "layer_idx", None) is not None]
    return sorted(mods, key=lambda m: m.layer_idx)


def _rotary(module: nn.Module) -> tuple[str, Callable[..., Any]] | None:
    modeling = sys.modules.get(type(module).__module__)
    for name in _ROTARY:
        fn = getattr(modeling, name, None)
        if callable(fn):
            return name, fn
    return None


_ROPE_LAYERS: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()


def rope_layers(model: nn.Module) -> frozenset[int]:
    """The layers whose attention rotates queries and keys. From the modules' ``use_rope`` flags where they
    have them (SmolLM3, Llama-4); otherwise observed: one 4-token forward with the modeling module's rotary
    function wrapped records which layers call it (Cohere2 calls it on its sliding layers only)."""
    if model in _ROPE_LAYERS:
        return _ROPE_LAYERS[model]
    mods = attention_modules(model)
    found = _rotary(mods[0]) if mods else None
    if found is None:
        layers: frozenset[int] = frozenset()
    elif all(hasattr(m, "use_rope") for m in mods):
        layers = frozenset(m.layer_idx for m in mods if m.use_rope)
    else:
        layers = _observe_rope(model, mods, *found)
    _ROPE_LAYERS[model] = layers
    return layers


def _observe_rope(model: nn.Module, mods: list[nn.Module], name: str, fn: Callable[..., Any]) -> frozenset[int]:
    modeling = sys.modules[type(mods[0]).__module__]
    running: list[int] = []
    called: set[int] = set()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if running:
            called.add(running[-1])
        return fn(*args, **kwargs)

    def enter(m: nn.Module, args: Any) -> None:
        running.append(m.layer_idx)

    def leave(m: nn.Module, args: Any, out: Any) -> None:
        running.pop()

    handles = [m.register_forward_pre_hook(enter) for m in mods] + [m.register_forward_hook(leave) for m in mods]
    setattr(modeling, name, wrapped)
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device), use_cache=False)
    finally:
        setattr(modeling, name, fn)
        for h in handles:
            h.remove()
    return frozenset(called)


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
    rope: bool
    _rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
    _norm_before_split: bool
    _gated: bool = False  # Qwen3-Next: each head's q_proj outputs are [query | output gate]
    _rope_dims: int | None = None  # MLA: only the last ``qk_rope_head_dim`` dims of a query head rotate

    @property
    def layer_idx(self) -> int:
        return int(self.module.layer_idx)

    def raw_queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """Queries before RoPE, ``[batch, heads, tokens, head_dim]``, exactly as the module computes them."""
        m = self.module
        if self._rope_dims is not None and getattr(m, "q_a_proj", None) is not None:  # MLA's low-rank queries
            q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden)))
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
        ``position_embeddings`` (``(cos, sin)``, or Llama-4's complex ``freqs_cis``) where the layer rotates.
        ``positions`` (absolute, ``[tokens]``) serve Llama-4's temperature scaling of NoPE layers."""
        q = self.raw_queries(hidden)
        m = self.module
        if self.rope and self._rotary is not None:
            if isinstance(position_embeddings, torch.Tensor):  # Llama-4: [b, t, h, d] in, freqs_cis
                q = self._rotary(q.transpose(1, 2), q.transpose(1, 2), position_embeddings)[0].transpose(1, 2)
            elif self._rope_dims is not None:  # MLA: [no-RoPE part | rotary part] per head
                cos, sin = position_embeddings
                q_pass, q_rot = q.split([q.shape[-1] - self._rope_dims, self._rope_dims], dim=-1)
                q = torch.cat((q_pass, self._rotary(q_rot, q_rot[:, :1], cos, sin)[0]), dim=-1)
            else:
                cos, sin = position_embeddings
                q = self._rotary(q, q[:, :1], cos, sin)[0]
        if hasattr(m, "qk_norm"):  # Llama-4's L2 norm, after RoPE
            q = m.qk_norm(q)
        if getattr(m, "attn_temperature_tuning", False) and not self.rope:
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
        need = [f"attention attribute {a}" for a in ("qk_head_dim", "qk_rope_head_dim", "scaling")
                if getattr(module, a, None) is None]
        if not callable(getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)):
            need.append("rotary position embeddings (apply_rotary_pos_emb in its modeling module)")
        return need
    need = []
    if not (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
        need.append("a q_proj or fused qkv_proj query projection")
    for attr in ("head_dim", "num_key_value_groups", "scaling"):
        if getattr(module, attr, None) is None:
            need.append(f"attention attribute {attr}")
    return need


def layer_capabilities(module: nn.Module, kind: LayerKind, config: Any, rope: bool) -> list[str]:
    """The attention features one layer uses (names from this module's constants)."""
    if _mla(module):  # DeepSeek-V2/V3: queries from a low-rank projection, RoPE on part of each head
        return [MLA, ROPE, {FULL: GLOBAL, SLIDING: SLIDING_WINDOW, CHUNKED: CHUNKED_ATTENTION}[kind.attention]]
    caps = [QKV_PROJ if not hasattr(module, "q_proj") and hasattr(module, "qkv_proj") else Q_PROJ]
    heads, head_dim = int(config.num_attention_heads), getattr(module, "head_dim", None)
    proj = getattr(module, "q_proj", None)
    if head_dim and isinstance(proj, nn.Linear) and proj.out_features == 2 * heads * int(head_dim):
        caps.append(GATED_Q)  # Qwen3-Next: queries and a sigmoid gate from one projection
    width = _norm_width(module)
    if width is not None:
        caps.append(Q_NORM_FULL if head_dim and width == heads * int(head_dim) and width != head_dim else Q_NORM_HEAD)
    found = _rotary(module)
    if rope and found is not None:
        caps.append(ROPE_COMPLEX if found[0] == "apply_rotary_emb" else ROPE)
        if hasattr(module, "qk_norm"):
            caps.append(L2_NORM)
    else:
        caps.append(NOPE)
        if getattr(module, "attn_temperature_tuning", False):
            caps.append(TEMPERATURE)
    caps.append({FULL: GLOBAL, SLIDING: SLIDING_WINDOW, CHUNKED: CHUNKED_ATTENTION}[kind.attention])
    if getattr(module, "attn_logit_softcapping", None) is not None:
        caps.append(SOFTCAP)
    if isinstance(getattr(module, "sinks", None), torch.Tensor):
        caps.append(SINKS)
    return caps


def capabilities(model: nn.Module) -> dict[str, list[int]]:
    """Every attention feature ``model`` uses, with the layers that use it (raises :class:`KVBenchError` for a
    layout kvbench cannot read: no query projection, hybrid layer types, unknown layer types)."""
    config = model.config
    kinds = layer_kinds(config)
    mods = attention_modules(model)
    if not mods:
        raise KVBenchError("it lacks attention modules with a q_proj or qkv_proj and a layer_idx")
    need = _missing(mods[0])
    if need:
        raise KVBenchError(f"it lacks {', '.join(need)}")
    rotating = rope_layers(model)
    caps: dict[str, list[int]] = {}
    for m, kind in zip(mods, _attention_kinds(config, mods), strict=True):
        for c in layer_capabilities(m, kind, config, m.layer_idx in rotating):
            caps.setdefault(c, []).append(m.layer_idx)
    recurrent = [i for i, k in enumerate(kinds) if k.recurrent]
    if recurrent:
        caps[RECURRENT] = recurrent
    return caps


def adapt(module: nn.Module, kind: LayerKind, config: Any, rope: bool) -> AttentionAdapter:
    """The adapter of one attention module; :class:`KVBenchError` naming what is missing."""
    need = _missing(module)
    if need:
        raise KVBenchError(f"{type(module).__name__} lacks {', '.join(need)}")
    if _mla(module):
        interleave = bool(getattr(config, "rope_interleave", False))
        modeling = sys.modules[type(module).__module__]
        return AttentionAdapter(
            module=module, kind=kind, num_heads=int(config.num_attention_heads), head_dim=int(module.qk_head_dim),
            num_kv_groups=int(config.num_attention_heads), scaling=float(module.scaling), softcap=None, sinks=None,
            rope=True, _rotary=getattr(modeling, "apply_rotary_pos_emb_interleave" if interleave
                                       else "apply_rotary_pos_emb"),
            _norm_before_split=False, _rope_dims=int(module.qk_rope_head_dim))
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
    found = _rotary(module)
    return AttentionAdapter(
        module=module, kind=kind, num_heads=num_heads, head_dim=head_dim,
        num_kv_groups=int(module.num_key_value_groups), scaling=float(module.scaling),
        softcap=None if softcap is None else float(softcap),
        sinks=sinks if isinstance(sinks, torch.Tensor) else None,
        rope=rope and found is not None, _rotary=None if found is None else found[1],
        _norm_before_split=width == num_heads * head_dim and width != head_dim,
        _gated=GATED_Q in layer_capabilities(module, kind, config, rope))


def adapters(model: nn.Module) -> list[AttentionAdapter]:
    """Adapters of every attention layer of ``model``, in layer order (no capability check: see
    :func:`describe`)."""
    config = model.config
    mods = attention_modules(model)
    kinds = _attention_kinds(config, mods)
    rotating = rope_layers(model)
    return [adapt(m, kind, config, m.layer_idx in rotating) for m, kind in zip(mods, kinds, strict=True)]


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


def nothing_to_compress(config: Any, names: list[str]) -> str | None:
    """The line saying that ``names`` (strategies other than ``full``) can change nothing, when every layer
    attends within a window (sliding or chunked): kvbench leaves those windows dense, as transformers caches
    them, so each such strategy holds exactly ``full``'s bytes (0% reduction by construction, not measured)."""
    kinds = layer_kinds(config)
    others = [n for n in names if n != "full"]
    if not others or not all(k.sliding for k in kinds if not k.recurrent):
        return None
    windows = sorted({k.window for k in kinds if k.window is not None})
    return (f"every layer of this model attends within a window ({'/'.join(map(str, windows))} tokens), which "
            f"kvbench leaves dense: {', '.join(others)} cannot change its cache (0% reduction by construction)")


def _span(layers: list[int]) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}-{layers[-1]} ({len(layers)})"
