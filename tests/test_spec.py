"""Measurement spec v1 arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.spec import PeakMemory, accuracy_delta, bootstrap_mean_ci, fidelity, memory_reduction
from strategies.base import held_bytes


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


def test_identical_scores_have_a_degenerate_ci():
    d = accuracy_delta([1, 0, 1], [1, 0, 1])
    assert (d.delta_pp, d.ci_low, d.ci_high) == (0.0, 0.0, 0.0)


def test_paired_ci_is_narrower_than_unpaired_when_arms_are_correlated():
    base = [1, 0] * 20
    strat = list(base)
    strat[0] = 0  # one flip
    d = accuracy_delta(base, strat)
    assert d.ci_high - d.ci_low < 10  # an unpaired CI on two 50% arms of n=40 would span ~40 points


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
