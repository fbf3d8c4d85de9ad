"""Interval estimates and tests of measurement spec v1.1 (``docs/measurement-spec.md`` §2.1).

Per-sample task scores come in two kinds, and each gets a method that is valid at the small sample sizes a
benchmark run has:

* **binary** scores (``substring``, ``exact``): each (baseline, strategy) pair is a paired binary outcome.
  The difference of the two proportions gets Newcombe's hybrid score interval for paired data (Newcombe
  1998, *Improved confidence intervals for the difference between binomial proportions based on paired
  data*, Stat Med 17:2635-2650, method 10): each arm's Wilson score interval, combined by "square and add"
  with a correlation correction for the pairing. Unlike a bootstrap it never collapses to zero width when
  every pair agrees (5 of 5 correct in both arms gives about ±43 points). The discordant counts are tested
  with the exact McNemar test (a two-sided binomial test of the discordant pairs, McNemar 1947). A single
  proportion gets the Wilson score interval (Wilson 1927; method 3 of Newcombe 1998, Stat Med 17:857-872).
* **continuous** scores (``f1``, ``token_accuracy``): the mean paired difference gets a bias-corrected and
  accelerated (BCa) bootstrap interval (Efron 1987, JASA 82:171-185), which corrects the percentile
  interval for the bias and skew of means of bounded scores; it is computed by ``scipy.stats.bootstrap``.

Sample sizes use the normal approximation for two proportions (Fleiss, Levin & Paik 2003, *Statistical
Methods for Rates and Proportions*, 3rd ed., ch. 4, without continuity correction), ignoring the pairing: when
the two arms are positively correlated, as a compressed cache and the full cache are, the paired design
needs fewer samples, so the figures are conservative.

Everything here is a pure, deterministic function of its arguments (bootstraps take a seed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

CI_LEVEL = 0.95
POWER = 0.80
#: Resamples of the BCa bootstrap: the BCa end points are extreme percentiles of the bootstrap
#: distribution, so it needs more resamples than a percentile interval (scipy's default too).
BCA_RESAMPLES = 9999
#: Resamples (and jackknife samples) evaluated at once: bounds the memory at large n (the jackknife of n
#: values is n x (n-1) otherwise). The result does not depend on it.
BCA_BATCH = 256


# ------------------------------------------------------------------------------------------- binary


@dataclass(frozen=True)
class PairedCounts:
    """The paired 2x2 table of two binary arms on the same samples."""

    both: int  # both arms correct
    only_a: int  # only arm a correct
    only_b: int  # only arm b correct
    neither: int

    @property
    def n(self) -> int:
        return self.both + self.only_a + self.only_b + self.neither


def is_binary(values: Sequence[float]) -> bool:
    """True when every value is 0 or 1."""
    x = np.asarray(values, dtype=float)
    return bool(np.all((x == 0) | (x == 1)))


def paired_counts(a: Sequence[float], b: Sequence[float]) -> PairedCounts:
    """Cell counts of two paired binary score vectors (``a[i]`` and ``b[i]`` score the same sample)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape:
        raise ValueError(f"paired scores need equal lengths, got {x.size} and {y.size}")
    if not (is_binary(x) and is_binary(y)):
        raise ValueError("paired counts need binary (0/1) scores")
    xa, yb = x == 1, y == 1
    return PairedCounts(int(np.sum(xa & yb)), int(np.sum(xa & ~yb)), int(np.sum(~xa & yb)),
                        int(np.sum(~xa & ~yb)))


