"""``knorm``: keep the tokens whose keys have the *lowest* L2 norm.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP
2024): in trained decoders a low key norm goes with high attention received, so key norms rank tokens
without any query or attention computation (and so work with fused attention kernels). Scores are
``-||k||_2`` per (KV head, token): each head keeps its own tokens.

Decoding: by default the prefill budget is fixed and generated tokens accumulate (as in kvpress's
``KnormPress``, which is the same score); ``decode_evict=true`` also enforces the budget after every step,
which a key norm can do for new tokens at no extra cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies._eviction import EvictionPolicy, EvictionStrategy, require_bool
from strategies.base import LayerCapture


class _LowKeyNorm(EvictionPolicy):
    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        return -keys.float().norm(dim=-1)


@dataclass
class Knorm(EvictionStrategy):
    """Lowest key-norm tokens per KV head."""

    name = "knorm"
    decode_evict: bool = False

    def validate(self) -> None:
        super().validate()
        require_bool(self.decode_evict, "knorm.decode_evict")

    def evicts_during_decode(self) -> bool:
        return self.decode_evict

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _LowKeyNorm(self, layer_idx, num_layers)
