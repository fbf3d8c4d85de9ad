"""Interval estimates, tests and sample sizes of measurement spec v1.2 (``docs/measurement-spec.md`` §2.1-2.4).

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

Spec v1.2 adds what a *decision* needs (the second half of this module):

* **clustering** — questions drawn from one document (or sharing one compressed context) are not
  independent. The cluster-robust (CR) variance of a mean paired difference (Liang & Zeger 1986; for evals,
  Miller 2024, *Adding Error Bars to Evals*, arXiv:2411.00640, §2-3) over the iid variance is the design
  effect; binary comparisons divide their counts by it (Rao & Scott 1992, *A simple method for the analysis
  of clustered binary data*, Biometrics 48:577-585) before Newcombe's interval; other endpoints get a
  paired cluster bootstrap (whole clusters resampled). At zero discordant pairs an exact Clopper-Pearson
  bound takes over, so no interval has zero width.
* **tests from intervals** — one-sided p-values by inverting those intervals, for Holm's step-down
  correction within a claim's family (Holm 1979, Scand J Statist 6:65-70).
* **paired sample sizes** — Connor's (1987, Biometrics 43:207-211) discordance-based formula for paired
  binary outcomes, shifted to a non-inferiority margin, floored by the n at which zero flips would decide,
  and inflated by the design effect.

The v1.1 unpaired two-proportion sample size (Fleiss, Levin & Paik 2003, ch. 4) is kept as
:func:`n_to_detect` for reference only; spec v1.2's claim check uses :func:`paired_n`.

Everything here is a pure, deterministic function of its arguments (bootstraps take a seed).

Why one module of this length: it is the whole statistics of the measurement spec, each method with its
reference; the clustered tests (:class:`PairedBinary`, :class:`ClusterBootstrap`) and the sample sizes build on
the binary and design-effect sections above them, so the sections are read in order, never apart.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
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


def _wilson(successes: float, n: float, level: float = CI_LEVEL) -> tuple[float, float]:
    """The Wilson score interval in closed form, for the fractional counts of an effective sample size
    (:func:`effective_counts`); equal to :func:`wilson_interval` for whole counts."""
    z = float(stats.norm.ppf(1 - (1 - level) / 2))
    p = successes / n
    centre = (successes + z * z / 2) / (n + z * z)
    half = z * math.sqrt(n) / (n + z * z) * math.sqrt(max(p * (1 - p), 0.0) + z * z / (4 * n))
    return max(centre - half, 0.0), min(centre + half, 1.0)


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
    la, ua = _wilson(ka, n, level)
    lb, ub = _wilson(kb, n, level)
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


# =================================================================================== spec v1.2: clusters

#: Resamples of the paired cluster bootstrap.
CLUSTER_RESAMPLES = 9999
#: Fewest discordant questions (non-zero paired differences) from which the design effect is estimated;
#: with one, every cluster but one has no variation to measure, and the estimate says nothing.
MIN_DISCORDANT = 2
DEFF_DIFFERENCES, DEFF_BASELINE, DEFF_WORST = "paired differences", "baseline scores", "worst case (ICC = 1)"


def _codes(clusters: Sequence) -> np.ndarray:
    """Cluster labels as 0..G-1 (in sorted label order, so results never depend on row order)."""
    return np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)[1].reshape(-1)


def n_clusters(clusters: Sequence) -> int:
    return int(_codes(clusters).max() + 1) if len(clusters) else 0


def worst_case_design_effect(clusters: Sequence) -> float:
    """Kish's design effect of a mean at an intra-cluster correlation of 1, ``sum(m_g**2) / n``: every
    question of a cluster counts once (equal sizes m: the design effect m, the effective n the number of
    clusters). No real correlation is larger, so it is the conservative rule where none can be estimated."""
    sizes = np.bincount(_codes(clusters)) if len(clusters) else np.zeros(0)
    return float((sizes.astype(float) ** 2).sum() / sizes.sum()) if sizes.size else float("nan")


def cr_design_effect(values: Sequence[float], clusters: Sequence) -> float:
    """Cluster-robust (CR1) variance of the mean of ``values`` over its iid variance (Miller 2024, eq. for
    the clustered standard error: ``G/(G-1) * sum_g (sum_{i in g} e_i)**2 / n**2`` against ``s**2 / n``).

    NaN where undefined: fewer than 2 clusters, or constant values (both variances 0).
    """
    x = np.asarray(values, dtype=float)
    codes = _codes(clusters)
    n, g = x.size, int(codes.max() + 1) if x.size else 0
    e = x - x.mean() if n else x
    if g < 2 or n < 2 or not np.any(e):
        return float("nan")
    v_cr = g / (g - 1) * float(np.sum(np.bincount(codes, weights=e) ** 2)) / n**2
    v_iid = float(np.sum(e**2)) / (n * (n - 1))
    return v_cr / v_iid


@dataclass(frozen=True)
class DesignEffect:
    """How much clustering inflates the variance of a mean: ``value`` >= 1, and where it came from."""

    value: float
    source: str  # DEFF_DIFFERENCES | DEFF_BASELINE | DEFF_WORST


def design_effect(diffs: Sequence[float], clusters: Sequence,
                  baseline: Sequence[float] | None = None) -> DesignEffect:
    """The design effect of a mean paired difference, by a fixed rule (spec v1.2 §2.2):

    1. from the paired differences themselves (:func:`cr_design_effect`) when at least
       :data:`MIN_DISCORDANT` of them are non-zero and there are 2 clusters or more;
    2. else from the baseline's own scores on the same questions (the only clustering the data show when
       the arms never disagree), when they vary across 2 clusters or more;
    3. else the worst case (:func:`worst_case_design_effect`).

    Never below 1: a negative intra-cluster correlation estimated from a handful of clusters is noise, and
    shrinking an interval on it would not be conservative.
    """
    d = np.asarray(diffs, dtype=float)
    if int(np.count_nonzero(d)) >= MIN_DISCORDANT:
        est = cr_design_effect(d, clusters)
        if not math.isnan(est):
            return DesignEffect(max(1.0, est), DEFF_DIFFERENCES)
    if baseline is not None:
        est = cr_design_effect(baseline, clusters)
        if not math.isnan(est):
            return DesignEffect(max(1.0, est), DEFF_BASELINE)
    return DesignEffect(max(1.0, worst_case_design_effect(clusters)), DEFF_WORST)


def effective_counts(counts: PairedCounts, deff: float) -> PairedCounts:
    """Rao & Scott (1992): every cell divided by the design effect, so binomial methods see the effective
    sample size ``n / deff`` (fractional counts; :func:`newcombe_paired_interval` accepts them)."""
    f = 1.0 / max(float(deff), 1.0)
    return PairedCounts(counts.both * f, counts.only_a * f, counts.only_b * f, counts.neither * f)  # type: ignore[arg-type]


def zero_count_bound(n: float, level: float = CI_LEVEL) -> float:
    """Exact one-sided upper bound of a rate never observed in ``n`` trials: the Clopper-Pearson limit at
    zero, ``1 - ((1 - level) / 2) ** (1 / n)`` (the one-sided level of a two-sided ``level`` interval)."""
    if n <= 0:
        return 1.0
    return 1.0 - ((1 - level) / 2) ** (1.0 / n)


def _invert(bound: Callable[[float], float], null: float, lower: bool) -> float:
    """One-sided p-value of an interval: the ``(1 - L) / 2`` at which the two-sided level-``L`` interval's
    ``lower`` (else upper) end meets ``null``. 1.0 when even the point estimate does not clear it."""
    sign = 1.0 if lower else -1.0

    def gap(level: float) -> float:
        return sign * (bound(level) - null)

    small, big = 1e-9, 1 - 1e-12
    if gap(small) <= 0:
        return 1.0
    if gap(big) > 0:
        return (1 - big) / 2
    return float((1 - optimize.brentq(gap, small, big, xtol=1e-12)) / 2)


@dataclass(frozen=True)
class PairedBinary:
    """Arm a − arm b on paired binary scores, clustered: Newcombe's interval on Rao-Scott effective counts.
    When the arms never disagree it is widened, where narrower, to the exact zero-flip interval at the
    effective n (each discordant rate at most its Clopper-Pearson bound at zero): never zero width, and
    never narrower than an exact method allows."""

    counts: PairedCounts
    deff: DesignEffect

    @property
    def estimate(self) -> float:
        n = self.counts.n
        return (self.counts.only_a - self.counts.only_b) / n if n else float("nan")

    def interval(self, level: float = CI_LEVEL) -> tuple[float, float]:
        eff = effective_counts(self.counts, self.deff.value)
        _, lo, hi = newcombe_paired_interval(eff, level)
        if self.zero_flips:  # -p_loss <= a − b <= p_gain, each rate at most the exact zero-count bound
            bound = zero_count_bound(eff.n, level)
            lo, hi = min(lo, -bound), max(hi, bound)
        return max(lo, -1.0), min(hi, 1.0)

    @property
    def zero_flips(self) -> bool:
        """No discordant pair: a clustered variance (or a bootstrap) would have zero width here."""
        return self.counts.only_a == 0 and self.counts.only_b == 0

    @property
    def method(self) -> str:
        return "newcombe-rao-scott" + ("+exact-zero" if self.zero_flips else "")

    def p_greater(self, null: float) -> float:
        """One-sided p of H0: a − b <= ``null`` (small: a − b is above ``null``)."""
        return _invert(lambda level: self.interval(level)[0], null, lower=True)

    def p_less(self, null: float) -> float:
        """One-sided p of H0: a − b >= ``null``."""
        return _invert(lambda level: self.interval(level)[1], null, lower=False)

    def p_two_sided(self) -> float:
        """Two-sided p of a − b = 0: twice the smaller one-sided p from the interval, and never below the
        exact McNemar p of the effective discordant counts (rounded), since the score interval and the exact
        test disagree at a handful of discordant pairs."""
        p_int = min(1.0, 2 * min(self.p_greater(0.0), self.p_less(0.0)))
        f = 1.0 / self.deff.value
        return max(p_int, mcnemar_exact_p(round(self.counts.only_a * f), round(self.counts.only_b * f)))


@dataclass(frozen=True)
class ClusterBootstrap:
    """Paired cluster bootstrap of a ratio of sums (a mean when ``den`` is 1 per question): whole clusters,
    with every question in them, are resampled with replacement (Field & Welsh 2007, *Bootstrapping
    clustered data*, JRSS-B 69:369-390; Miller 2024 §3), ``CLUSTER_RESAMPLES`` times with a fixed seed.

    Percentile interval, not BCa: BCa's acceleration is a jackknife over *clusters*, which at the handful of
    documents a run has (6-10 per task) is decided by one left-out document, and BCa end points are extreme
    percentiles that a few-cluster bootstrap distribution resolves poorly; the percentile interval is
    transformation-respecting and needs neither.
    """

    num: np.ndarray  # per-question numerators (paired differences)
    clusters: tuple
    den: np.ndarray | None = None  # per-question denominators; None: 1 each (a mean)
    seed: int = 0
    resamples: int = CLUSTER_RESAMPLES

    @property
    def _replicates(self) -> np.ndarray:
        cached = self.__dict__.get("_reps")
        if cached is not None:
            return cached
        codes = _codes(self.clusters)
        g = int(codes.max() + 1)
        num = np.bincount(codes, weights=np.asarray(self.num, dtype=float), minlength=g)
        den = np.bincount(codes, weights=(np.ones(len(codes)) if self.den is None
                                          else np.asarray(self.den, dtype=float)), minlength=g)
        idx = np.random.default_rng(self.seed).integers(0, g, size=(self.resamples, g))
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = num[idx].sum(axis=1) / den[idx].sum(axis=1)
        object.__setattr__(self, "_reps", reps[np.isfinite(reps)])
        return self.__dict__["_reps"]

    @property
    def estimate(self) -> float:
        den = np.ones(len(self.num)) if self.den is None else np.asarray(self.den, dtype=float)
        total = float(den.sum())
        return float(np.sum(self.num)) / total if total else float("nan")

    def interval(self, level: float = CI_LEVEL) -> tuple[float, float]:
        reps = self._replicates
        if reps.size == 0:
            return float("nan"), float("nan")
        a = (1 - level) / 2
        return float(np.quantile(reps, a)), float(np.quantile(reps, 1 - a))

    @property
    def degenerate(self) -> bool:
        """Zero width: every resample gives the same value (e.g. all differences 0)."""
        lo, hi = self.interval()
        return not (hi > lo)

    def p_greater(self, null: float) -> float:
        """Bootstrap one-sided p of H0: value <= ``null`` ((count + 1) / (R + 1), Davison & Hinkley 1997 §4.4)."""
        reps = self._replicates
        return float((np.sum(reps <= null) + 1) / (reps.size + 1))

    def p_less(self, null: float) -> float:
        reps = self._replicates
        return float((np.sum(reps >= null) + 1) / (reps.size + 1))

    def p_two_sided(self) -> float:
        return min(1.0, 2 * min(self.p_greater(0.0), self.p_less(0.0)))


# ====================================================================================== multiplicity


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the input order: the i-th smallest p times (m - i + 1),
    made monotone, capped at 1. A family member is rejected at level a when its adjusted p is below a;
    this controls the family-wise error rate without any assumption on the dependence of the tests."""
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    if m == 0:
        return []
    order = np.argsort(p, kind="mergesort")
    adj = np.maximum.accumulate((m - np.arange(m)) * p[order])
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return [float(v) for v in out]


