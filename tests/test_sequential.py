"""Group-sequential verdicts (spec v1.2 §2.5): boundaries against published values and a simulation, looks as
prefixes of the store, Holm carried through the looks, and the leaderboard / plan judging a store by a design."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from test_claims import _records

from kvbench import claims, plan, sequential
from kvbench.errors import KVBenchError
from kvbench.leaderboard import answer_sentence, build, render_claim_check
from kvbench.paired import compare, noninferiority, noninferiority_through_looks
from kvbench.sequential import Design, boundaries, holm_through_looks
from kvbench.sweep import load_sweep


def test_obrien_fleming_boundaries_match_published_values():
    # gsDesign(k = 3, test.type = 1, alpha = 0.025, sfu = sfLDOF): upper bounds 3.7103, 2.5114, 1.9930
    # (Anderson, gsDesign manual; Jennison & Turnbull 2000, table 7.6 lists the same design).
    assert boundaries(0.025, (1 / 3, 2 / 3, 1.0)) == pytest.approx((3.7103, 2.5114, 1.9930), abs=2e-4)
    # the first look of a spending design is exact: its whole spend is P(Z_1 >= c_1)
    first = 2 * sps.norm.sf(sps.norm.isf(0.0125) / math.sqrt(1 / 3))
    assert boundaries(0.025, (1 / 3, 2 / 3, 1.0))[0] == pytest.approx(sps.norm.isf(first), abs=1e-9)
    # one look is the fixed-sample test
    assert boundaries(0.025, (1.0,)) == pytest.approx((sps.norm.isf(0.025),), abs=1e-12)


@pytest.mark.parametrize("spending", sorted(sequential.SPENDING))
def test_boundaries_keep_the_one_sided_error_over_all_looks(spending):
    # Brownian motion simulated at the looks: the chance of crossing any boundary is alpha (within 4 SE), where
    # testing every look at the fixed-sample level would cross far more often (Armitage et al. 1969).
    t = np.array([0.2, 0.4, 0.6, 0.8, 1.0])
    c = np.array(boundaries(0.025, tuple(t), spending))
    rng = np.random.default_rng(7)
    z = (rng.standard_normal((200_000, len(t))) * np.sqrt(np.diff(np.concatenate([[0.0], t])))).cumsum(1) / np.sqrt(t)
    crossed = float((z >= c).any(axis=1).mean())
    assert abs(crossed - 0.025) < 4 * math.sqrt(0.025 * 0.975 / len(z))
    naive = float((z >= sps.norm.isf(0.025)).any(axis=1).mean())
    assert naive > 0.06
    assert all(np.diff(c) < 0) if spending == "obrien-fleming" else c[-1] > sps.norm.isf(0.025)


def test_design_validation_names_the_valid_choices(tmp_path):
    with pytest.raises(KVBenchError, match="valid: obrien-fleming, pocock"):
        Design(150, 10, "haybittle")
    with pytest.raises(KVBenchError, match="look_every must be an integer >= 1"):
        Design(150, 0)
    with pytest.raises(KVBenchError, match="valid: look_every, spending"):
        Design.from_mapping({"look_every": 10, "looks": 3}, 150)
    d = Design(150, 10)
    assert d.n_looks == 15 and d.contexts(15) == 150 and d.fractions[0] == pytest.approx(1 / 15)
    assert Design(25, 10).fractions == (0.4, 0.8, 1.0)  # the last look is the planned n
    bad = tmp_path / "s.yaml"
    bad.write_text("overrides: [model=smollm2-135m, 'strategies=[int8]']\ndesign: {look_every: 5}\n")
    with pytest.raises(KVBenchError, match="task.n_samples"):
        load_sweep(bad)
    headline = load_sweep("headline")
    assert headline.design == Design(150, 10, "obrien-fleming")


def test_holm_carries_rejections_and_alpha_through_the_looks():
    d = Design(2, 1)  # two looks at t = 0.5 and 1
    level = {a: [sequential.nominal_level(a, d, j) for j in (1, 2)] for a in (0.025, 0.0125)}
    # look 1: "a" is just under the half-alpha level, "b" just under the full one: a is rejected, b inherits
    # a's share and is rejected at once; at look 2 nothing is undone although a's p grew
    looks = [{"a": level[0.0125][0] * 0.9, "b": level[0.025][0] * 0.9}, {"a": 0.5, "b": 0.5}]
    assert holm_through_looks(looks, 0.025, d) == {"a": (1, 0.0125), "b": (1, 0.025)}
    # b alone above its half share at look 1 stays open until a falls at look 2
    looks = [{"a": 0.2, "b": level[0.025][0] * 0.9}, {"a": level[0.0125][1] * 0.9, "b": level[0.025][1] * 0.9}]
    assert holm_through_looks(looks, 0.025, d) == {"a": (2, 0.0125), "b": (2, 0.025)}
    assert holm_through_looks([{"a": 0.5}], 0.025, d) == {}


def _looked(scores: dict[str, list[float]], per_context: int = 8, tasks=("legal",)) -> pd.DataFrame:
    """``_records`` with context ids and indices: question i sits in context i // ``per_context``."""
    parts = []
    for task in tasks:
        recs = _records(scores, task=task, query_aware=False)
        i = recs["sample_id"].str[1:].astype(int)
        ctx = i // per_context
        parts.append(recs.assign(context_id=[f"{task}/retrieval/{c:03d}" for c in ctx],
                                 document_id=[f"doc{c}" for c in ctx],
                                 sample_meta=[json.dumps({"index": int(c)}) for c in ctx]))
    return pd.concat(parts, ignore_index=True)


