"""``pyramidkv``: SnapKV scores with a budget that shrinks with depth.

Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling":
attention is spread widely in lower layers and concentrates on a few tokens in higher ones, so lower
layers get more of the cache and higher layers less. Tokens are chosen as in SnapKV (observation window,
pooled scores, window always kept); only the per-layer budget changes.

Budget schedule — kvpress's (``PyramidKVPress.get_layer_budget`` in NVIDIA/kvpress
``kvpress/presses/pyramidkv_press.py``, which adapts KVCache-Factory ``pyramidkv/pyramidkv_utils.py``,
``PyramidKVCluster.update_kv``). With ``n`` prefix tokens, a mean of ``m`` kept tokens per layer
(``n * (1 - compression_ratio)``, or ``budget_tokens``) and window ``w``: the top layer keeps
``m / beta`` and layer 0 keeps ``2m - m / beta``, linearly in between (``round``, Python's), so the mean is
``m``. When layer 0 would exceed ``n - w``, it keeps ``n - w`` and the top layer ``2m - (n - w)``: below 50%
eviction the ramp flattens but stays a ramp and no layer keeps all ``n`` tokens (4,096 tokens, ratio 0.25, 30
layers, ``w = 32``: 4,064 down to 2,080, 75% kept). Where the ramp would break ``n >= max >= min >= w``
(e.g. ``m / beta < w`` at strong eviction, or a single layer) every layer keeps ``round(m)``, SnapKV's
budget — kvpress's fallback. KVCache-Factory instead keeps the uniform SnapKV budget whenever
``n < 2 (m - w)`` (roughly: eviction below 50%) and uses integer steps; kvbench follows kvpress.

Layers then hold different token counts, which transformers' single per-forward attention mask does not
expect; ``bind`` installs a per-layer mask fit (:func:`strategies._eviction.fit_masks_to_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.strategies._eviction import fit_masks_to_layers
from kvbench.strategies.base import RunContext, require
from kvbench.strategies.snapkv import SnapKV


def pyramid_budgets(n: int, mean_keep: float, window: int, num_layers: int, beta: float) -> list[int]:
    """Tokens each layer keeps out of ``n`` (window included), kvpress's schedule (see the module docstring)."""
    low = mean_keep / beta
    high = 2 * mean_keep - low
    if high >= n - window:
        high = n - window
        low = 2 * mean_keep - high
    if num_layers < 2 or not n >= high >= low >= window:
        return [max(1, round(mean_keep))] * num_layers
    step = (high - low) / (num_layers - 1)
    return [round(high - layer * step) for layer in range(num_layers)]


@dataclass
class PyramidKV(SnapKV):
    """SnapKV selection with a linearly decreasing per-layer budget of the same mean (kvpress's schedule).

    Window, kernel and pooling come from SnapKV's ``preset`` (see :class:`~strategies.snapkv.SnapKV`);
    ``beta = 20`` in kvpress and KVCache-Factory alike.
    """

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
        if n <= 0:
            return 0
        # kvpress's mean is the unrounded n * (1 - r); a token budget is a mean of budget_tokens.
        mean = n * (1 - self.compression_ratio) if self.budget_tokens is None else min(n, self.budget_tokens)
        return min(n, pyramid_budgets(n, mean, self.window_size, num_layers, float(self.beta))[layer_idx])
