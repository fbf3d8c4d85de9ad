"""Length bands (kvbench.bands): one's own documents keep their natural lengths, and the leaderboard, its answer
and the claim check pool every question of such a task once, in one band that the tables name."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvbench import bands, claims, leaderboard
from kvbench.leaderboard.render import answer_sentence
from kvbench.results import read_store
from kvbench.vocab import OVERALL


@pytest.fixture(scope="module")
def records(store_dir) -> pd.DataFrame:
    return read_store(store_dir)


def _natural(records: pd.DataFrame, task: str, budget: int | None) -> pd.DataFrame:
    """``task``'s records as a natural-length task's: the fixture's 64- and 128-token contexts become the varying
    lengths of one's own documents under one budget (``None``: records from before budgets were recorded)."""
    out = records[records["task"] == task].copy()

    def meta(m: str, n: int) -> str:
        d = {**json.loads(m), "original_context_tokens": int(n), "truncation": "middle"}
        if budget is not None:
            d["context_budget"] = budget
        return json.dumps(d, sort_keys=True)

    out["sample_meta"] = [meta(m, n) for m, n in zip(out["sample_meta"], out["context_tokens"], strict=True)]
    return out


def test_fixed_lengths_are_their_own_bands(records):
    got = bands.bands(records)
    assert (got == records["context_tokens"].astype(float)).all()
    assert bands.band_text(records, 128.0) == "128 tokens"


@pytest.mark.parametrize("budget", [256, None])
def test_natural_lengths_pool_every_question_in_one_band(records, budget):
    own = _natural(records, "alpha", budget)
    assert set(bands.bands(own)) == {float(budget or 128)}
    lb = leaderboard.build(own)
    questions = own[own["strategy"] == "full"]["sample_id"].nunique()
    assert questions > own[(own["strategy"] == "full") & (own["context_tokens"] == 128)]["sample_id"].nunique()
    pooled = lb.table[lb.table["strategy"] != "full"]
    assert (pooled[f"{OVERALL}.n"] == questions).all()
    assert (pooled[f"{OVERALL}.n"] == pooled["alpha.n"]).all()  # the pooled row and the task's row agree
    scope = lb.pooled_scope("query-agnostic" if "query-agnostic" in lb.settings else lb.settings[0])
    assert scope.text() == f"alpha pooled at 64–128 tokens (one band, up to {budget or 128:,})"
    assert "(one band, up to" in answer_sentence(lb, lb.settings[0])  # the answer names the band it rests on
    # the claim check judges the task on the same questions the table ranks
    check = claims.check_claims(lb.summary, records=lb.records)
    assert check.settings[0].scopes == ["alpha"]


def test_a_task_in_two_bands_names_the_questions_left_out(records):
    lb = leaderboard.build(records)
    text = lb.pooled_scope(lb.settings[0]).text()
    assert text == "alpha, beta pooled at 128 tokens; not pooled: alpha at 64 tokens, beta at 64 tokens"


def test_own_data_and_a_fixed_task_share_a_band_at_the_budget(records):
    own = _natural(records, "alpha", 128)
    both = pd.concat([own, records[(records["task"] == "beta") & (records["context_tokens"] == 128)]])
    lb = leaderboard.build(both)
    scope = lb.pooled_scope(lb.settings[0])
    assert scope.tasks == ("alpha", "beta") and not scope.left_out
    assert scope.text() == "alpha, beta pooled at 64–128 tokens (one band, up to 128)"


def test_the_eta_of_own_data_is_projected_from_its_band(records, tmp_path):
    """Own documents keep their natural lengths (the fixture's 64 and 128 tokens, under a 256-token budget): a
    job declared at 256 tokens found no timing at that exact length and said "no measured rate"; it is
    projected from the band's records, its own task's first (a fixed-length task in the band is slower)."""
    from kvbench.projection import JobInfo, project
    from kvbench.results import atomic_write_parquet

    own = _natural(records, "alpha", 256).assign(task="own")
    fixed = records[(records["task"] == "beta") & (records["context_tokens"] == 128)].copy()
    fixed = fixed.assign(context_tokens=256, prefill_s=fixed["prefill_s"] * 10)  # a 256-token fixed task
    store = tmp_path / "store"
    atomic_write_parquet(own, store / "own.parquet")
    atomic_write_parquet(fixed, store / "fixed.parquet")
    assert not (own["context_tokens"] == 256).any()
    int8 = next(s for s in own["strategy"].unique() if s.startswith("int8("))
    strategies = [("full", "full"), ("int8", int8)]

    def expected(rows: pd.DataFrame) -> float:
        rest = rows["compress_s"].fillna(0) + rows["query_s"].fillna(0) + \
            rows["decode_ms_per_token"].fillna(0) * rows["decode_steps"].fillna(0) / 1000
        by_label = rest.groupby(rows["strategy"]).median()
        return 5 * (rows["prefill_s"].median() + by_label["full"] + by_label[int8])

    p = project([JobInfo("tiny-llama", "cpu", 256, 5, strategies, task="own")], tmp_path)
    assert p.measured == 1 and p.seconds == pytest.approx(expected(own))
    both = pd.concat([own, fixed])  # a task the store has not measured: the whole band
    p = project([JobInfo("tiny-llama", "cpu", 256, 5, strategies, task="mine")], tmp_path)
    assert p.measured == 1 and p.seconds == pytest.approx(expected(both))
    assert project([JobInfo("tiny-llama", "cpu", 128, 5, strategies, task="own")], tmp_path).measured == 0
