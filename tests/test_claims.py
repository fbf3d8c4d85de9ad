"""Summaries per setting and the claim check's three verdicts, on hand-built records with known answers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from kvbench import claims, stats
from kvbench.paired import compare, noninferiority
from kvbench.report import SUMMARY_COLUMNS, summarize


def _records(scores: dict[str, list[float]], task: str = "legal", query_aware: bool | None = True,
             metric: str = "substring", reduction: dict[str, float] | None = None,
             depths: list[float] | None = None, context: int = 4096,
             docs: list[str] | None = None) -> pd.DataFrame:
    """One record per (strategy, sample); ``scores[strategy][i]`` scores sample i, drawn from ``docs[i]``
    (default: a document of its own)."""
    reduction = reduction or {}
    rows = []
    for strategy, vals in scores.items():
        family = "baseline" if strategy == "full" else (
            "eviction" if strategy.startswith(("snapkv", "h2o", "knorm", "tova")) else "quantization")
        for i, v in enumerate(vals):
            red = reduction.get(strategy, 0.0 if strategy == "full" else 0.48)
            row = {
                "task": task, "strategy": strategy, "family": family, "sample_id": f"s{i}", "score": float(v),
                "metric": metric, "kv_bytes": 1000 * (1 - red), "kv_bytes_fp16": 1000.0, "memory_reduction": red,
                "bytes_per_token": 1.0, "kept_fraction": 0.5 if family == "eviction" else 1.0,
                "prefill_s": 0.1, "compress_s": 0.0, "ttft_s": 0.1, "decode_ms_per_token": 1.0, "kl": 0.0,
                "top1_agreement": 1.0, "gold_nll": 0.1, "context_tokens": context, "spec_version": "1.2",
                "model": "m", "hardware": "cpu",
                "sample_meta": json.dumps({"depth": depths[i]} if depths else {}),
            }
            if query_aware is not None:
                row["query_aware"] = query_aware
            if docs is not None:
                row["document_id"] = docs[i]
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
    recs = _records({"full": [1] * 5, "int8": [1] * 5})
    s = summarize(recs)
    for h in (claims.headline(s, "legal"), claims.headline(s, "legal", records=recs)):
        assert h.verdict == claims.UNDETERMINED and h.holds and not h.holds_ci
        (member,) = h.members
        c = member.comparison
        # zero flips: the exact bound at n = 5 (one question per document: design effect 1), never zero width
        assert c.low == pytest.approx(-100 * stats.zero_count_bound(5)) and "exact-zero" in c.method
        # planned at the 95% upper bound of the discordance, since none was seen
        assert h.n_needed == stats.questions_needed(0, 0, 5, 0.01, 1.0) > stats.n_zero_flips(0.01)
    text = claims.render_claims(claims.check_claims(s, records=recs))
    assert "**holds**, and with confidence" not in text
    assert "| legal | undetermined at this n | 1 | ~" in text
    assert "| `int8` | 48.0% | task accuracy | +0.0 pp [95% CI -52.2, +52.2] | 5 / 5 / 5 |" in text


def test_noninferiority_verdicts_hold_fail_and_undetermined():
    # holds: 1,000 questions in 250 documents, no disagreement: the exact bound at n_eff = 250 is ~1.5 points,
    # too wide; at 1,000 documents of one question it is 0.37 points: holds.
    many = _records({"full": [1] * 1000, "int8": [1] * 1000})
    (v,) = noninferiority([compare(many, "int8", "full")])
    assert v.verdict == claims.HOLDS and v.comparison.low > -1 and v.comparison.n_documents == 1000
    clustered = _records({"full": [1] * 1000, "int8": [1] * 1000}, docs=[f"d{i // 4}" for i in range(1000)])
    (v,) = noninferiority([compare(clustered, "int8", "full")])
    assert v.comparison.deff == 4.0 and v.comparison.n_documents == 250 and v.verdict == claims.UNDETERMINED
    # fails: half the answers lost
    lossy = _records({"full": [1] * 50, "int8": [1] * 25 + [0] * 25})
    (v,) = noninferiority([compare(lossy, "int8", "full")])
    assert v.verdict == claims.FAILS and v.comparison.high < -1
    # undetermined: a handful of agreeing questions
    few = _records({"full": [1] * 8, "int8": [1] * 8})
    (v,) = noninferiority([compare(few, "int8", "full")])
    assert v.verdict == claims.UNDETERMINED
    # Holm within the family: alone, a member whose one-sided p is 0.02 holds; beside a second one at the
    # same p it does not (0.02 * 2 > 0.025).
    edge = _records({"full": [1] * 400, "int8": [1] * 400, "fp8": [1] * 400})
    alone = noninferiority([compare(edge, "int8", "full")])[0]
    pair = noninferiority([compare(edge, "int8", "full"), compare(edge, "fp8", "full")])[0]
    assert alone.p_holds < 0.025 and alone.verdict == claims.HOLDS
    assert pair.p_holds_adj == pytest.approx(2 * alone.p_holds) and pair.verdict == claims.UNDETERMINED


def test_headline_family_is_the_band_and_pooled_scopes_keep_one_context_length():
    legal = _records({"full": [1] * 6, "int8": [1] * 6, "int2": [0] * 6, "int4": [1] * 6},
                     reduction={"int8": 0.48, "int2": 0.85, "int4": 0.70})
    papers = _records({"full": [1] * 6, "int8": [1] * 6, "int2": [0] * 6, "int4": [1] * 6}, task="papers",
                      reduction={"int8": 0.48, "int2": 0.85, "int4": 0.70})
    fiction = _records({"full": [1] * 6, "int8": [0] * 6, "int2": [0] * 6, "int4": [1] * 6}, task="fiction",
                       context=2048, reduction={"int8": 0.48, "int2": 0.85, "int4": 0.70})
    recs = pd.concat([legal, papers, fiction], ignore_index=True)
    check = claims.check_claims(summarize(recs), records=recs)
    (aware,) = check.settings
    assert aware.scopes == ["fiction", "legal", "papers", "all@4096"]  # fiction's 2K is never pooled with 4K
    pooled = aware.headline["all@4096"]
    assert [m.comparison.a for m in pooled.members] == ["int8"]  # only the 40-60% band is the family
    (m,) = pooled.members
    assert m.comparison.n_questions == 12 and m.comparison.n_documents == 12  # legal and papers only
    text = claims.render_claims(check)
    assert "all tasks at 4,096 tokens (pooled)" in text and "12 / 12 / 12" in text


def test_ties_are_shown_as_ties_not_ranked_by_name():
    recs = _records({"full": [1, 1, 0, 1, 1, 1], "int8": [1, 1, 0, 1, 0, 1], "fp8": [1, 1, 0, 1, 0, 1]},
                    reduction={"int8": 0.48, "fp8": 0.50})
    h = claims.headline(summarize(recs), "legal", records=recs)
    assert h.ties == (("fp8", "int8"),) and "`fp8` = `int8`" in h.sentence


def test_direction_needs_the_exact_test_to_agree():
    a = claims.Pick("a", "quantization", 0.5, 0, 0, 0, 0, 1.0, 5)
    b = claims.Pick("b", "eviction", 0.5, 0, 0, 0, 0, 0.5, 5)
    four = _records({"a": [1, 1, 1, 1, 0], "b": [0, 0, 0, 0, 0]})
    c = claims.contrast(a, b, "legal", four)
    assert c.paired and c.low > 0 and c.mcnemar_p == pytest.approx(0.125) and c.p == pytest.approx(0.125)
    assert not c.a_better and not c.b_better  # the score interval alone would call it
    twelve = _records({"a": [1] * 12 + [0] * 8, "b": [0] * 20})
    c = claims.contrast(a, b, "legal", twelve)
    assert c.a_better and c.p < 0.05 and c.diff_pp == 60.0
    assert "n = 20 questions / 20 contexts / 20 documents" in c.text()


def test_comparator_is_the_best_member_at_matched_memory_not_the_first_name():
    # papers: fp8 against three evictions at exactly 50%. Alphabetically knorm comes first and is the weakest
    # (it loses every question fp8 answers); tova, the best, answers 11 of fp8's 12.
    n = 24
    fp8 = [1] * 12 + [0] * 12
    recs = _records({"full": fp8, "fp8": fp8, "knorm": [0] * n, "snapkv": [1] * 6 + [0] * 18,
                     "tova": [1] * 11 + [0] * 13}, task="papers",
                    reduction={"fp8": 0.50, "knorm": 0.50, "snapkv": 0.50, "tova": 0.50})
    s = summarize(recs)
    task_picks = claims.picks(s, "papers")
    quant = [p for p in task_picks if p.family == "quantization"]
    evict = [p for p in task_picks if p.family == "eviction"]
    assert claims.matched_pair(quant, evict)[1].strategy == "knorm"  # v1.1's pick: the tie broken by name
    alone = claims.contrast(quant[0], evict[0], "papers", recs)
    assert alone.a_better  # ... on which v1.1 said "holds"
    res = claims.scenario(s, claims.SCENARIOS[1], recs)
    assert res.verdict == claims.UNDETERMINED  # against tova (+4 points) nothing is decided
    for other in ("knorm", "snapkv", "tova"):  # every pair is listed
        assert f"`fp8` − `{other}`" in res.evidence
    assert "Holm-adjusted p" in res.evidence and res.n_needed > 0


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
    drop = by_test["dropping_hurts"]  # snapkv agrees with full on all 5 fiction questions
    assert drop.verdict == claims.UNDETERMINED and drop.n_needed == stats.questions_needed(0, 0, 5, 0.01, 1.0)
    legal = by_test["positions"]  # int8 vs snapkv: 5 of 5 discordant, exact p = 0.0625
    assert legal.holds is True and legal.verdict == claims.UNDETERMINED and legal.n_needed == 6
    step = by_test["quant_step_late"]  # every fiction fact is in the first third of the text
    assert step.verdict == claims.NOT_TESTABLE and "none in the last third" in step.evidence
    forgets = by_test["forgets_words"]
    assert forgets.verdict == claims.NOT_TESTABLE and "8,192" in forgets.evidence and "13,000" in forgets.evidence
    attention = by_test["attention_vs_compression"]  # snapkv loses 100 points to int8: far below +23
    assert attention.verdict == claims.FAILS


def test_sample_size_sentence_reads_the_numbers():
    recs = _records({"full": [1] * 51, "int8": [1] * 50 + [0]})
    c = compare(recs, "int8", "full")
    n = c.questions_needed(1.0)
    text = claims.samples_sentence(n, c, "a 1-point loss")
    assert f"about {n:,} questions" in text and "1 of 51 questions" in text and "Connor" in text


def test_without_records_only_non_overlapping_intervals_decide():
    a = claims.Pick("a", "quantization", 0.7, -0.6, -1.4, 0.2, 0.0, 1.0, 50)
    b = claims.Pick("b", "eviction", 0.7, -8.0, -12.0, -4.0, 0.0, 0.3, 50)
    c = claims.contrast(a, b, "papers")
    assert not c.paired and c.diff_pp == pytest.approx(7.4) and c.a_better and not c.b_better
    near = claims.Pick("c", "eviction", 0.7, -2.0, -5.0, 1.0, 0.0, 0.3, 50)
    c = claims.contrast(a, near, "papers")
    assert not c.a_better and not c.b_better
    assert claims.contrast(a, b, "papers", depth=(0.0, 0.3)) is None  # depths need the records


def test_full_against_itself_is_the_reference_without_an_interval():
    s = summarize(_records({"full": [1, 0, 1, 1], "int8": [1, 0, 1, 0]}))
    full = s[s["strategy"] == "full"].iloc[0]
    assert full["delta_pp"] == 0 and full["delta_method"] == "reference"
    assert math.isnan(full["delta_ci_low"]) and math.isnan(full["delta_ci_high"])
    int8 = s[s["strategy"] == "int8"].iloc[0]
    assert int8["delta_ci_low"] < int8["delta_pp"] < int8["delta_ci_high"]


def test_leaderboard_pooled_rows_keep_one_context_length():
    from kvbench.leaderboard import overall_summary

    four_k = pd.concat([_records({"full": [1] * 4, "int8": [1] * 4}),
                        _records({"full": [1] * 4, "int8": [1, 1, 1, 0]}, task="papers")], ignore_index=True)
    fiction = _records({"full": [1] * 4, "int8": [0] * 4}, task="fiction", context=2048)
    pooled = overall_summary(pd.concat([four_k, fiction], ignore_index=True), ["fiction", "legal", "papers"])
    int8 = pooled[pooled["strategy"] == "int8"].iloc[0]
    assert int8["n"] == 8 and int8["delta_pp"] == -12.5  # legal and papers at 4,096 only


def test_secondary_endpoints_have_clustered_intervals_or_say_they_are_constant():
    from kvbench.paired import SECONDARY, secondary

    recs = _records({"full": [1] * 6, "int8": [1] * 6}, docs=["a", "a", "b", "b", "c", "c"])
    nll = [0.10, 0.12, 0.20, 0.25, 0.11, 0.30]
    recs.loc[recs["strategy"] == "int8", "gold_nll"] = nll
    recs.loc[recs["strategy"] == "int8", "top1_agreement"] = [1.0, 0.9, 1.0, 0.8, 1.0, 1.0]
    out = {c.endpoint: c for c in secondary(recs, "int8", "full")}
    assert set(out) == set(SECONDARY)
    rel = out[SECONDARY[0]]  # full's gold NLL is 0.1 on every question
    assert rel.estimate == pytest.approx((sum(nll) - 0.6) / 0.6) and rel.low < rel.estimate < rel.high
    assert rel.n_documents == 3 and rel.method == "cluster-bootstrap"
    top1 = out[SECONDARY[1]]
    assert top1.estimate == pytest.approx(5.7 / 6) and top1.low < top1.high <= 1.0
    kl = out[SECONDARY[2]]  # 0 on every question: no interval, never a zero-width one
    assert kl.estimate == 0 and math.isnan(kl.low) and "constant" in kl.method


def test_identical_figures_are_listed_as_ties_in_the_point_estimate_tables():
    recs = _records({"full": [1, 1, 0, 1], "int8": [1, 1, 0, 1], "bfp": [1, 1, 0, 1], "int4": [1, 0, 0, 1]},
                    reduction={"int8": 0.48, "bfp": 0.48, "int4": 0.7})
    text = claims.render_claims(claims.check_claims(summarize(recs), records=recs))
    assert "`bfp` (quantization), tied with `int8`" in text  # not int8 ranked below bfp by its name
    assert "| `bfp` = `int8` |" in text


def test_quantization_step_tests_every_equally_close_pair():
    recs = _records({"full": [1] * 6, "int8": [1] * 6, "fp8": [1] * 6, "bfp": [1] * 6}, task="fiction",
                    reduction={"int8": 0.48, "fp8": 0.50, "bfp": 0.52}, depths=[0.8] * 6)
    res = claims.scenario(summarize(recs), claims.SCENARIOS[5], recs)
    assert "2 pairs are equally close in memory" in res.evidence
    assert "`int8` − `fp8`" in res.evidence and "`fp8` − `bfp`" in res.evidence
    assert res.verdict == claims.UNDETERMINED and res.n_needed > 0  # 6 agreeing questions allow a 0.8-point cut
