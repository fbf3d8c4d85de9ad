"""``h2o``: Heavy-Hitter Oracle — keep the tokens with the most accumulated attention, plus recent ones.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(NeurIPS 2023): a small set of tokens collects most of the attention mass; greedily keeping the tokens
with the largest attention *summed over every query so far* (heavy hitters) together with a window of
recent tokens preserves quality at a fraction of the cache.

Prefill: each key's score is the attention it received from every prefix query (causal), summed over
queries and averaged over the query heads of its KV head; computed in blocks of 256 queries, so no T x T
matrix is ever held. This needs *all* prefix queries (``query_window = None``). Decoding: every step
adds the new queries' attention to the running sums, then the lowest-scoring non-recent token leaves,
so the cache never exceeds the budget. The running sums (float32, one per held token per KV head) are
part of what the strategy holds and count in ``kv_bytes``.

``recent_fraction`` of the budget goes to the most recent tokens (the paper splits heavy and recent
budgets evenly). With ``compression_ratio`` the budget follows the tokens seen so far (the held fraction
stays ``1 - r``); the paper (and ``FMInference/H2O``'s ``heavy_ratio``/``recent_ratio`` of the prompt) fixes
the cache size — ``fixed_cache = true`` keeps the prompt's budget for the whole generation
(``budget_tokens`` is always a fixed size). kvpress has no H2O press; its ``ObservedAttentionPress``
averages attention over the queries that see each key instead of summing, and compresses the prefill only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.strategies._eviction import EvictionPolicy, EvictionStrategy, attention_column_sums, require_bool
from kvbench.strategies.base import LayerCapture, require

from kvbench.errors import KVBenchError


class _HeavyHitters(EvictionPolicy):
    strategy: H2O
    acc: torch.Tensor | None = None  # accumulated attention per held token, [B, H, held]

    def protected(self, keep: int) -> tuple[int, int]:
        return 0, round(self.strategy.recent_fraction * keep)

    def queries_needed(self, n_new: int) -> int:
        return n_new  # every new query adds to the running sums

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        assert queries is not None and capture is not None
        n = keys.shape[-2]
        if queries.shape[-2] < n:
            got = queries.shape[-2]
            raise KVBenchError(f"h2o needs the queries of all {n} prefix positions (got {got}); "
                               "capture them with query_window=None")
        self.acc = attention_column_sums(queries[..., -n:, :], keys, capture.scaling, sinks=capture.sinks).mean(dim=2)
        return self.acc

    def decode_scores(self, keys: torch.Tensor, values: torch.Tensor, n_new: int,
                      queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        assert queries is not None and capture is not None and self.acc is not None
        fresh = attention_column_sums(queries[..., -n_new:, :], keys, capture.scaling,
                                      sinks=capture.sinks).mean(dim=2)
        self.acc = torch.cat([self.acc, self.acc.new_zeros(*self.acc.shape[:2], n_new)], dim=-1) + fresh
        return self.acc

    def on_select(self, index: torch.Tensor) -> None:
        if self.acc is not None:
            self.acc = torch.gather(self.acc, -1, index)

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.acc is None else [self.acc]


@dataclass
class H2O(EvictionStrategy):
    """Heavy hitters by accumulated attention + recent window, at prefill and every decode step."""

    name = "h2o"
    attention_guided = True
    recent_fraction: float = 0.5
    fixed_cache: bool = False  # true: the prompt's budget for the whole generation (the paper's fixed size)

    @property
    def query_window(self) -> int | None:
        return None  # the accumulated attention needs every prefix query

    def validate(self) -> None:
        super().validate()
        r = self.recent_fraction
        require(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0,
                f"h2o.recent_fraction must be in [0, 1] (got {r!r})")
        require_bool(self.fixed_cache, "h2o.fixed_cache")

    def evicts_during_decode(self) -> bool:
        return True

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _HeavyHitters(self, layer_idx, num_layers)
