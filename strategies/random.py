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

from strategies._eviction import EvictionPolicy, EvictionStrategy, require_bool, require_int
from strategies.base import LayerCapture


class _RandomScores(EvictionPolicy):
    strategy: RandomEviction

    def __init__(self, strategy: RandomEviction, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        # One stream per layer, continued across decode steps; the prime keeps (seed, layer) pairs apart.
        self.generator = torch.Generator().manual_seed(strategy.seed * 1_000_003 + layer_idx)

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        # Drawn from the host generator, then moved: the same tokens on every device for a given seed.
        return torch.rand(keys.shape[:3], generator=self.generator).to(keys.device)


@dataclass
class RandomEviction(EvictionStrategy):
    """Uniformly random kept tokens per (layer, KV head)."""

    name = "random"
    seed: int = 0
    decode_evict: bool = False

    def validate(self) -> None:
        super().validate()
        require_int(self.seed, 0, "random.seed")
        require_bool(self.decode_evict, "random.decode_evict")

    def evicts_during_decode(self) -> bool:
        return self.decode_evict

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _RandomScores(self, layer_idx, num_layers)