def test_looks_are_prefixes_complete_for_every_strategy():
    recs = _looked({"full": [1] * 248, "int8": [1] * 248}, tasks=("legal", "papers"))  # 31 contexts each
    d = Design(60, 10)
    assert sequential.complete_looks(recs, d, ["full", "int8"]) == 3
    assert set(sequential.context_index(sequential.at_look(recs, d, 2))) == set(range(20))
    gap = recs[~((recs["task"] == "papers") & (recs["strategy"] == "int8")
                 & (sequential.context_index(recs) == 14))]
    assert sequential.complete_looks(gap, d, ["full", "int8"]) == 1  # papers/int8 lacks context 14
    # without sample_meta the context id's trailing number is the index
    assert list(sequential.context_index(recs.drop(columns="sample_meta")).head(9)) == [0] * 8 + [1]


def test_an_early_look_does_not_decide_what_the_fixed_n_test_would():
    # 400 questions in 50 contexts, int8 loses 13 and gains none: the fixed-sample test calls it a failure
    # (Δ = -3.25, upper end below -1), but at look 1 of 3 the O'Brien-Fleming level is far smaller than alpha
    recs = _looked({"full": [1] * 400, "int8": [0 if i % 33 == 0 else 1 for i in range(400)]})
    (fixed,) = noninferiority([compare(recs, "int8", "full")])
    assert fixed.verdict == claims.FAILS
    (seq,) = noninferiority_through_looks(recs, ["int8"], "full", Design(150, 50))  # look 1: t = 1/3
    assert seq.verdict == claims.UNDETERMINED and seq.look.look == 1
    assert seq.p_fails == fixed.p_fails < 0.025 and seq.p_fails > seq.look.level
    # the repeated confidence interval at the look's level straddles the margin, as the verdict says
    lo, hi = seq.look.repeated
    assert lo < fixed.comparison.low and lo < -1 < hi and "repeated confidence interval" in seq.text()
    # planned at the last look's level, stricter than alpha: more questions than the fixed-n plan
    assert seq.look.final_level < 0.025
    assert seq.questions_needed() > seq.comparison.questions_needed(1.0) > 0
    # one look at the planned n is the fixed-sample test
    (once,) = noninferiority_through_looks(recs, ["int8"], "full", Design(50, 50))
    assert once.verdict == claims.FAILS and once.look.decided_at == 1
    assert once.look.level == pytest.approx(0.025)


