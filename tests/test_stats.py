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


# ----------------------------------------------------------------------------- spec v1.2: clusters


def _docs(sizes: list[int]) -> list[str]:
    return [f"d{g}" for g, m in enumerate(sizes) for _ in range(m)]


def test_cluster_bootstrap_widens_when_all_failures_sit_in_one_document():
    # 40 paired questions from 8 documents of 5; the strategy loses 5 of them. Spread one per document,
    # the documents look alike; all in one document, a resample holds that document 0, 1, 2... times and
    # the loss swings with it.
    docs = _docs([5] * 8)
    spread = np.zeros(40)
    spread[[0, 5, 10, 15, 20]] = -1
    one_doc = np.zeros(40)
    one_doc[:5] = -1
    w_spread = np.diff(stats.ClusterBootstrap(spread, tuple(docs)).interval())[0]
    w_one = np.diff(stats.ClusterBootstrap(one_doc, tuple(docs)).interval())[0]
    w_iid = np.diff(stats.ClusterBootstrap(one_doc, tuple(range(40))).interval())[0]  # every question alone
    assert w_one > 1.5 * w_iid and w_one > 1.5 * w_spread
    # the same through the design effect: Rao-Scott's effective n shrinks, Newcombe's interval widens
    d_one, d_spread = stats.design_effect(one_doc, docs), stats.design_effect(spread, docs)
    assert d_one.source == d_spread.source == stats.DEFF_DIFFERENCES
    assert d_one.value > 4 and d_spread.value == 1.0  # clustered vs (below 1, floored) not clustered
    counts = stats.paired_counts(one_doc + 1, np.ones(40))  # strategy scores vs baseline all correct
    clustered = stats.PairedBinary(counts, d_one).interval()
    flat = stats.PairedBinary(counts, stats.DesignEffect(1.0, stats.DEFF_DIFFERENCES)).interval()
    assert clustered[0] < flat[0] - 0.1


def test_cr_design_effect_matches_hand_computation():
    # 2 clusters of 2: x = [1, 1, 0, 0], mean 0.5, residuals ±0.5, cluster sums ±1.
    # CR1: 2/1 * (1 + 1) / 4**2 = 0.25; iid: (4 * 0.25) / (4 * 3) = 1/12; ratio 3 (the G/(G-1) factor puts it
    # above the ICC = 1 value of 2 at two clusters).
    assert stats.cr_design_effect([1, 1, 0, 0], ["a", "a", "b", "b"]) == pytest.approx(3.0)
    assert math.isnan(stats.cr_design_effect([1, 1, 1, 1], ["a", "a", "b", "b"]))  # constant
    assert math.isnan(stats.cr_design_effect([1, 0], ["a", "a"]))  # one cluster
    assert stats.worst_case_design_effect(_docs([3, 1])) == pytest.approx((9 + 1) / 4)


def test_design_effect_rule_falls_back_in_order():
    docs = _docs([4, 4, 4])
    diffs = np.zeros(12)
    base = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], dtype=float)  # the baseline clusters perfectly
    d = stats.design_effect(diffs, docs, baseline=base)
    assert d.source == stats.DEFF_BASELINE and d.value > 3
    d = stats.design_effect(diffs, docs, baseline=np.ones(12))
    assert d.source == stats.DEFF_WORST and d.value == pytest.approx(4.0)  # equal sizes: m
    one = np.zeros(12)
    one[0] = -1  # a single discordant question says nothing about clustering
    assert stats.design_effect(one, docs).source == stats.DEFF_WORST


def test_zero_flips_never_give_a_zero_width_interval():
    # 100 questions in 25 documents of 4, never a disagreement, the baseline always right: every variance
    # is 0, the worst-case design effect is 4, and the interval is the exact zero-flip bound at n_eff = 25.
    docs = _docs([4] * 25)
    deff = stats.design_effect(np.zeros(100), docs, baseline=np.ones(100))
    test = stats.PairedBinary(stats.PairedCounts(100, 0, 0, 0), deff)
    lo, hi = test.interval()
    bound = 1 - 0.025 ** (1 / 25)
    assert deff.value == 4.0 and test.method.endswith("exact-zero")
    assert lo == pytest.approx(-bound) and hi == pytest.approx(bound) and bound > 0.13
    # and the bootstrap alone would have given zero width
    assert stats.ClusterBootstrap(np.zeros(100), tuple(docs)).degenerate