# ================================================================================ paired sample sizes


def paired_n(p_loss: float, p_gain: float, margin: float = 0.0, alpha: float = (1 - CI_LEVEL) / 2,
             power: float = POWER) -> float:
    """Pairs for a one-sided level-``alpha`` test of the paired difference ``d = p_gain − p_loss`` against
    ``−margin`` to succeed with probability ``power`` (Connor 1987, Biometrics 43:207-211, eq. 3):

        n = [z_(1−alpha) sqrt(psi − d0²) + z_power sqrt(psi − d²)]² / (d − d0)²

    with ``psi = p_loss + p_gain`` the discordance rate, ``d0 = −margin`` the null. Connor's null keeps the
    discordance and moves pairs between the two discordant cells; ``margin = 0`` is his McNemar formula (his
    two-sided 5% level is ``alpha = 0.025`` here), a positive margin the non-inferiority test of spec v1.2.
    The direction follows the truth: ``d > d0`` plans to show d above the null, ``d < d0`` below it.
    ``inf`` when ``d == d0`` (no n separates them).
    """
    psi, d, d0 = float(p_loss) + float(p_gain), float(p_gain) - float(p_loss), -float(margin)
    if d == d0:
        return math.inf
    z_a, z_b = float(stats.norm.ppf(1 - alpha)), float(stats.norm.ppf(power))
    s0, s1 = math.sqrt(max(psi - d0**2, 0.0)), math.sqrt(max(psi - d**2, 0.0))
    return float(math.ceil(((z_a * s0 + z_b * s1) / (d - d0)) ** 2))