def test_a_verdict_reached_at_a_look_is_kept():
    # contexts 0-9 lose half their answers (fails at look 1 of 4); contexts 10-39 gain as many back, so the
    # last look alone would not fail: the verdict reached at look 1 stands
    full = [1] * 80 + [0 if i % 6 == 0 else 1 for i in range(240)]
    int8 = [0 if i % 2 else 1 for i in range(80)] + [1] * 240
    recs = _looked({"full": full, "int8": int8})
    (v,) = noninferiority_through_looks(recs, ["int8"], "full", Design(40, 10))
    assert v.verdict == claims.FAILS and v.look.decided_at == 1 and v.look.look == 4
    assert v.comparison.n_questions == 320 and v.comparison.estimate == 0.0  # shown: the last complete look
    assert noninferiority([compare(recs, "int8", "full")])[0].verdict != claims.FAILS


def test_undecided_at_the_last_look_is_undetermined_at_the_planned_n():
    # 400 questions in 50 contexts, int8 loses 3 (-0.75 pp): neither direction is decided. At look 2 of 4 more
    # looks may decide it; at the last look of a 2-look design the planned n is spent, and every table says so.
    recs = _looked({"full": [1] * 400, "int8": [0 if i % 150 == 7 else 1 for i in range(400)],
                    "fp8": [0 if i % 3 == 0 else 1 for i in range(400)]})
    (last,) = noninferiority_through_looks(recs, ["int8"], "full", Design(50, 25))
    assert last.verdict == claims.UNDETERMINED and last.look.look == last.look.n_looks == 2 and last.look.final
    assert last.verdict_text == "undetermined at the planned n" and "the design's last look" in last.text()
    assert "the design ends undetermined" in last.text() and last.questions_needed() > 400
    (mid,) = noninferiority_through_looks(recs, ["int8"], "full", Design(100, 25))
    assert mid.verdict == claims.UNDETERMINED and mid.look.look == 2 and not mid.look.final
    assert mid.verdict_text == claims.UNDETERMINED and "planned n" not in mid.text()
    # a verdict reached at the last look is a verdict, not "undetermined at the planned n"
    (fp8,) = noninferiority_through_looks(recs, ["fp8"], "full", Design(50, 25))
    assert fp8.verdict == claims.FAILS and fp8.verdict_text == claims.FAILS and not fp8.look.final
    recs = recs.assign(dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0, strategy_name=recs["strategy"],
                       params="{}")
    lb = build(recs[recs["strategy"] != "fp8"], design=Design(50, 25))
    text = render_claim_check(lb)
    assert re.search(r"\| `int8` \|.*\(look 2, the last\).*\| undetermined at the planned n \|", text)
    assert "**undetermined at the planned n**: no strategy" in text
    check = claims.check_claims(lb.summary, lb.meta, lb.records, design=lb.design)
    assert {r[4] for r in plan.plan_rows(check) if r[3] == "int8"} == {"undetermined at the planned n"}


def test_before_its_first_look_a_design_judges_nothing_and_every_page_says_so():
    # 5 contexts per task against looks every 10: no look is complete, so the pages say the figures are interim.
    from kvbench.leaderboard import render_markdown

    recs = _looked({"full": [1] * 40, "int8": [1] * 40}, tasks=("legal", "papers"))
    recs = recs.assign(dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0, strategy_name=recs["strategy"],
                       params="{}")
    lb = build(recs, design=Design(100, 10))
    assert lb.meta["look"] == "0"
    assert "no look of the design is complete yet" in render_markdown(lb)
    assert "No look is complete yet" in render_claim_check(lb)
    assert "no look of the design" not in render_markdown(build(recs))
    assert lb.table["interim"].all() and "interim" not in build(recs).table  # the CSV says so; advise skips it


