"""``streaming_llm``: attention sinks plus a window of the most recent tokens.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024): softmax attention
parks surplus mass on the first few tokens whatever they say, so dropping them breaks a model, while
keeping them plus a rolling window of recent tokens keeps perplexity stable over unbounded streams.

Here the ``sink_tokens`` first tokens and the most recent ``budget - sink_tokens`` are kept — the same
positions on every layer and head, no scores and no queries needed. The budget holds during decoding
too: after every step the oldest non-sink token leaves, as in the paper's rolling cache. With a budget
smaller than the sinks, the sinks shrink so the newest token always stays.

kvpress's ``StreamingLLMPress`` (``n_sink=4``) keeps the same prefill positions; it compresses the prefill
only, so its cache grows while decoding unless wrapped in a decoding press.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies._eviction import EvictionPolicy, EvictionStrategy, require_int


class _SinksAndWindow(EvictionPolicy):
    strategy: StreamingLLM

    def protected(self, keep: int) -> tuple[int, int]:
        sinks = min(self.strategy.sink_tokens, max(keep - 1, 0))
        return sinks, keep - sinks


@dataclass
class StreamingLLM(EvictionStrategy):
    """Attention sinks + recent window, at prefill and after every decode step."""

    name = "streaming_llm"
    sink_tokens: int = 4

    def validate(self) -> None:
        super().validate()
        require_int(self.sink_tokens, 0, "streaming_llm.sink_tokens")

    def evicts_during_decode(self) -> bool:
        return True

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return _SinksAndWindow(self, layer_idx, num_layers)
