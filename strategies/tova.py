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

Differences from the references, each an option: TOVA's own code (``schwartz-lab-NLP/TOVA``) can evict the
current token; kvpress's ``TOVAPress`` gives it the maximum score so it always stays (``protect_last = true``).
With ``compression_ratio`` the budget follows the tokens seen so far (the held fraction stays ``1 - r``);
the paper fixes the cache size — ``fixed_cache = true`` keeps the budget of the prompt for the whole
generation (``budget_tokens`` is always a fixed size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.strategies._eviction import EvictionPolicy, EvictionStrategy, attention_probs, require_bool
from kvbench.strategies.base import LayerCapture


class _LastQueryAttention(EvictionPolicy):
    strategy: Tova

    def protected(self, keep: int) -> tuple[int, int]:
        return 0, min(1, keep) if self.strategy.protect_last else 0

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        assert queries is not None and capture is not None
        probs = attention_probs(queries[..., -1:, :], keys, capture.scaling, capture.sinks)[..., 0, :]  # [B, H, G, N]
        per_kv_head = probs.mean(dim=2)
        return per_kv_head if self.strategy.per_head else per_kv_head.mean(dim=1, keepdim=True)


@dataclass
class Tova(EvictionStrategy):
    """Lowest attention from the current query leaves, at prefill and every decode step.

    Defaults follow the paper and TOVA's code; ``protect_last = true`` reproduces kvpress's ``TOVAPress``.
    """

    name = "tova"
    attention_guided = True
    per_head: bool = False
    protect_last: bool = False  # true: the newest token always stays (kvpress's TOVAPress)
    fixed_cache: bool = False  # true: the prompt's budget for the whole generation (the paper's fixed size)

    @property
    def query_window(self) -> int | None:
        return 1  # the last prefix query ranks the prefix

    def validate(self) -> None:
        super().validate()
        for key in ("per_head", "protect_last", "fixed_cache"):
            require_bool(getattr(self, key), f"tova.{key}")

    def evicts_during_decode(self) -> bool:
        return True

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _LastQueryAttention(self, layer_idx, num_layers)