def wilson_interval(successes: int, n: int, level: float = CI_LEVEL) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (no continuity correction); ``(nan, nan)`` at n = 0."""
    if n <= 0:
        return float("nan"), float("nan")
    ci = stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def _phi(c: PairedCounts) -> float:
    """Newcombe's (1998, method 10) correlation estimate between the two marginal proportions.

    The phi coefficient of the table, with its numerator ``both*neither - only_a*only_b`` shrunk towards 0
    by n/2 when positive (set to 0 when between 0 and n/2), and 0 when any margin is empty.
    """
    margins = ((c.both + c.only_a) * (c.only_b + c.neither) * (c.both + c.only_b) * (c.only_a + c.neither))
    if margins == 0:
        return 0.0
    num = c.both * c.neither - c.only_a * c.only_b
    if num > c.n / 2:
        num -= c.n / 2
    elif num >= 0:
        num = 0.0
    return num / math.sqrt(margins)


def newcombe_paired_interval(counts: PairedCounts, level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Difference ``p_a - p_b`` of two paired proportions and its Newcombe (1998, method 10) interval.

    ``p_a = (both + only_a) / n`` and ``p_b = (both + only_b) / n``; returns ``(difference, low, high)``
    as fractions (multiply by 100 for points), ``nan`` for an empty table.
    """
    n = counts.n
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    ka, kb = counts.both + counts.only_a, counts.both + counts.only_b
    pa, pb = ka / n, kb / n
    la, ua = wilson_interval(ka, n, level)
    lb, ub = wilson_interval(kb, n, level)
    phi = _phi(counts)
    d = pa - pb
    lower = d - math.sqrt(max((pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2, 0.0))
    upper = d + math.sqrt(max((ua - pa) ** 2 - 2 * phi * (ua - pa) * (pb - lb) + (pb - lb) ** 2, 0.0))
    return d, max(lower, -1.0), min(upper, 1.0)


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Exact (conditional) McNemar p-value: two-sided binomial test of ``only_a`` of the discordant pairs
    against 1/2. 1.0 when there are no discordant pairs."""
    m = int(only_a) + int(only_b)
    if m == 0:
        return 1.0
    return float(stats.binomtest(int(only_a), m, 0.5, alternative="two-sided").pvalue)


# --------------------------------------------------------------------------------------- continuous


def bca_mean_interval(values: Sequence[float], seed: int = 0, level: float = CI_LEVEL,
                      resamples: int = BCA_RESAMPLES) -> tuple[float, float, float]:
    """Mean of ``values`` and its BCa bootstrap interval (``scipy.stats.bootstrap``, fixed ``seed``).

    The interval is ``(nan, nan)`` where the bootstrap is undefined: fewer than 2 values, or all values
    equal (every resample has the same mean, and the BCa acceleration is 0/0).
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    mean = float(x.mean())
    if x.size < 2 or np.all(x == x[0]):
        return mean, float("nan"), float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns (and returns nan) on degenerate resamples
        res = stats.bootstrap((x,), np.mean, n_resamples=resamples, confidence_level=level, method="BCa",
                              vectorized=True, batch=BCA_BATCH, rng=np.random.default_rng(seed))
    return mean, float(res.confidence_interval.low), float(res.confidence_interval.high)


# ------------------------------------------------------------------------------------- sample sizes


def _z(level: float = CI_LEVEL, power: float = POWER) -> float:
    return float(stats.norm.ppf(1 - (1 - level) / 2) + stats.norm.ppf(power))


def n_to_detect(effect: float, baseline_rate: float, level: float = CI_LEVEL, power: float = POWER) -> int:
    """Samples per arm for a two-sided level-``level`` test to detect a drop of ``effect`` (a fraction)
    from ``baseline_rate`` with probability ``power`` (normal approximation, pairing ignored: conservative).

    A drop larger than the baseline rate is impossible, so the effect is taken in whichever direction
    stays inside [0, 1]. Never fewer than :func:`min_exact_pairs`: near 0 or 1 the normal approximation
    asks for a handful of samples that no exact test could decide on.
    """
    effect = abs(float(effect))
    if effect == 0 or math.isnan(effect) or math.isnan(baseline_rate):
        return 0
    p1 = min(max(float(baseline_rate), 0.0), 1.0)
    p2 = p1 - effect if p1 - effect >= 0 else p1 + effect
    if not 0.0 <= p2 <= 1.0:
        return 0
    var = p1 * (1 - p1) + p2 * (1 - p2)
    return max(min_exact_pairs(level), math.ceil(_z(level, power) ** 2 * var / effect**2))


def min_exact_pairs(level: float = CI_LEVEL) -> int:
    """The fewest pairs on which the exact McNemar test can reject at all: all of them discordant in one
    direction gives p = 2 / 2**m, so m = 6 at the 5% level (5 pairs give at best p = 0.0625)."""
    m = 1
    while 2 * 0.5**m >= 1 - level:
        m += 1
    return m


def min_detectable_effect(n: int, baseline_rate: float, level: float = CI_LEVEL, power: float = POWER) -> float:
    """The smallest drop from ``baseline_rate`` (a fraction) that ``n`` samples per arm detect with
    probability ``power`` at level ``level`` — the inverse of :func:`n_to_detect`."""
    if n <= 0 or math.isnan(baseline_rate):
        return float("nan")
    p1 = min(max(float(baseline_rate), 0.0), 1.0)
    z = _z(level, power)

    def gap(effect: float) -> float:
        p2 = p1 - effect if p1 - effect >= 0 else p1 + effect
        return effect - z * math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / n)

    top = max(p1, 1 - p1)  # the largest drop that stays inside [0, 1]
    if gap(top) < 0:
        return float("nan")  # not even the largest possible change is detectable
    return float(optimize.brentq(gap, 1e-12, top, xtol=1e-10))
