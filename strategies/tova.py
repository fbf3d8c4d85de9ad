"""``tova``: Token Omission Via Attention — drop the token the current query attends to least.

Oren et al. 2024, "Transformers are Multi-State RNNs" (EMNLP 2024): a decoder is an unbounded multi-state
RNN; capping its state with a simple policy — at every step evict the token with the lowest attention
from the *current* query — turns it into a bounded one that keeps most of the quality.

Prefill: the last prefix query's attention ranks the prefix and the top ``budget`` tokens stay
(``query_window = 1``). Decoding: after every step the current query's attention ranks held + new
tokens and the lowest go, so the cache never exceeds the budget. The paper scores with the attention
averaged over all heads of a layer and keeps the same tokens on every head (``per_head = false``, the
default, also kvpress's ``TOVAPress``); ``per_head = true`` averages only over the query heads of each
KV head and lets heads keep different tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies._eviction import EvictionPolicy, EvictionStrategy, attention_probs, require_bool
from strategies.base import LayerCapture


class _LastQueryAttention(EvictionPolicy):
    strategy: Tova
    needs_queries = True

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        assert queries is not None and capture is not None
        probs = attention_probs(queries[..., -1:, :], keys, capture.scaling)[..., 0, :]  # [B, H, G, N]
        per_kv_head = probs.mean(dim=2)
        return per_kv_head if self.strategy.per_head else per_kv_head.mean(dim=1, keepdim=True)


@dataclass
class Tova(EvictionStrategy):
    """Lowest attention from the current query leaves, at prefill and every decode step."""

    name = "tova"
    per_head: bool = False

    @property
    def query_window(self) -> int | None:
        return 1  # the last prefix query ranks the prefix

    def validate(self) -> None:
        super().validate()
        require_bool(self.per_head, "tova.per_head")

    def evicts_during_decode(self) -> bool:
        return True

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _LastQueryAttention(self, layer_idx, num_layers)
