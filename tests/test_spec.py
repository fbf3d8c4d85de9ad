"""Measurement spec v1.1 arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from kvbench.strategies.base import held_bytes

from kvbench.spec import PeakMemory, accuracy_delta, bootstrap_mean_ci, fidelity, memory_reduction


def test_memory_reduction_arithmetic():
    assert memory_reduction(50, 100) == pytest.approx(0.5)
    assert memory_reduction(100, 100) == 0.0
    assert memory_reduction(200, 100) == pytest.approx(-1.0)
    assert math.isnan(memory_reduction(1, 0))


def test_accuracy_delta_is_paired_and_in_points():
    base = [1, 1, 1, 0, 1, 1, 0, 1]
    strat = [1, 0, 1, 0, 1, 1, 0, 1]
    d = accuracy_delta(base, strat)
    assert d.delta_pp == pytest.approx(-12.5)
    assert d.baseline == pytest.approx(0.75) and d.strategy == pytest.approx(0.625)
    assert d.relative_loss == pytest.approx(0.125 / 0.75)
    assert d.ci_low <= d.delta_pp <= d.ci_high
    assert d.n == 8


def test_identical_scores_never_give_a_zero_width_interval():
    # spec v1.0's bootstrap gave [0, 0] here; five agreeing pairs cannot rule out a loss of tens of points
    d = accuracy_delta([1] * 5, [1] * 5)
    assert d.delta_pp == 0.0 and d.method == "newcombe-paired"
    assert d.ci_low == pytest.approx(-43.45, abs=0.01) and d.ci_high == pytest.approx(43.45, abs=0.01)
    assert (d.n_only_strategy, d.n_only_baseline, d.mcnemar_p) == (0, 0, 1.0)


def test_binary_delta_reports_discordant_pairs_and_exact_mcnemar():
    base = [1] * 7 + [0] * 13 + [1]  # Bentur et al. layout: 1 both, 7 only-baseline, 1 only-strategy
    strat = [0] * 7 + [0] * 12 + [1] + [1]
    d = accuracy_delta(base, strat)
    assert (d.n_only_strategy, d.n_only_baseline) == (1, 7)
    assert d.mcnemar_p == pytest.approx(18 / 256)  # 2 * P(X <= 1), X ~ Bin(8, 1/2)
    assert d.ci_low < d.delta_pp < d.ci_high


def test_continuous_delta_uses_a_deterministic_bca_bootstrap():
    base, strat = [0.2, 0.5, 0.9, 0.4, 0.7, 0.3], [0.1, 0.5, 0.7, 0.4, 0.6, 0.35]
    d = accuracy_delta(base, strat, seed=1)
    assert d.method == "bca-bootstrap" and math.isnan(d.mcnemar_p)
    assert d.delta_pp == pytest.approx(-100 * 0.35 / 6)
    assert d.ci_low < d.delta_pp < d.ci_high
    assert d == accuracy_delta(base, strat, seed=1)
    # all differences equal: the bootstrap is undefined, the rounded scores get the paired score interval
    flat = accuracy_delta([0.3, 0.8, 0.9], [0.3, 0.8, 0.9], binary=False)
    assert flat.method == "newcombe-paired" and flat.ci_low < 0 < flat.ci_high


def test_binary_metric_decides_the_method():
    assert accuracy_delta([1, 0, 1], [1, 1, 1], binary=False).method == "bca-bootstrap"
    assert accuracy_delta([1, 0, 1], [1, 1, 1]).method == "newcombe-paired"
    with pytest.raises(ValueError):
        accuracy_delta([0.5, 1], [1, 1], binary=True)


def test_bootstrap_is_deterministic():
    assert bootstrap_mean_ci([0.1, 0.5, 0.9], seed=3) == bootstrap_mean_ci([0.1, 0.5, 0.9], seed=3)


def test_accuracy_delta_rejects_unpaired():
    with pytest.raises(ValueError):
        accuracy_delta([1, 0], [1])


def test_fidelity_hand_values():
    p = torch.tensor([[0.6, 0.4], [0.9, 0.1]])
    q = torch.tensor([[0.25, 0.75], [0.9, 0.1]])
    gold = torch.tensor([1, 0])
    f = fidelity(p.log(), q.log(), gold)
    kl0 = 0.6 * math.log(0.6 / 0.25) + 0.4 * math.log(0.4 / 0.75)
    assert f.kl == pytest.approx(kl0 / 2, rel=1e-5)
    assert f.top1_agreement == pytest.approx(0.5)  # row 0: argmax 0 vs 1; row 1 agrees
    assert f.gold_nll == pytest.approx(-(math.log(0.75) + math.log(0.9)) / 2, rel=1e-5)
    same = fidelity(q.log(), q.log(), gold)
    assert same.kl == 0.0 and same.top1_agreement == 1.0


def test_held_bytes_counts_storage_once_and_whole():
    base = torch.zeros(10, 8, dtype=torch.float16)
    view = base[:5]
    assert held_bytes([base, view]) == 160
    assert held_bytes([view]) == 160  # a view keeps its whole storage alive
    assert held_bytes([torch.zeros(4, dtype=torch.int8), torch.zeros(2, dtype=torch.float16)]) == 8


def test_peak_memory_sees_an_allocation():
    with PeakMemory("cpu") as before:
        pass
    with PeakMemory("cpu") as during:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB
        x.add_(1)
        del x
    assert during.peak_bytes >= before.peak_bytes
