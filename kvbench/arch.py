"""Architecture adapters: what a KV-cache strategy needs from a model, read from the model itself.

A strategy needs, per decoder layer, the post-RoPE queries (attention-aware scoring: SnapKV, H2O, TOVA...),
the attention's scaling and logit soft-cap, and whether the layer attends globally or over a sliding window
(and how wide). transformers' decoder families differ in exactly these places:

================  =======================================================================================
query projection  separate ``q_proj`` (Llama, Mistral, Qwen, Gemma, OLMo-2) or fused ``qkv_proj`` whose
                  first ``num_attention_heads * head_dim`` outputs are the queries (Phi-3)
q norm            none; RMSNorm over ``head_dim`` after the head split (Qwen3, Gemma-3); RMSNorm over the
                  whole projection before the split (OLMo-2) — told apart by the norm's weight size
rotary            full or partial (Phi-3's ``partial_rotary_factor``): the modeling module's own
                  ``apply_rotary_pos_emb`` is called with the ``cos``/``sin`` the model hands the layer, so
                  partial rotary and per-layer-type RoPE (Gemma-3's local/global bases) come for free
attention type    ``config.layer_types`` (Gemma-2/3, Qwen2/3 and their MoE variants) or, without it, every
                  layer sliding when ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3 — their
                  models pick the sliding mask for all layers then)
scaling, soft-cap the module's ``scaling`` (Gemma's ``query_pre_attn_scalar ** -0.5``) and
                  ``attn_logit_softcapping`` (Gemma-2)
================  =======================================================================================

Only families whose attention is verified by ``tests/test_arch_matrix.py`` (captured queries equal the
module's own to 1e-5) are accepted: :data:`SUPPORTED` by ``config.model_type``. Anything else is refused with
one line naming what is missing (:func:`describe`), never a traceback halfway through a run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvbench.errors import KVBenchError

#: ``config.model_type`` of every family the test matrix covers (Gemma-3's text model is ``gemma3_text``).
SUPPORTED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma2",
             "gemma3_text", "phi3", "olmo2")

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class LayerKind:
    """How one decoder layer attends: ``window`` is the sliding window (``None``: global attention)."""

    attention: str = FULL
    window: int | None = None

    @property
    def sliding(self) -> bool:
        return self.attention == SLIDING


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
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise KVBenchError(f"layer type(s) {', '.join(unknown)} are not supported; kvbench handles "
                           f"{FULL} and {SLIDING} layers")
    if SLIDING in types and not window:
        raise KVBenchError("config.layer_types names sliding_attention layers but config.sliding_window is unset")
    return [LayerKind(t, int(window) if t == SLIDING else None) for t in types]


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    mods = [m for m in model.modules()
            if (hasattr(m, "q_proj") or hasattr(m, "qkv_proj")) and getattr(m, "layer_idx", None) is not None]
    return sorted(mods, key=lambda m: m.layer_idx)


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
    _rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    _norm_before_split: bool

    @property
    def layer_idx(self) -> int:
        return int(self.module.layer_idx)

    def raw_queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """Queries before RoPE, ``[batch, heads, tokens, head_dim]``, exactly as the module computes them."""
        m = self.module
        # A fused projection's queries are its first num_heads * head_dim outputs (Phi-3).
        q = m.q_proj(hidden) if hasattr(m, "q_proj") else m.qkv_proj(hidden)[..., : self.num_heads * self.head_dim]
        norm = getattr(m, "q_norm", None)
        if norm is not None and self._norm_before_split:
            q = norm(q)
        q = q.view(*hidden.shape[:-1], -1, self.head_dim)
        if norm is not None and not self._norm_before_split:
            q = norm(q)
        return q.transpose(1, 2)

    def queries(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Post-RoPE queries ``[batch, heads, tokens, head_dim]`` for ``hidden`` ``[batch, tokens, hidden]``,
        rotated by the model's own ``apply_rotary_pos_emb`` (full or partial rotary)."""
        q = self.raw_queries(hidden)
        return self._rotary(q, q[:, :1], cos, sin)[0]


def _missing(module: nn.Module) -> list[str]:
    need = []
    if not (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
        need.append("a q_proj or fused qkv_proj query projection")
    for attr in ("head_dim", "num_key_value_groups", "scaling"):
        if getattr(module, attr, None) is None:
            need.append(f"attention attribute {attr}")
    if not callable(getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)):
        need.append("rotary position embeddings (apply_rotary_pos_emb in its modeling module)")
    return need


def adapt(module: nn.Module, kind: LayerKind, config: Any) -> AttentionAdapter:
    """The adapter of one attention module; :class:`KVBenchError` naming what is missing."""
    need = _missing(module)
    if need:
        raise KVBenchError(f"{type(module).__name__} lacks {', '.join(need)}")
    head_dim = int(module.head_dim)
    num_heads = int(config.num_attention_heads)
    norm = getattr(module, "q_norm", None)
    width = None if norm is None or getattr(norm, "weight", None) is None else norm.weight.numel()
    if width not in (None, head_dim, num_heads * head_dim):
        raise KVBenchError(f"{type(module).__name__}.q_norm normalises {width} features, neither head_dim "
                           f"({head_dim}) nor the whole projection ({num_heads * head_dim})")
    own_window = getattr(module, "sliding_window", None)
    if own_window is not None and own_window != kind.window:
        raise KVBenchError(f"layer {module.layer_idx}: its attention uses a {own_window}-token window but the "
                           f"config says {kind}")
    softcap = getattr(module, "attn_logit_softcapping", None)
    return AttentionAdapter(
        module=module, kind=kind, num_heads=num_heads, head_dim=head_dim,
        num_kv_groups=int(module.num_key_value_groups), scaling=float(module.scaling),
        softcap=None if softcap is None else float(softcap),
        _rotary=sys.modules[type(module).__module__].apply_rotary_pos_emb,
        _norm_before_split=width == num_heads * head_dim and width != head_dim)


def adapters(model: nn.Module) -> list[AttentionAdapter]:
    """Adapters of every attention layer of ``model``, in layer order (no family check: see :func:`describe`)."""
    config = model.config
    kinds = layer_kinds(config)
    mods = attention_modules(model)
    if len(mods) != len(kinds):
        raise KVBenchError(f"found {len(mods)} attention modules with q_proj/qkv_proj and a layer_idx for "
                           f"{len(kinds)} decoder layers")
    return [adapt(m, kinds[m.layer_idx], config) for m in mods]


def describe(model: nn.Module) -> list[AttentionAdapter]:
    """Check that kvbench supports ``model``'s architecture and return its adapters.

    One :class:`KVBenchError` line otherwise: what the layout lacks, or that the family is not among the
    verified :data:`SUPPORTED` ones.
    """
    config = model.config
    family = str(getattr(config, "model_type", "") or type(model).__name__)
    name = type(model).__name__
    if family not in SUPPORTED:
        mods = attention_modules(model)
        gap = _missing(mods[0]) if mods else ["attention modules with a q_proj or qkv_proj and a layer_idx"]
        what = f"it lacks {', '.join(gap)}" if gap else "its attention is not verified by kvbench's test matrix"
        raise KVBenchError(f"{name} (model_type {family!r}) is not supported: {what}; supported model types: "
                           f"{', '.join(SUPPORTED)}")
    try:
        return adapters(model)
    except KVBenchError as exc:
        raise KVBenchError(f"{name} (model_type {family!r}) is not supported: {exc}") from None
