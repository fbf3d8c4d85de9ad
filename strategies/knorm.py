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
from kvbench.strategies._eviction import ScorerStrategy
from kvbench.strategies.base import LayerCapture


@dataclass
class Knorm(ScorerStrategy):
    """Lowest key-norm tokens per KV head."""

    name = "knorm"

    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
              capture: LayerCapture | None) -> torch.Tensor:
        return -keys.float().norm(dim=-1)
