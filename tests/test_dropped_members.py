"""A member dropped from a confirmatory sweep once its verdict is final (docs/confirm.md): the sweep goes on in
another run (fewer strategies: another run id) from a later context, whose records number their samples from 0.
The judge places records by the design's first context, takes the study's looks from the baseline and the members
still sampled, tests a dropped member no further, and refuses a member dropped while undecided or a question
counted twice."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from test_claims import _records

from kvbench import scoretest, sequential
from kvbench.errors import KVBenchError
from kvbench.leaderboard import build, render_claim_check, render_markdown
from kvbench.leaderboard.table import STOPPED
from kvbench.paired import FAILS, FUTILE, HOLDS, noninferiority_through_looks
from kvbench.sequential import Design

FIRST, CONTEXTS, QUESTIONS, TASKS = 1000, 16, 8, ("legal", "papers")
DESIGN = Design(CONTEXTS, 8, scopes=("pooled", *TASKS), multiplicity="gatekeeping", statistic=scoretest.NAME,
                futility=0.2, drift=3.0, first_context=FIRST)


def _study(seed: int = 5) -> pd.DataFrame:
    """Every member on every context: ``good`` never disagrees with full, ``bad`` loses every answer full gets,
    ``weak`` disagrees at random (undecided at look 1). Records of contexts from 8 on carry ``index`` from 0, as a
    run continuing the design from context 1008 writes them."""
    rng = np.random.default_rng(seed)
    parts = []
    for task in TASKS:
        full = (rng.random(CONTEXTS * QUESTIONS) < 0.8).astype(float)
        weak = np.where(rng.random(full.size) < 0.9, full, 1 - full)
        recs = _records({"full": list(full), "good": list(full), "bad": [0.0] * full.size, "weak": list(weak)},
                        task=task, query_aware=False)
        i = recs["sample_id"].str[1:].astype(int)
        c = i // QUESTIONS
        q = i % QUESTIONS
        recs = recs.assign(sample_id=[f"{task}/retrieval/{FIRST + a}/q{b}" for a, b in zip(c, q, strict=True)],
                           context_id=[f"{task}/retrieval/{FIRST + a}" for a in c],
                           document_id=[f"{task}-doc{a}" for a in c],
                           sample_meta=[json.dumps({"index": int(a if a < 8 else a - 8)}) for a in c])
        parts.append(recs)
    return pd.concat(parts, ignore_index=True)


def _drop(recs: pd.DataFrame, member: str, after: int = 8) -> pd.DataFrame:
    """``recs`` without ``member``'s records of contexts ``after`` on (it left the sweep there)."""
    idx = sequential.context_index(recs, FIRST)
    return recs[~((recs["strategy"] == member) & (idx >= after))].reset_index(drop=True)


def test_context_index_follows_the_designs_first_context_not_the_runs_count():
    recs = _study()
    assert sorted(set(sequential.context_index(recs, FIRST))) == list(range(CONTEXTS))
    # a run's own count restarts at the second run: read by it, the later contexts would land on look 1's
    assert sorted(set(sequential.context_index(recs))) == list(range(8))
    assert sequential.context_index(recs.assign(context_id="legal/retrieval/0999"), FIRST).eq(-1).all()