def test_leaderboard_and_plan_judge_the_store_at_its_last_look(tmp_path, capsys):
    recs = _looked({"full": [1] * 264, "int8": [1] * 264, "fp8": [0 if i % 3 == 0 else 1 for i in range(264)]},
                   tasks=("legal", "papers"))  # 33 contexts per task
    recs = recs.assign(dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0, strategy_name=recs["strategy"],
                       params="{}")
    d = Design(100, 10)
    lb = build(recs, design=d)
    assert lb.meta["look"] == "3" and lb.meta["look_contexts"] == "30" and lb.meta["after_look"] == str(3 * 8 * 2 * 3)
    assert sequential.context_index(lb.records).max() == 29
    text = render_claim_check(lb)
    assert "**look 3 of 10** (30 contexts of every task)" in text and "Group-sequential design" in text
    assert re.search(r"\| `fp8` \| 48\.0% \| task accuracy \| .* \| 480 / 60 / 60 \|", text)
    assert "deciding p < level (look), or level needed" in text
    # without a design the same records are judged at their full n, as before
    assert "Group-sequential" not in render_claim_check(build(recs))
    (tmp_path / "store").mkdir()
    for task, part in recs.groupby("task"):  # one run per task, as the sweep writes them
        part.assign(run_id=f"{task}-m-abc", config_hash=f"{task}abc").to_parquet(
            tmp_path / "store" / f"{task}-m-abc.parquet")
    sweep = tmp_path / "g.yaml"
    sweep.write_text("overrides: [model=smollm2-135m, 'strategies=[int8]', task.n_samples=100]\n"
                     "design: {look_every: 10}\n")
    assert plan.main(["--results-dir", str(tmp_path), "--design", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "480 / 60" in out
    assert plan.main(["--results-dir", str(tmp_path), "--design", "nonexistent"]) == 2
    assert "no sweep file 'nonexistent'" in capsys.readouterr().err


def _inside_the_margin(extra: dict[str, list[float]] | None = None, tasks=("legal",)) -> pd.DataFrame:
    """1,600 one-question contexts per task where int8 loses 8 and gains 4: its 95% interval lies inside the
    margin, so the fixed-n test holds, while at look 1 of 3 of ``Design(4800, 1600)`` nothing is decided."""
    full, int8 = [1] * 1600, [1] * 1600
    for i in range(8):
        int8[150 * i] = 0
    for i in range(4):
        full[150 * i + 75] = 0
    recs = _looked({"full": full, "int8": int8, **(extra or {})}, per_context=1, tasks=tasks)
    return recs.assign(dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0, strategy_name=recs["strategy"],
                       params="{}")


def test_the_answer_says_why_an_interval_inside_the_margin_is_not_yet_a_verdict():
    # at look 1 of 3 the design's level is stricter and the answer must say so, not claim the interval straddles
    # the margin
    recs = _inside_the_margin({"fp8": [0 if i % 3 == 0 else 1 for i in range(1600)]})
    sequential_answer = answer_sentence(build(recs, design=Design(4800, 1600)), "query-agnostic")
    assert "undetermined at this n — its 95% interval lies above the margin" in sequential_answer
    assert "at look 1 of 3 of the sequential design" in sequential_answer
    assert "staying within 1 point" in answer_sentence(build(recs), "query-agnostic")


def test_under_a_design_a_task_interval_inside_the_margin_is_no_verdict_for_what_reads_the_table():
    # int8 loses 8 and gains 4 of 1,600 questions on each task: each task's 95% interval lies inside the margin,
    # which a fixed-n reading calls "holds"; at look 1 of 3 the design's task hypotheses are gated on the pooled
    # one and undecided, and `kvbench advise` (which reads the CSV) must take the design's word, not the interval's
    from kvbench import advise
    from kvbench.leaderboard.table import UNDECIDED_IN, WITHIN

    recs, design = _inside_the_margin(tasks=("legal", "papers")), Design(4800, 1600)
    fixed, lb = build(recs).table, build(recs, design=design)
    designed, check = lb.table, claims.check_claims(lb.summary, records=lb.records, design=design)
    row = designed[designed["strategy"] == "int8"].iloc[0]
    for task in ("legal", "papers"):
        assert row[f"{task}.delta_ci_low"] > -1  # the interval alone would say "holds"
        assert row[f"{task}.verdict"] == UNDECIDED_IN
        (member,) = check.settings[0].headline[task].members  # the claim check's word on the task, the same
        assert member.verdict == claims.UNDETERMINED
        assert f"{task}.verdict" not in fixed  # a fixed-n table carries no per-task verdict ...

    def evidence(table):
        (m,) = [m for m in advise.measured_from_table(table, "query-agnostic", lambda *_: "4,096", "x",
                                                       ["legal", "papers"]) if m.label == "int8"]
        return m.evidence["legal"].verdict

    assert evidence(fixed) == WITHIN  # ... so advise reads its interval, as the leaderboard's words would
    assert evidence(designed) == UNDECIDED_IN