def test_one_sided_p_inverts_the_interval():
    test = stats.PairedBinary(stats.PairedCounts(40, 2, 6, 12), stats.DesignEffect(1.3, stats.DEFF_DIFFERENCES))
    lo, hi = test.interval()
    assert test.p_greater(lo) == pytest.approx(0.025, abs=1e-6)
    assert test.p_less(hi) == pytest.approx(0.025, abs=1e-6)
    assert test.p_greater(lo + 0.01) > 0.025 > test.p_greater(lo - 0.01)


def test_holm_against_a_hand_worked_example():
    # p = (0.01, 0.04, 0.03, 0.005), m = 4. Sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06,
    # 0.04*1 = 0.04 -> made monotone 0.06. Back in input order: 0.03, 0.06, 0.06, 0.02.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5]) == [0.5] and stats.holm([]) == []
    assert stats.holm([0.3, 0.4]) == pytest.approx([0.6, 0.6])
    try:
        from statsmodels.stats.multitest import multipletests
    except ImportError:
        return
    p = [0.001, 0.2, 0.012, 0.04, 0.03]
    assert stats.holm(p) == pytest.approx(list(multipletests(p, method="holm")[1]))


def test_connor_paired_sample_size_against_the_published_example():
    # Connor (1987), Biometrics 43:207-211, eq. 3 at p10 = 0.05, p01 = 0.45, two-sided 5%, 80% power: 23 pairs
    # (the worked example of the open-powersamplesize / HyLown "Compare Paired Proportions: McNemar" calculator,
    # which cites Connor 1987 p. 209: n = 22.01 -> 23).
    assert stats.paired_n(0.05, 0.45, margin=0.0, alpha=0.025, power=0.8) == 23
    assert stats.paired_n(0.45, 0.05) == 23  # the direction does not matter at margin 0
    # Non-inferiority at 1 point with int8's observed discordance (1 in 51, no net loss): ~1,534 pairs.
    assert stats.paired_n(1 / 102, 1 / 102, margin=0.01) == 1534
    assert math.isinf(stats.paired_n(0.01, 0.0, margin=0.01))  # the truth sits on the margin


def test_zero_flip_sample_size_and_the_issue_s_409():
    # Exact (Clopper-Pearson, one-sided 97.5%) zero-flip bound under 1 point: ln 0.025 / ln 0.99 = 367.04.
    assert stats.zero_count_bound(368) <= 0.01 < stats.zero_count_bound(367)
    # Newcombe's interval at zero flips and a perfect baseline: z^2 / (n + z^2) < 0.01 -> n > 99 z^2 = 380.3.
    assert stats.n_zero_flips(0.01, 1.0) == 381
    # The issue's "409 with zero flips" is Newcombe's interval at a baseline of ~97% accuracy (408-409).
    assert stats.n_zero_flips(0.01, 0.97) in (408, 409)
    # Never fewer than the exact bound allows, whatever the baseline (at 90% Newcombe alone needs 362).
    assert stats.n_zero_flips(0.01, 0.9) == 368


def test_questions_needed_uses_the_upper_bound_of_an_unseen_discordance_and_the_design_effect():
    n_seen = stats.questions_needed(0.0, 0.0, 400, 0.01, 1.0)
    psi = stats.zero_count_bound(400)
    assert n_seen == stats.paired_n(psi / 2, psi / 2, 0.01)
    assert stats.questions_needed(0.0, 0.0, 400, 0.01, 1.0, deff=2.0) == 2 * n_seen
    # a tiny observed discordance cannot go below the n at which zero flips decide
    assert stats.questions_needed(0.0005, 0.0005, 4000, 0.01, 1.0) == stats.n_zero_flips(0.01, 1.0)
    # a strategy clearly losing more than the margin is shown to fail quickly (no zero-flip floor there)
    assert stats.questions_needed(0.5, 0.0, 10, 0.01, 1.0) < 20