@functools.lru_cache(maxsize=1024)
def n_zero_flips(margin: float, baseline_rate: float = 1.0, level: float = CI_LEVEL, cap: int = 100_000) -> int:
    """The fewest questions at which a strategy that *never* disagrees with the baseline is decided
    non-inferior at ``margin`` by :class:`PairedBinary` (design effect 1): below it, no result at all could
    establish the bound. At a perfect baseline this is Newcombe's ``n > z² (1 − m) / m`` (381 for 1 point);
    the exact Clopper-Pearson bound alone would need 368 (``ln 0.025 / ln 0.99``); across baseline accuracies
    Newcombe's interval needs 300-425."""
    def decided(n: int) -> bool:
        k = round(min(max(baseline_rate, 0.0), 1.0) * n)
        return PairedBinary(PairedCounts(k, 0, 0, n - k), DesignEffect(1.0, DEFF_DIFFERENCES)).interval(level)[0] \
            > -margin

    n = max(1, int(math.log((1 - level) / 2) / math.log(1 - margin)) // 2) if 0 < margin < 1 else 1
    while not decided(n):
        n += 1
        if n > cap:
            return cap
    return n


def questions_needed(p_loss: float, p_gain: float, n_observed: int, margin: float, baseline_rate: float,
                     deff: float = 1.0, level: float = CI_LEVEL, power: float = POWER) -> int:
    """Questions a paired binary claim needs, by spec v1.2 §2.4: Connor's pairs (:func:`paired_n`) at the
    observed discordant rates — at the exact upper bound of the discordance rate, split evenly, when none
    was observed in ``n_observed`` — never fewer than the n at which zero flips would decide
    (:func:`n_zero_flips`, for a margin) or the exact McNemar minimum (:func:`min_exact_pairs`, without one),
    times the design effect. 0 when the observed difference equals the null (no n decides it)."""
    alpha = (1 - level) / 2
    if p_loss + p_gain == 0:
        psi = zero_count_bound(max(n_observed, 1), level)
        p_loss = p_gain = psi / 2
    n = paired_n(p_loss, p_gain, margin, alpha, power)
    if math.isinf(n):
        return 0
    # Zero flips can only ever show the bound holding: the floor applies when planning to show that.
    shows_bound = p_gain - p_loss > -margin
    floor = n_zero_flips(margin, round(baseline_rate, 3), level) if margin > 0 and shows_bound \
        else min_exact_pairs(level)
    return int(math.ceil(max(n, floor) * max(deff, 1.0)))
