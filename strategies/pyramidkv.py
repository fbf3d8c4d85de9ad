"""``pyramidkv``: SnapKV scores with a budget that shrinks with depth.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling":
attention is spread widely in lower layers and concentrates on a few tokens in higher ones, so lower
layers get more of the cache and higher layers less. Tokens are chosen as in SnapKV (observation window,
pooled scores, window always kept); only the per-layer budget changes.

Budget schedule (the paper's): with a mean of ``m`` non-window tokens per layer, the top layer keeps
``m / beta`` and layer 0 keeps ``2m - m / beta``, linearly in between, so the mean over layers is ``m``:
the same total as SnapKV at the same ``compression_ratio`` / ``budget_tokens``. When the low layers'
share would exceed the prefix, the excess is handed on to the next layers (the profile is shifted and
clipped), so the mean budget holds exactly whenever the prefix allows it. Generated tokens accumulate.

Layers then hold different token counts, which transformers' single per-forward attention mask does not
expect; ``bind`` installs a per-layer mask fit (:func:`strategies._eviction.fit_masks_to_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strategies._eviction import fit_masks_to_layers, keep_count
from strategies.base import RunContext, require
from strategies.snapkv import SnapKV


def pyramid_budgets(total: int, cap: int, num_layers: int, beta: float) -> list[int]:
    """Per-layer counts in ``[0, cap]``, decreasing with depth, summing to ``min(total, num_layers * cap)``."""
    total = min(total, num_layers * cap)
    mean = total / num_layers
    low = mean / beta
    high = 2 * mean - low
    depth = torch.arange(num_layers, dtype=torch.float64) / max(num_layers - 1, 1)
    profile = high - (high - low) * depth if num_layers > 1 else torch.full((1,), mean, dtype=torch.float64)
    # Shift the profile until the clipped budgets sum to the total (the clipped sum grows with the shift).
    lo, hi = -high - 1.0, float(cap) + 1.0
    for _ in range(64):  # bisection on a scalar, not a loop over tokens
        mid = (lo + hi) / 2
        if profile.add(mid).clamp(0, cap).sum() < total:
            lo = mid
        else:
            hi = mid
    real = profile.add(hi).clamp(0, cap)
    counts = real.floor()
    # Largest remainders get the leftover tokens, so the integer counts sum exactly to the total.
    leftover = int(round(total - float(counts.sum())))
    if leftover > 0:
        order = torch.argsort(real - counts, descending=True, stable=True)[:leftover]
        counts[order] += 1
    return [int(c) for c in counts.clamp(0, cap)]


@dataclass
class PyramidKV(SnapKV):
    """SnapKV selection with a linearly decreasing per-layer budget of the same mean."""

    name = "pyramidkv"
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        require(isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool) and self.beta >= 1,
                f"pyramidkv.beta must be a number >= 1 (the top layer keeps mean/beta; got {self.beta!r})")

    def bind(self, context: RunContext) -> None:
        super().bind(context)
        fit_masks_to_layers(context)

    def prefill_keep(self, n: int, layer_idx: int, num_layers: int) -> int:
        mean_keep = keep_count(n, self.compression_ratio, self.budget_tokens)
        window = min(self.window_size, mean_keep)
        budgets = pyramid_budgets((mean_keep - window) * num_layers, n - window, num_layers, float(self.beta))
        return window + budgets[layer_idx]
