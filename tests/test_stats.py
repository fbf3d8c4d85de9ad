"""kvbench.stats against published worked examples, plus properties every interval must have."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench import stats
from kvbench.stats import PairedCounts


@pytest.mark.parametrize("k, n, low, high", [
    # Newcombe (1998), Stat Med 17:857-872, Table I, method 3 (Wilson score without continuity correction)
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0000, 0.1611),
    (1, 29, 0.0061, 0.1718),
])
def test_wilson_matches_newcombe_1998_table_1(k, n, low, high):
    lo, hi = stats.wilson_interval(k, n)
    assert (round(lo, 4), round(hi, 4)) == (low, high)


def test_newcombe_paired_matches_the_published_example():
    # Cavo et al. (2012) complete response before/after consolidation, 59/6/16/80: Fagerland, Lydersen &
    # Laake, Statistical Analysis of Contingency Tables (2017), ch. 8, Newcombe square-and-add interval
    # -0.0621 (95% CI -0.1186 to -0.0046) — the value their `contingencytables` package is tested against.
    d, lo, hi = stats.newcombe_paired_interval(PairedCounts(both=59, only_a=6, only_b=16, neither=80))
    assert (round(d, 4), round(lo, 4), round(hi, 4)) == (-0.0621, -0.1186, -0.0046)


def test_all_agree_interval_has_width_and_is_the_wilson_distance():
    # 5 pairs, all correct in both arms: phi = 0 (empty margin), so each side is p - wilson_low(5/5)
    d, lo, hi = stats.newcombe_paired_interval(PairedCounts(5, 0, 0, 0))
    w_lo, _ = stats.wilson_interval(5, 5)
    assert d == 0 and lo == pytest.approx(-(1 - w_lo)) and hi == pytest.approx(1 - w_lo)
    assert hi - lo > 0.8  # five agreeing samples are consistent with a loss of tens of points
    d, lo, hi = stats.newcombe_paired_interval(PairedCounts(0, 0, 0, 5))
    assert d == 0 and lo < -0.4 and hi > 0.4


def test_exact_mcnemar():
    # Bentur et al. (2009) airway data (1, 1, 7, 12): exact conditional McNemar p = 0.070 (Fagerland,
    # Lydersen & Laake 2013, BMC Med Res Methodol 13:91)
    assert round(stats.mcnemar_exact_p(1, 7), 3) == 0.070
    assert stats.mcnemar_exact_p(1, 7) == stats.mcnemar_exact_p(7, 1) == pytest.approx(18 / 256)
    assert stats.mcnemar_exact_p(0, 0) == 1.0
    assert stats.mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)


def test_paired_counts_and_input_checks():
    c = stats.paired_counts([1, 1, 0, 0, 1], [1, 0, 1, 0, 1])
    assert (c.both, c.only_a, c.only_b, c.neither, c.n) == (2, 1, 1, 1, 5)
    with pytest.raises(ValueError):
        stats.paired_counts([1, 0], [1])
    with pytest.raises(ValueError):
        stats.paired_counts([0.5, 1], [1, 1])
    assert all(math.isnan(v) for v in stats.newcombe_paired_interval(PairedCounts(0, 0, 0, 0)))


def test_bca_is_deterministic_and_undefined_on_constant_data():
    x = [0.1, 0.4, 0.35, 0.8, 0.9, 0.05, 0.6]
    mean, lo, hi = stats.bca_mean_interval(x, seed=3)
    assert mean == pytest.approx(np.mean(x)) and lo < mean < hi
    assert stats.bca_mean_interval(x, seed=3) == (mean, lo, hi)
    _, lo2, hi2 = stats.bca_mean_interval([0.2] * 6)
    assert math.isnan(lo2) and math.isnan(hi2)
    assert math.isnan(stats.bca_mean_interval([0.3])[1])


def test_bca_corrects_for_skew():
    # a right-skewed sample: the BCa interval sits further right of the mean than the percentile one's left
    x = np.r_[np.zeros(15), [0.1, 0.2, 1.0, 1.0]]
    mean, lo, hi = stats.bca_mean_interval(x, seed=0)
    assert hi - mean > mean - lo


def test_sample_size_and_minimum_detectable_effect_are_inverse():
    # Fleiss (no continuity correction): 1-point loss from a perfect baseline, alpha 0.05, power 0.8
    z2 = (1.959964 + 0.841621) ** 2
    assert stats.n_to_detect(0.01, 1.0) == math.ceil(z2 * 0.01 * 0.99 / 0.01**2)
    assert stats.n_to_detect(0.10, 0.5) > stats.n_to_detect(0.10, 0.95)  # variance peaks at 0.5
    for n, p in ((5, 1.0), (50, 0.8), (400, 0.6)):
        mde = stats.min_detectable_effect(n, p)
        assert stats.n_to_detect(mde, p) in (n, n + 1)
    assert stats.min_detectable_effect(5, 1.0) > 0.5
    assert stats.n_to_detect(0.0, 1.0) == 0
    assert stats.min_exact_pairs() == 6 and stats.n_to_detect(1.0, 1.0) == 6  # no exact test decides on 5


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))
def test_paired_interval_properties(both, only_a, only_b, neither):
    c = PairedCounts(both, only_a, only_b, neither)
    if c.n == 0:
        return
    d, lo, hi = stats.newcombe_paired_interval(c)
    assert -1 <= lo <= d <= hi <= 1
    assert hi - lo > 0  # never zero width, whatever the table
    # swapping the arms mirrors the interval
    d2, lo2, hi2 = stats.newcombe_paired_interval(PairedCounts(both, only_b, only_a, neither))
    assert (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))
    p = stats.mcnemar_exact_p(only_a, only_b)
    assert 0 < p <= 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 200), st.data())
def test_wilson_properties(n, data):
    k = data.draw(st.integers(0, n))
    lo, hi = stats.wilson_interval(k, n)
    assert 0 <= lo <= k / n <= hi <= 1 and hi > lo
