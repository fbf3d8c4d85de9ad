"""``full``: the uncompressed reference cache every other strategy is measured against."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy

from kvbench.quantizers import gather_tokens

#: Token slots reserved past the held tokens whenever a store grows, so the appends that follow (the rest of a
#: question, the decode steps) write in place: concatenating, as transformers' ``DynamicLayer`` does, copies
#: the whole cache at every step (at 4K tokens, ~90 MB per decode step for SmolLM2-135M in bf16).
RESERVE_TOKENS = 64


class FullStore(LayerStore):
    """Dense K/V in the model's dtype. ``keys``/``values`` are exactly the held tokens (views into a buffer with
    up to :data:`RESERVE_TOKENS` free slots once the store has grown); whoever assigns them (eviction, a
    sliding window) replaces the buffer, and the next append starts a new one."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    # (key buffer, value buffer, the keys view, the values view) of the last in-place append
    _grown: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        self.keys, self.values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
            return self.keys, self.values
        n, m = self.keys.shape[-2], keys.shape[-2]
        g = self._grown
        if g is None or g[2] is not self.keys or g[3] is not self.values or n + m > g[0].shape[-2]:
            # A new buffer: the held tokens may be a shared capture or another store's, never written into.
            kb = self.keys.new_empty(*self.keys.shape[:-2], n + m + RESERVE_TOKENS, self.keys.shape[-1])
            vb = self.values.new_empty(*self.values.shape[:-2], n + m + RESERVE_TOKENS, self.values.shape[-1])
            kb.narrow(-2, 0, n).copy_(self.keys)
            vb.narrow(-2, 0, n).copy_(self.values)
        else:
            kb, vb = g[0], g[1]
        # Slots n.. were never part of a view handed out, so earlier views keep their values. narrow, not
        # indexing: the same views and copies at a fraction of the per-call cost (twice per layer and step).
        kb.narrow(-2, n, m).copy_(keys)
        vb.narrow(-2, n, m).copy_(values)
        self.keys, self.values = kb.narrow(-2, 0, n + m), vb.narrow(-2, 0, n + m)
        self._grown = (kb, vb, self.keys, self.values)
        return self.keys, self.values

    def compact(self) -> None:
        """After a chunk of a chunked prefill: the held tokens in storage of their own, so the bytes the store
        holds (``kv_bytes``) are its tokens', without the reserve."""
        if self._grown is not None and self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys.clone(), self.values.clone()
            self._grown = None

    def tensors(self) -> Iterable[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def num_tokens(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def select_tokens(self, index: torch.Tensor) -> None:
        """Keep held tokens ``index`` (``[batch, kv_heads, n]``) in new, smaller tensors, freeing the old."""
        if self.keys is None or self.values is None:
            return
        # gather allocates: tensors returned to attention (or shared with a captured prefill) stay untouched.
        self.keys = gather_tokens(self.keys, index, -2)
        self.values = gather_tokens(self.values, index, -2)


@dataclass
class Full(Strategy):
    """No compression: the baseline of measurement spec v1."""

    name = "full"
    family = "baseline"

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return FullStore(self, layer_idx, num_layers)
