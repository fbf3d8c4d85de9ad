"""``snapkv``: keep what an observation window of the last queries attends to, pooled into clusters.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation": the attention pattern of
the last few prompt positions (the *observation window*) predicts which prefix tokens generation will
read. Each prefix token's score is the attention the window's ``window_size`` queries pay it, summed over
those queries, then max- or average-pooled along the sequence with ``kernel_size`` so neighbours of a
selected token come along (keeping whole phrases, not isolated tokens). The window's own tokens are
always kept; the rest of the budget goes to the top-scoring prefix tokens, per KV head.

GQA: the pooled scores of the query heads sharing a KV head are averaged (see ``_eviction``). The prefill
is compressed once; generated tokens then accumulate, as in the paper. kvpress's ``SnapKVPress`` averages
over the window instead of summing, which ranks identically; with equal parameters its kept index sets equal
kvbench's on every layer.

Presets — whose defaults a run carries, in one word (``strategy.preset=kvpress``):

=================== ============ ============ ========= ==============================================
preset              window_size  kernel_size  pooling   source
=================== ============ ============ ========= ==============================================
``kvcache_factory`` 32           7            max       KVCache-Factory's LongBench scripts (default)
``snapkv``          32           5            avg       the SnapKV repository (FasterDecoding/SnapKV)
``kvpress``         64           5            avg       NVIDIA/kvpress ``SnapKVPress``
=================== ============ ============ ========= ==============================================

Precedence: a value set explicitly (CLI, YAML, ``build`` parameters) wins; a field left ``null`` takes the
preset's value. ``params()`` records the resolved values, not the preset name, so two configurations with
the same effective parameters share one label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from kvbench.strategies._eviction import EvictionPolicy, EvictionStrategy, attention_probs, require_int
from kvbench.strategies.base import LayerCapture, require

POOLINGS = ("max", "avg", "none")
#: Observation-window defaults of each reference implementation (see the module docstring).
PRESETS: dict[str, dict[str, object]] = {
    "kvcache_factory": {"window_size": 32, "kernel_size": 7, "pooling": "max"},
    "snapkv": {"window_size": 32, "kernel_size": 5, "pooling": "avg"},
    "kvpress": {"window_size": 64, "kernel_size": 5, "pooling": "avg"},
}
DEFAULT_PRESET = "kvcache_factory"


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool ``[..., N]`` scores along the sequence with a centred ``kernel_size`` window (same length out)."""
    if pooling == "none" or kernel_size == 1 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size, stride=1, padding=kernel_size // 2).reshape(scores.shape)


class ObservationWindow(EvictionPolicy):
    """SnapKV's score; also PyramidKV's, which only changes the per-layer budget."""

    strategy: SnapKV

    def __init__(self, strategy: SnapKV, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.window = strategy.window_size  # shrinks to the queries actually captured

    def protected(self, keep: int) -> tuple[int, int]:
        return 0, min(self.window, keep)

    def prefill_scores(self, keys: torch.Tensor, values: torch.Tensor,
                       queries: torch.Tensor | None, capture: LayerCapture | None) -> torch.Tensor:
        assert queries is not None and capture is not None
        n = keys.shape[-2]
        self.window = w = min(self.strategy.window_size, queries.shape[-2], n)
        probs = attention_probs(queries[..., -w:, :], keys, capture.scaling, capture.sinks)  # [B, H, G, w, N]
        votes = probs[..., : n - w].sum(dim=-2)  # attention the window pays each older token
        pooled = pool_scores(votes, self.strategy.kernel_size, self.strategy.pooling).mean(dim=2)
        return F.pad(pooled, (0, w))  # window tokens are protected; their score is never read


@dataclass
class SnapKV(EvictionStrategy):
    """Observation-window attention, pooled, per KV head; window tokens always kept.

    Defaults are KVCache-Factory's (``preset = "kvcache_factory"``: window 32, kernel 7, max pooling);
    ``preset = "kvpress"`` (64, 5, avg) or ``"snapkv"`` (32, 5, avg) carry those references' defaults.
    ``window_size``/``kernel_size``/``pooling`` left ``None`` come from the preset; set ones win.
    """

    name = "snapkv"
    attention_guided = True
    preset: str = DEFAULT_PRESET
    window_size: int | None = None
    kernel_size: int | None = None
    pooling: str | None = None

    def __post_init__(self) -> None:
        require(self.preset in PRESETS,
                f"{self.name}.preset must be one of {', '.join(PRESETS)} (got {self.preset!r})")
        for key, value in PRESETS[self.preset].items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        super().__post_init__()

    def params(self) -> dict[str, Any]:
        # The preset is resolved into the fields above: record (and label) what actually runs.
        return {k: v for k, v in super().params().items() if k != "preset"}

    @property
    def query_window(self) -> int | None:
        return self.window_size  # the engine captures this many prefix queries

    def validate(self) -> None:
        super().validate()
        p = self.name
        require_int(self.window_size, 1, f"{p}.window_size")
        require_int(self.kernel_size, 1, f"{p}.kernel_size")
        # odd, so the pooling window is centred and the output keeps the sequence length
        require(self.kernel_size % 2 == 1, f"{p}.kernel_size must be odd (got {self.kernel_size})")
        require(self.pooling in POOLINGS,
                f"{p}.pooling must be one of {', '.join(POOLINGS)} (got {self.pooling!r})")

    def policy(self, layer_idx: int, num_layers: int) -> EvictionPolicy:
        return ObservationWindow(self, layer_idx, num_layers)
