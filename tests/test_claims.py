"""Summaries per setting and the claim check's three verdicts, on hand-built records with known answers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from kvbench import claims
from kvbench.report import SUMMARY_COLUMNS, summarize
from kvbench.stats import n_to_detect


def _records(scores: dict[str, list[float]], task: str = "legal", query_aware: bool | None = True,
             metric: str = "substring", reduction: dict[str, float] | None = None,
             depths: list[float] | None = None, context: int = 4096) -> pd.DataFrame:
    """One record per (strategy, sample); ``scores[strategy][i]`` scores sample i."""
    reduction = reduction or {}
    rows = []
    for strategy, vals in scores.items():
        family = "baseline" if strategy == "full" else ("eviction" if strategy.startswith(("snapkv", "h2o"))
                                                        else "quantization")
        for i, v in enumerate(vals):
            red = reduction.get(strategy, 0.0 if strategy == "full" else 0.48)
            row = {
                "task": task, "strategy": strategy, "family": family, "sample_id": f"s{i}", "score": float(v),
                "metric": metric, "kv_bytes": 1000 * (1 - red), "kv_bytes_fp16": 1000.0, "memory_reduction": red,
                "bytes_per_token": 1.0, "kept_fraction": 0.5 if family == "eviction" else 1.0,
                "prefill_s": 0.1, "compress_s": 0.0, "ttft_s": 0.1, "decode_ms_per_token": 1.0, "kl": 0.0,
                "top1_agreement": 1.0, "gold_nll": 0.1, "context_tokens": context, "spec_version": "1.1",
                "model": "m", "hardware": "cpu",
                "sample_meta": json.dumps({"depth": depths[i]} if depths else {}),
            }
            if query_aware is not None:
                row["query_aware"] = query_aware
            rows.append(row)
    return pd.DataFrame(rows)


def test_summary_columns_and_methods():
    recs = _records({"full": [1, 1, 1, 0, 1], "int8": [1, 0, 1, 1, 1]})
    s = summarize(recs)
    assert list(s.columns) == SUMMARY_COLUMNS
    row = s[s["strategy"] == "int8"].iloc[0]
    assert row["setting"] == "query-aware" and row["delta_method"] == "newcombe-paired"
    assert (row["n_only_strategy"], row["n_only_baseline"], row["mcnemar_p"]) == (1, 1, 1.0)
    assert row["delta_ci_low"] < 0 < row["delta_ci_high"]
    assert row["accuracy_ci_low"] < row["accuracy"] == 0.8 < row["accuracy_ci_high"]
    assert row["baseline_accuracy"] == 0.8
    f1 = summarize(_records({"full": [0.9, 0.5, 0.7, 0.2], "int8": [0.8, 0.5, 0.6, 0.3]}, metric="f1"))
    cont = f1[f1["strategy"] == "int8"].iloc[0]
    assert cont["delta_method"] == "bca-bootstrap" and math.isnan(cont["mcnemar_p"])


def test_settings_are_summarised_side_by_side_and_paired_within():
    aware = _records({"full": [1] * 4, "snapkv": [1] * 4})
    agnostic = _records({"full": [1, 1, 0, 0], "snapkv": [0, 0, 0, 0]}, query_aware=False)
    s = summarize(pd.concat([aware, agnostic], ignore_index=True))
    assert list(s["setting"].unique()) == ["query-aware", "query-agnostic"]  # the default first
    snap = s[s["strategy"] == "snapkv"].set_index("setting")
    assert snap.loc["query-aware", "delta_pp"] == 0.0  # paired with the query-aware baseline only
    assert snap.loc["query-agnostic", "delta_pp"] == -50.0
    assert snap.loc["query-agnostic", "baseline_accuracy"] == 0.5
    missing = summarize(_records({"full": [1], "int8": [1]}, query_aware=None))
    assert set(missing["setting"]) == {"query-aware"}

    check = claims.check_claims(s)
    assert [c.setting for c in check.settings] == ["query-aware", "query-agnostic"]
    text = claims.render_claims(check)
    assert "## Setting: query-aware" in text and "## Setting: query-agnostic" in text
    assert "kvpress" in text


def test_five_agreeing_samples_are_undetermined_not_confident():
    # The issue: 5 of 5 agreeing pairs made the v1.0 claim check say "holds, and with confidence".
    s = summarize(_records({"full": [1] * 5, "int8": [1] * 5}))
    h = claims.headline(s, "legal")
    assert h.verdict == claims.UNDETERMINED and h.holds and not h.holds_ci
    assert h.n_needed == n_to_detect(0.01, 1.0) and 700 < h.n_needed < 900
    assert h.pick.ci_low < -40
    text = claims.render_claims(claims.check_claims(s))
    assert "with confidence" not in text.split("## Largest")[1]
    assert "| legal | undetermined at this n | yes | no | yes | ~" in text
    assert "0 only-strategy / 0 only-baseline correct of 5, McNemar p = 1" in text


def test_enough_agreeing_samples_hold_and_clear_losses_fail():
    s = summarize(_records({"full": [1] * 1000, "int8": [1] * 1000}))
    h = claims.headline(s, "legal")
    assert h.verdict == claims.HOLDS and h.holds_ci and "with confidence" in h.sentence and h.n_needed == 0

    s = summarize(_records({"full": [1] * 50, "int8": [1] * 25 + [0] * 25}))
    h = claims.headline(s, "legal")
    assert h.verdict == claims.FAILS and not h.holds and "does not hold" in h.sentence


def test_direction_needs_the_exact_test_to_agree():
    a = claims.Pick("a", "quantization", 0.5, 0, 0, 0, 0, 1.0, 5)
    b = claims.Pick("b", "eviction", 0.5, 0, 0, 0, 0, 0.5, 5)
    four = _records({"a": [1, 1, 1, 1, 0], "b": [0, 0, 0, 0, 0]})
    c = claims.contrast(a, b, "legal", four)
    assert c.paired and c.low > 0 and c.mcnemar_p == pytest.approx(0.125)
    assert not c.a_better and not c.b_better  # the score interval alone would call it
    twelve = _records({"a": [1] * 12 + [0] * 8, "b": [0] * 20})
    c = claims.contrast(a, b, "legal", twelve)
    assert c.a_better and c.mcnemar_p < 0.05 and c.diff_pp == 60.0


def test_scenarios_get_three_verdicts_and_the_samples_to_decide():
    recs = pd.concat([
        _records({"full": [1] * 5, "snapkv": [1] * 5, "int8": [1] * 5, "int4": [1] * 5},
                 task="fiction", reduction={"snapkv": 0.5, "int8": 0.48, "int4": 0.66},
                 depths=[0.05, 0.2, 0.35, 0.1, 0.3]),
        _records({"full": [1] * 5, "snapkv": [0] * 5, "int8": [1] * 5}, reduction={"snapkv": 0.5, "int8": 0.5}),
    ], ignore_index=True)
    s = summarize(recs)
    check = claims.check_claims(s, records=recs)
    by_test = {r.scenario.test: r for r in check.scenarios}
    drop = by_test["dropping_hurts"]
    assert drop.verdict == claims.UNDETERMINED and drop.n_needed == n_to_detect(0.01, 1.0)
    legal = by_test["positions"]  # int8 vs snapkv: 5 of 5 discordant, exact p = 0.0625
    assert legal.holds is True and legal.verdict == claims.UNDETERMINED and legal.n_needed == 6
    step = by_test["quant_step_late"]  # every fiction fact is in the first third of the text
    assert step.verdict == claims.NOT_TESTABLE and "none in the last third" in step.evidence
    forgets = by_test["forgets_words"]
    assert forgets.verdict == claims.NOT_TESTABLE and "8,192" in forgets.evidence and "13,000" in forgets.evidence
    attention = by_test["attention_vs_compression"]  # snapkv loses 100 points to int8: far below +23
    assert attention.verdict == claims.FAILS


def test_sample_size_sentence_reads_the_numbers():
    text = claims.samples_sentence(1.0, 1.0, 5, "a 1-point loss")
    assert "n = 5 detects only a change of 61 points" in text and f"about {n_to_detect(0.01, 1.0):,}" in text


def test_without_records_only_non_overlapping_intervals_decide():
    a = claims.Pick("a", "quantization", 0.7, -0.6, -1.4, 0.2, 0.0, 1.0, 50)
    b = claims.Pick("b", "eviction", 0.7, -8.0, -12.0, -4.0, 0.0, 0.3, 50)
    c = claims.contrast(a, b, "papers")
    assert not c.paired and c.diff_pp == pytest.approx(7.4) and c.a_better and not c.b_better
    near = claims.Pick("c", "eviction", 0.7, -2.0, -5.0, 1.0, 0.0, 0.3, 50)
    c = claims.contrast(a, near, "papers")
    assert not c.a_better and not c.b_better
    assert claims.contrast(a, b, "papers", depth=(0.0, 0.3)) is None  # depths need the records
