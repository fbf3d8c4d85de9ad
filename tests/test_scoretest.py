"""The confirmatory design's statistic and futility boundaries (kvbench.scoretest, kvbench.sequential), against
independent computations: the restricted MLE by direct numerical maximisation, the boundaries' crossing
probabilities by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize
from scipy import stats as sps

from kvbench import scoretest, sequential


def _numeric_q(b: int, c: int, n: int, d0: float) -> float:
    """argmax of the multinomial likelihood on the boundary p10 - p01 = d0, by bounded search."""
    def nll(q: float) -> float:
        p10, p01 = q + d0, q
        rest = 1 - p10 - p01
        if min(p10, p01, rest) < 0:
            return math.inf
        return -sum(k * math.log(max(p, 1e-300)) for k, p in ((b, p10), (c, p01), (n - b - c, rest)) if k)
    lo, hi = max(0.0, -d0), (1 - d0) / 2
    return float(optimize.minimize_scalar(nll, bounds=(lo, hi), method="bounded",
                                          options={"xatol": 1e-12}).x)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), b=st.integers(0, 400), c=st.integers(0, 400),
       d0=st.sampled_from([-0.01, -0.05, -0.1, 0.0, 0.02]))
def test_restricted_mle_matches_numeric(n: int, b: int, c: int, d0: float) -> None:
    if b + c > n:
        b, c = b * n // (b + c), c * n // (b + c)
    q = scoretest.restricted_q(b, c, n, d0)
    assert q == pytest.approx(_numeric_q(b, c, n, d0), abs=1e-6)


def test_score_statistic_by_hand() -> None:
    # 100 pairs: 3 only the strategy right, 5 only full right; independent clusters (deff 1 floors it).
    x = [1] * 3 + [0] * 5 + [1] * 80 + [0] * 12
    y = [0] * 3 + [1] * 5 + [1] * 80 + [0] * 12
    t = scoretest.score_test(x, y, list(range(100)), 0.01)
    q = _numeric_q(3, 5, 100, -0.01)
    z = (3 - 5 + 100 * 0.01) / math.sqrt(100 * (2 * q - 0.01 - 0.0001))
    assert (t.b, t.c, t.clusters, t.df) == (3, 5, 100, 99)
    assert t.z == pytest.approx(z, rel=1e-6)
    assert t.p_holds == pytest.approx(sps.t.sf(z / math.sqrt(t.deff), 99))
    assert t.p_holds + t.p_fails == pytest.approx(1.0)


def test_no_discordance_is_finite_and_grows_with_n() -> None:
    small = scoretest.score_test([1, 0] * 50, [1, 0] * 50, list(range(100)), 0.01)
    large = scoretest.score_test([1, 0] * 500, [1, 0] * 500, list(range(1000)), 0.01)
    assert math.isfinite(small.z) and small.z == pytest.approx(math.sqrt(100 * 0.01 / 0.99))
    assert large.p_holds < small.p_holds


def test_clustered_discordance_inflates_variance() -> None:
    # Discordant pairs concentrated in two clusters of ten: the design effect exceeds 1 and weakens the test.
    x = [0] * 10 + [1] * 10 + [1] * 180
    y = [1] * 10 + [0] * 10 + [1] * 180
    clustered = scoretest.score_test(x, y, [i // 10 for i in range(200)], 0.01)
    spread = scoretest.score_test(x, y, list(range(200)), 0.01)
    assert clustered.deff > 1 and spread.deff == 1.0
    assert clustered.p_holds > spread.p_holds


def test_refuses_non_binary() -> None:
    with pytest.raises(ValueError):
        scoretest.score_test([0.5], [1.0], [0], 0.01)


FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def _simulate(drift: float, upper, lower, n: int = 200_000, seed: int = 1):
    t = np.asarray(FRACTIONS)
    rng = np.random.default_rng(seed)
    z = (np.cumsum(rng.standard_normal((n, t.size)) * np.sqrt(np.diff(np.concatenate([[0.0], t]))), axis=1)
         + drift * t) / np.sqrt(t)
    return z


def test_futility_spends_beta_under_the_alternative() -> None:
    share, beta, drift = 0.0125, 0.1, 3.2
    upper = sequential.boundaries(share, FRACTIONS, "obrien-fleming")
    lower = sequential.futility_boundaries(share, FRACTIONS, "obrien-fleming", beta, drift)
    assert lower[-1] == upper[-1] and all(a <= b for a, b in zip(lower, upper, strict=True))
    z = _simulate(drift, upper, lower)
    alive = np.ones(len(z), dtype=bool)
    spent = []
    for k in range(len(FRACTIONS) - 1):  # the last look's boundary is forced to meet the efficacy one
        stop_low = alive & (z[:, k] < lower[k])
        spent.append(stop_low.mean())
        alive &= ~stop_low & (z[:, k] < upper[k])
    want = np.diff(np.concatenate([[0.0], [sequential.SPENDING["obrien-fleming"](beta, t) for t in FRACTIONS]]))
    assert np.allclose(spent, want[:-1], atol=3e-3)


def test_futility_is_non_binding_and_design_ends_decided() -> None:
    share, beta, drift = 0.0125, 0.1, 3.2
    upper = sequential.boundaries(share, FRACTIONS, "obrien-fleming")
    # Under the null, ignoring futility, the efficacy boundaries spend exactly the share (non-binding).
    z0 = _simulate(0.0, upper, None)
    assert np.mean((z0 >= np.asarray(upper)).any(axis=1)) == pytest.approx(share, abs=1.5e-3)
    # Power with futility obeyed is what sequential.power reports, and at the last look nothing is left open.
    p = sequential.power(share, FRACTIONS, "obrien-fleming", beta, drift, resamples=200_000)
    assert 0.5 < p < 0.99


def test_drift_for_power_inverts_power() -> None:
    d = sequential.drift_for_power(0.8, 0.0125, FRACTIONS, "obrien-fleming", 0.2)
    assert sequential.power(0.0125, FRACTIONS, "obrien-fleming", 0.2, d, resamples=200_000) == \
        pytest.approx(0.8, abs=0.01)


@given(n=st.integers(20, 2000), b=st.integers(0, 60), c=st.integers(0, 60), deff=st.floats(1.0, 2.0),
       margin=st.sampled_from([0.01, 0.05]), level=st.floats(1e-8, 0.2))
@settings(max_examples=200, deadline=None)
def test_the_inverted_interval_decides_exactly_what_the_tests_decide(n: int, b: int, c: int, deff: float,
                                                                     margin: float, level: float) -> None:
    # The repeated interval a look prints is the registered test inverted: it lies above -margin exactly when the
    # holds test at -margin rejects at that level, and below it exactly when the fails test does.
    if b + c > n:
        return
    z = scoretest.ScoreTest(n, b, c, 40, 0.0, deff, 0.0, 39)
    t = scoretest.ScoreTest(n, b, c, 40, z.t_at(-margin) * math.sqrt(deff), deff, z.t_at(-margin), 39)
    low, high = t.interval(level)
    assert low <= high
    if abs(t.p_holds - level) > 1e-9 * level:
        assert (low > -margin) == (t.p_holds < level)
    if abs(t.p_fails - level) > 1e-9 * level:
        assert (high < -margin) == (t.p_fails < level)
    assert low <= (b - c) / n <= high  # the observed difference: the statistic is 0 there
