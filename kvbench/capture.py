"""Query capture: forward pre-hooks on attention modules that record post-RoPE queries.

Attention-aware strategies (SnapKV, H2O, TOVA, ...) score keys against queries, but transformers'
cache API only ever sees keys and values. The hook recomputes the queries of the last ``window``
positions through the layer's :class:`kvbench.arch.AttentionAdapter` (the module's own query projection,
fused or not, its q norm, and the rotary function the layer was observed to call, on the position embeddings
the model passes in), so no T x T attention matrix is ever materialised and every supported family's
queries equal the module's own (``tests/test_arch_matrix.py``).

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

from kvbench.arch import adapters, attention_modules

__all__ = ["LayerCapture", "QueryRecorder", "attention_modules"]


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
    #: GPT-OSS's learned sink logit per query head ``[q_heads]``: an extra softmax column scores must include.
    sinks: torch.Tensor | None = None


class QueryRecorder:
    """Keeps, per attention layer (in layer order), the queries of the last ``window`` positions of the most
    recent forward."""

    def __init__(self, model: nn.Module, window: int | None) -> None:
        self.window = window
        self.adapters = {a.layer_idx: a for a in adapters(model)}
        self.modules = [a.module for a in self.adapters.values()]
        self.captures: list[LayerCapture] = [
            LayerCapture(layer_idx=a.layer_idx, num_kv_groups=a.num_kv_groups, scaling=a.scaling,
                         sinks=None if a.sinks is None else a.sinks.detach())
            for a in self.adapters.values()
        ]
        # By layer index: a hybrid's recurrent layers have no attention module, so no capture.
        self._by_layer = {c.layer_idx: c for c in self.captures}
        self._handles: list[Any] = []
        self._positions: torch.Tensor | None = None

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        emb = kwargs.get("position_embeddings")  # (cos, sin), Llama-4's complex freqs_cis, or None (NoPE)
        adapter = self.adapters[module.layer_idx]
        positions = None
        if getattr(module, "attn_temperature_tuning", False):  # Llama-4 scales NoPE queries by position
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            positions = torch.arange(hidden.shape[1], device=hidden.device) + past
        if self.window is not None and self.window < hidden.shape[1]:
            w = self.window
            hidden = hidden[:, -w:]
            positions = None if positions is None else positions[-w:]
            if emb is not None:
                emb = emb[:, -w:] if isinstance(emb, torch.Tensor) else tuple(e[:, -w:] for e in emb)
        cap = self._by_layer[module.layer_idx]
        cap.queries = adapter.queries(hidden, emb, positions)
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
