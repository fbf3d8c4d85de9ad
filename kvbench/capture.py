"""Query capture: forward pre-hooks on attention modules that record post-RoPE queries.

Attention-aware strategies (SnapKV, H2O, TOVA, ...) score keys against queries, but transformers'
cache API only ever sees keys and values. The hook recomputes the queries of the last ``window``
positions from the attention module's own ``q_proj`` and the rotary embeddings the model passes in,
so no T x T attention matrix is ever materialised. It works for Llama-family attention modules
(``q_proj``, ``head_dim``, ``num_key_value_groups``, ``scaling``; optional ``q_norm``).

:class:`LayerCapture` lives here, in kvbench's core (which imports no strategy), so that ``strategies`` can
import it without importing the harness above it — ``cache``, ``engine``, ``config`` and others import
``strategies``, and ``tests/test_import_graph.py`` keeps strategies from importing them back
(``strategies.base`` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class LayerCapture:
    """What one attention layer exposed during the last forward pass.

    ``queries`` are post-RoPE queries ``[batch, q_heads, window, head_dim]`` of the last ``window``
    positions of that forward (all positions when the window is ``None``); ``positions`` are their
    absolute token positions.
    """

    layer_idx: int
    num_kv_groups: int
    scaling: float
    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    return sorted(mods, key=lambda m: m.layer_idx)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def project_queries(module: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Post-RoPE queries ``[batch, q_heads, tokens, head_dim]`` for ``hidden`` ``[batch, tokens, hidden]``."""
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin


class QueryRecorder:
    """Keeps, per layer, the queries of the last ``window`` positions of the most recent forward."""

    def __init__(self, model: nn.Module, window: int | None) -> None:
        self.window = window
        self.modules = attention_modules(model)
        self.captures: list[LayerCapture] = [
            LayerCapture(layer_idx=m.layer_idx, num_kv_groups=int(m.num_key_value_groups), scaling=float(m.scaling))
            for m in self.modules
        ]
        self._handles: list[Any] = []
        self._positions: torch.Tensor | None = None

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        if self.window is not None and self.window < hidden.shape[1]:
            hidden, cos, sin = hidden[:, -self.window:], cos[:, -self.window:], sin[:, -self.window:]
        cap = self.captures[module.layer_idx]
        cap.queries = project_queries(module, hidden, cos, sin)
        pos = kwargs.get("position_ids")
        cap.positions = None if pos is None else pos[..., -cap.queries.shape[-2]:]

    def __enter__(self) -> QueryRecorder:
        if self.window != 0:
            self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
