"""One number everywhere (spec v1.2 §2.6): every interval a claim check prints is the clustered one.

A generated claim check (strongly clustered records, where the clustered and per-question intervals differ) and
both committed ones (``results/claim_check.md``, ``results/headline/claim_check.md``) are read back: every
``Δ pp [95% CI low, high]`` of a strategy against ``full`` must be the clustered paired comparison
(:func:`kvbench.paired.compare`) of that strategy on one of the scopes, and every ``A − B = …`` sentence must name
a clustered method.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from test_claims import _records

from kvbench import paired
from kvbench.leaderboard import build, read_records, render_claim_check
from kvbench.leaderboard.table import at_pooled_length
from kvbench.report import summarize
from kvbench.selection import Filters, paired_records, select_records
from kvbench.vocab import BASELINE

ROOT = Path(__file__).resolve().parents[1]
NUM = r"([+-]\d+\.\d)"
INTERVAL = re.compile(NUM + r" pp \[95% CI " + NUM + ", " + NUM + r"\]")
CONTRAST = re.compile(r"`([^`]+)` − `([^`]+)` = " + NUM + r" pp \[95% CI " + NUM + ", " + NUM + r"\] \(([^;,]+)")
CLUSTERED = ("newcombe-rao-scott", "cluster-bootstrap", "rounded, newcombe-rao-scott")


def _triple(est: float, lo: float, hi: float) -> tuple[str, str, str]:
    return f"{est:+.1f}", f"{lo:+.1f}", f"{hi:+.1f}"


def clustered_intervals(records: pd.DataFrame) -> dict[str, set[tuple[str, str, str]]]:
    """Strategy -> its clustered Δ [interval] against full on every task and pooled scope of every setting."""
    out: dict[str, set] = {}
    for _, recs in records.groupby("setting"):
        scopes = [recs[recs["task"] == t] for t in sorted(recs["task"].unique())] + [at_pooled_length(recs)]
        for part in scopes:
            for s in sorted(set(part["strategy"]) - {BASELINE}):
                c = paired.compare(part, s, BASELINE)
                if c is not None:
                    out.setdefault(s, set()).add(_triple(c.estimate, c.low, c.high))
    return out


def printed(text: str) -> tuple[list[tuple[str, tuple]], list[tuple[str, str, str]]]:
    """(strategy, interval) of every interval against ``full``, and (A, B, method) of every ``A − B`` sentence."""
    against_full, methods = [], []
    for line in text.splitlines():
        for m in CONTRAST.finditer(line):
            methods.append((m.group(1), m.group(2), m.group(6)))
            if m.group(2) == BASELINE:
                against_full.append((m.group(1), m.group(3, 4, 5)))
        rest = CONTRAST.sub("", line)
        for m in INTERVAL.finditer(rest):
            names = re.findall(r"`([^`]+)`", rest[: m.start()])
            if names:  # the nearest strategy named before the interval is the one it belongs to
                against_full.append((names[-1], m.group(1, 2, 3)))
    return against_full, methods


def _check(text: str, records: pd.DataFrame) -> int:
    known = clustered_intervals(records)
    full, methods = printed(text)
    for strategy, triple in full:
        assert triple in known.get(strategy, set()), (strategy, triple, sorted(known.get(strategy, set())))
    for a, b, method in methods:
        assert method.startswith(CLUSTERED), (a, b, method)
    return len(full)


def test_a_generated_claim_check_prints_only_clustered_intervals():
    # 8 works of 12 questions each: int8 loses 6 questions of work 1 and gains 6 of work 2 (Δ 0, within a point,
    # so it is the pick every table cites), all its disagreement in two works: clustering widens its interval
    docs = [f"w{i // 12}" for i in range(96)]
    full = [0 if i // 12 == 2 and i % 12 < 6 else 1 for i in range(96)]
    int8 = [0 if i // 12 == 1 and i % 12 < 6 else 1 for i in range(96)]
    bfp = [0 if i % 24 == 0 else f for i, f in enumerate(full)]
    recs = pd.concat([_records({"full": full, "int8": int8, "bfp": bfp}, task=t, docs=docs)
                      for t in ("legal", "papers")], ignore_index=True)
    text = render_claim_check(build(recs))
    assert _check(text, paired_records(recs)) >= 6
    # the per-question (unclustered) interval of int8 differs from the clustered one, and is printed nowhere
    per_question = summarize(recs[recs["task"] == "legal"])
    row = per_question[per_question["strategy"] == "int8"].iloc[0]
    unclustered = _triple(row["delta_pp"], row["delta_ci_low"], row["delta_ci_high"])
    clustered = paired.compare(recs[recs["task"] == "legal"], "int8", BASELINE)
    assert unclustered != _triple(clustered.estimate, clustered.low, clustered.high)
    assert f"[95% CI {unclustered[1]}, {unclustered[2]}]" not in text


@pytest.mark.parametrize("where", ["results", "results/headline"])
def test_the_committed_claim_checks_print_only_clustered_intervals(where):
    path = ROOT / where / "claim_check.md"
    if not path.is_file() or not (ROOT / where / "store").is_dir():
        pytest.skip(f"no committed {where}")
    text = path.read_text()
    look = re.search(r"\*\*look (\d+) of (\d+)\*\*", text)
    if look and look.group(1) != look.group(2):
        pytest.skip("judged at an earlier look than the records hold")  # the final look holds every record
    records = paired_records(select_records(read_records(ROOT / where),
                                            Filters(model="smollm2-135m", hardware="cpu", spec_version="1.2")))
    assert _check(text, records) >= 10
