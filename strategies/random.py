"""``random``: seeded uniform-random eviction — the control every eviction table needs.

Any scoring method should beat keeping a random subset of the same size; without this row a table cannot
tell a good score from a generous budget (the argument of e.g. Devoto et al. 2024 and of kvpress's
``RandomPress``). Each (layer, KV head) draws its own tokens from a generator seeded by ``seed`` and the
layer index, so runs are reproducible and layers differ.

Decoding: the prefill budget is fixed by default; ``decode_evict=true`` evicts random tokens after every
step, the matching control for ``streaming_llm``, ``h2o`` and ``tova``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.strategies._eviction import ScorerStrategy, require_int
from kvbench.strategies.base import LayerCapture


@dataclass
class RandomEviction(ScorerStrategy):
    """Uniformly random kept tokens per (layer, KV head)."""

    name = "random"
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        require_int(self.seed, 0, "random.seed")

    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None,
              capture: LayerCapture | None) -> torch.Tensor:
        # This is the layer's own copy (ScorerStrategy): one stream per layer, continued across decode steps;
        # the prime keeps (seed, layer) pairs apart.
        if "generator" not in vars(self):
            self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.layer_idx)
        # Drawn from the host generator, then moved: the same tokens on every device for a given seed.
        return torch.rand(keys.shape[:3], generator=self.generator).to(keys.device)
