"""The confirmatory study's test statistic: a paired score test for a difference of proportions at a
non-inferiority margin, inflated by the cluster-robust design effect and referred to a t distribution.

For paired binary scores (strategy ``x``, baseline ``y`` on the same question), ``b`` questions only the strategy
gets right, ``c`` only the baseline, ``n`` pairs. The hypothesis boundary is ``Δ = p_x − p_y = Δ0`` with
``Δ0 = −margin``. Tango's score test (Tango 1998, *Equivalence test and confidence interval for the difference
in proportions for the paired-sample design*, Stat Med 17:891-908) evaluates the variance of ``D = x − y`` at the
maximum-likelihood cell probabilities *restricted to the boundary*:

    Z = (b − c − n Δ0) / sqrt(n (2 q + Δ0 − Δ0²)),    q = the restricted MLE of P(x = 0, y = 1),

so it stays finite and well calibrated where a Wald test breaks down (few or no discordant pairs). Questions are
not independent: eight share a context, and contexts share source works. The design effect
``deff = V_cluster / V_iid`` of the mean difference (the cluster-robust sandwich over the clusters, with the
K/(K−1) small-sample factor, over the i.i.d. variance) multiplies the score variance, floored at 1 (a negative
estimated intra-cluster correlation is never used to narrow the test), and ``T = Z / sqrt(deff)`` is referred
to Student's t with ``K − 1`` degrees of freedom (K clusters), as for a cluster-level analysis.

``p_holds`` is the one-sided p of H0: Δ <= Δ0 (non-inferiority shown when small); ``p_fails`` of H0: Δ >= Δ0.
Registered by ``conf/design/confirm.yaml`` (``statistic: score-cluster-t``) before the study's first record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize
from scipy import stats as sps

NAME = "score-cluster-t"


def restricted_q(b: int, c: int, n: int, delta0: float) -> float:
    """The MLE of P(x = 0, y = 1) under P(x=1, y=0) − P(x=0, y=1) = ``delta0`` (Tango 1998, eq. 4): the root of
    2n q² − B q − c Δ0 (1 − Δ0) = 0, B = b(1 − Δ0) + c(1 − 3 Δ0) − 2 (n − b − c) Δ0, in the feasible range."""
    big_b = b * (1 - delta0) + c * (1 - 3 * delta0) - 2 * (n - b - c) * delta0
    q = (big_b + math.sqrt(max(big_b * big_b + 8 * n * c * delta0 * (1 - delta0), 0.0))) / (4 * n)
    low, high = max(0.0, -delta0), (1 - delta0) / 2  # both cells of the discordant pair are probabilities
    return min(max(q, low), high)


@dataclass(frozen=True)
class ScoreTest:
    """One paired comparison's score statistic at the margin (see the module docstring)."""

    n: int
    b: int
    c: int
    clusters: int
    z: float  # Tango's score statistic, independent pairs
    deff: float  # the design effect applied (>= 1)
    t: float  # z / sqrt(deff)
    df: int

    @property
    def p_holds(self) -> float:
        return float(sps.t.sf(self.t, self.df)) if self.df > 0 else float("nan")

    @property
    def p_fails(self) -> float:
        return float(sps.t.cdf(self.t, self.df)) if self.df > 0 else float("nan")

    def t_at(self, delta0: float) -> float:
        """The statistic with the boundary at ``delta0`` instead of the margin (same pairs, same design effect)."""
        var0 = 2 * restricted_q(self.b, self.c, self.n, delta0) + delta0 - delta0 * delta0
        if var0 <= 0:  # the boundary at a degenerate cell (delta0 = -1 or 1): beyond every observable difference
            return math.copysign(math.inf, self.b - self.c - self.n * delta0)
        return (self.b - self.c - self.n * delta0) / math.sqrt(self.n * var0) / math.sqrt(self.deff)

    def interval(self, level: float) -> tuple[float, float]:
        """The differences (proportions) no one-sided test at ``level`` rejects: ``(low, high)`` with p_holds at
        ``low`` and p_fails at ``high`` equal to ``level`` — the test inverted (Tango 1998, section 3), so the
        interval lies above a boundary exactly when the holds test at that boundary rejects at ``level`` and
        below it exactly when the fails test does. A repeated confidence interval at a look's nominal level."""
        if self.df <= 0 or not 0 < level < 0.5:
            return float("nan"), float("nan")
        crit = float(sps.t.isf(level, self.df))
        eps = 1e-12

        def root(target: float) -> float:  # t_at is decreasing in delta0 from +inf (near -1) to -inf (near 1)
            f = lambda d: self.t_at(d) - target  # noqa: E731
            lo, hi = -1 + eps, 1 - eps
            if f(lo) <= 0:
                return -1.0
            if f(hi) >= 0:
                return 1.0
            return float(optimize.brentq(f, lo, hi, xtol=1e-12))

        return root(crit), root(-crit)


def design_effect(d: np.ndarray, clusters: Sequence[object]) -> float:
    """Cluster-robust over i.i.d. variance of the mean of ``d``, floored at 1 (1 when ``d`` never varies)."""
    n = len(d)
    var_iid = float(np.var(d, ddof=1)) / n if n > 1 else 0.0
    if var_iid <= 0:
        return 1.0
    keys, inverse = np.unique(np.asarray([str(k) for k in clusters]), return_inverse=True)
    k = len(keys)
    if k < 2:
        return 1.0
    sums = np.bincount(inverse, weights=d - d.mean(), minlength=k)
    var_cluster = k / (k - 1) * float(np.sum(sums ** 2)) / n ** 2
    return max(1.0, var_cluster / var_iid)


def score_test(x: Sequence[float], y: Sequence[float], clusters: Sequence[object], margin: float) -> ScoreTest:
    """The statistic for strategy scores ``x`` against baseline scores ``y`` (0/1, paired by position), clustered
    by ``clusters``, at a non-inferiority margin of ``margin`` (a proportion, 0.01 for 1 point)."""
    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if xa.shape != ya.shape or len(xa) != len(clusters) or not len(xa):
        raise ValueError("score_test needs equally long, non-empty x, y and clusters")
    if not (np.isin(xa, (0.0, 1.0)).all() and np.isin(ya, (0.0, 1.0)).all()):
        raise ValueError("score_test needs binary scores")
    n = len(xa)
    b = int(np.sum((xa == 1) & (ya == 0)))
    c = int(np.sum((xa == 0) & (ya == 1)))
    delta0 = -float(margin)
    q = restricted_q(b, c, n, delta0)
    var0 = 2 * q + delta0 - delta0 * delta0
    z = (b - c - n * delta0) / math.sqrt(n * var0)
    deff = design_effect(xa - ya, clusters)
    k = len({str(v) for v in clusters})
    return ScoreTest(n, b, c, k, z, deff, z / math.sqrt(deff), k - 1)
