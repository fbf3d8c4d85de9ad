"""``full``: the uncompressed reference cache every other strategy is measured against."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvbench.quantizers import gather_tokens
from strategies.base import LayerCapture, LayerStore, Strategy


class FullStore(LayerStore):
    """Dense K/V in the model's dtype, grown by concatenation like transformers' ``DynamicLayer``."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        self.keys, self.values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

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