def test_a_member_dropped_once_decided_leaves_the_study_looking_on():
    recs = _study()
    members = ["bad", "good", "weak"]
    kept = {v.comparison.a: v for v in noninferiority_through_looks(recs, members, "full", DESIGN, margin=10.0)}
    dropped = _drop(recs, "bad")
    assert sequential.stopped(dropped, DESIGN, members, "full") == {"bad": 1}
    assert sequential.stopped(recs, DESIGN, members, "full") == {}
    got = {v.comparison.a: v for v in noninferiority_through_looks(dropped, members, "full", DESIGN, margin=10.0)}
    assert got["bad"].verdict == FAILS and got["bad"].look.decided_at == 1 and got["bad"].look.look == 1
    assert got["bad"].comparison.n_questions == 8 * QUESTIONS * len(TASKS)  # its comparison is its own last look's
    assert got["good"].verdict == kept["good"].verdict == HOLDS and got["good"].look.look == 2
    assert got["good"].look.decided_at == kept["good"].look.decided_at
    assert got["good"].comparison.n_questions == CONTEXTS * QUESTIONS * len(TASKS)
    # its task scopes stay where look 1 left them, said so, and are tested no further
    (legal,) = [v for v in noninferiority_through_looks(dropped, members, "full", DESIGN, margin=10.0, scope="legal")
                if v.comparison.a == "bad"]
    if not legal.look.decided_at:
        assert legal.look.stopped_at == 1 and "not sampled after look 1 of 2" in legal.text()
    lb = build(dropped, design=DESIGN)
    assert lb.meta["look"] == "2" and lb.meta["stopped"] == "bad (look 1)"
    row = lb.table.set_index("strategy").loc["bad"]
    assert row["all.n"] == 8 * QUESTIONS * len(TASKS)


def test_a_member_dropped_while_undecided_is_refused():
    dropped = _drop(_study(), "weak")
    assert sequential.stopped(dropped, DESIGN, ["bad", "good", "weak"], "full") == {"weak": 1}
    with pytest.raises(KVBenchError, match=r"weak has no records after look 1 .* not final at look 1"):
        noninferiority_through_looks(dropped, ["bad", "good", "weak"], "full", DESIGN, margin=10.0)


def test_a_member_still_sampled_holds_the_look_back():
    recs = _study()
    idx = sequential.context_index(recs, FIRST)
    # weak has contexts 0-11 in legal: past look 1, so still being sampled, and look 2 waits for it
    lagging = recs[~((recs["strategy"] == "weak") & (recs["task"] == "legal") & (idx >= 12))]
    assert sequential.stopped(lagging, DESIGN, ["bad", "good", "weak"], "full") == {}
    assert build(lagging, design=DESIGN).meta["look"] == "1"


def test_a_question_held_by_two_runs_under_different_metadata_is_refused():
    recs = _study()
    again = recs[(recs["strategy"] == "full") & (recs["context_id"] == "legal/retrieval/1000")]
    twice = pd.concat([recs, again.assign(sample_meta=json.dumps({"index": 5}), config_hash="other")],
                      ignore_index=True)
    with pytest.raises(KVBenchError, match="held by two runs under different sample metadata"):
        build(twice, design=DESIGN)


def test_a_member_that_measured_past_its_last_look_before_leaving_is_stopped_there():
    # the first runs went 4 contexts past look 1 before the decided members were dropped
    recs = _drop(_study(), "bad", after=12)
    assert sequential.stopped(recs, DESIGN, ["bad", "good", "weak"], "full") == {"bad": 1}
    lb = build(recs, design=DESIGN)
    assert lb.meta["look"] == "2" and lb.meta["stopped"] == "bad (look 1)"
    assert lb.table.set_index("strategy").loc["bad", "all.n"] == 8 * QUESTIONS * len(TASKS)
    assert lb.meta["after_look"] == "0"  # its 4 contexts past look 1 wait for no look
    for page in (render_claim_check(lb), render_markdown(lb)):
        assert "not sampled after the look named" in page and "bad (look 1)" in page


def test_the_leaderboard_says_stopped_for_futility_where_the_claim_check_does():
    recs = _study()
    judged = {v.comparison.a: v.verdict for v in noninferiority_through_looks(recs, ["bad", "good", "weak"], "full",
                                                                              DESIGN)}
    assert FUTILE in judged.values()  # at the 1-point margin, 128 questions a look decide no small loss
    lb = build(recs, design=DESIGN)
    shown = dict(zip(lb.table["strategy"], lb.table["all.verdict"], strict=True))
    for member, verdict in judged.items():
        if verdict == FUTILE:
            assert shown[member] == STOPPED == verdict
    assert "(not shown to hold, sampling stopped; not shown to fail)" in render_markdown(lb)
