"""Pre-registration as a mechanism (spec v1.2 §2.6): design files, their content hash and git registration, the
refusal of a design newer than the store, the charging of earlier published looks, one family over scopes
(Holm or a gatekeeping graph through the looks), and clusters as connected components of shared works."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvbench import paired, registration, sequential
from kvbench.errors import KVBenchError
from kvbench.sequential import Design

ROOT = Path(__file__).resolve().parents[1]
HEADLINE_DESIGN = ROOT / "conf" / "design" / "headline.yaml"


def _git(cwd: Path, *args: str, date: str | None = None) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
    if date:
        env |= {"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def _design_text(post_hoc: bool, margin: float = 1.0) -> str:
    data = yaml.safe_load(HEADLINE_DESIGN.read_text())
    data["margin_pp"] = margin
    if not post_hoc:
        data.pop("post_hoc")
    return yaml.safe_dump(data)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    return tmp_path


def _store(repo: Path, date: str) -> Path:
    res = repo / "res"
    (res / "store").mkdir(parents=True)
    (res / "store" / "a.parquet").write_bytes(b"x")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "store", date=date)
    return res


def _design(repo: Path, text: str, date: str) -> Path:
    path = repo / "d.yaml"
    path.write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "design", date=date)
    return path


def test_a_design_registered_before_the_first_record_is_accepted(repo):
    path = _design(repo, _design_text(post_hoc=False), "2026-01-01T00:00:00")
    res = _store(repo, "2026-01-02T00:00:00")
    reg = registration.load(path)
    assert reg.commit and not reg.post_hoc and len(reg.sha256) == 64
    design = registration.check(reg, res)
    assert design.charged == () and design.n_looks == 15 and "sha256" in design.registered


def test_a_design_newer_than_the_store_is_refused_unless_declared_post_hoc(repo):
    res = _store(repo, "2026-01-01T00:00:00")
    path = _design(repo, _design_text(post_hoc=False), "2026-01-02T00:00:00")
    with pytest.raises(KVBenchError, match="registered after the store's first record"):
        registration.check(registration.load(path), res)
    path = _design(repo, _design_text(post_hoc=True), "2026-01-03T00:00:00")
    design = registration.check(registration.load(path), res)
    assert design.charged == (4, 34, 58) and design.n_looks == 18 and design.post_hoc


def test_an_uncommitted_or_edited_design_is_not_registered(repo):
    res = _store(repo, "2026-01-02T00:00:00")
    path = _design(repo, _design_text(post_hoc=False), "2026-01-01T00:00:00")
    assert registration.check(registration.load(path), res)  # registered first: fine
    path.write_text(_design_text(post_hoc=False).replace("look_every: 10", "look_every: 20"))
    reg = registration.load(path)
    assert reg.registered is None and not reg.commit
    with pytest.raises(KVBenchError, match="is not committed"):
        registration.check(reg, res)
    # layout and comments do not change the content hash: the registration stands
    path.write_text("# a comment\n" + _design_text(post_hoc=False))
    assert registration.load(path).commit


def test_a_design_must_describe_the_analysis_the_code_runs(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(_design_text(post_hoc=True, margin=2.0))
    with pytest.raises(KVBenchError, match="margin_pp is 2.0 but kvbench judges by 1.0"):
        registration.load(path)
    path.write_text(re.sub(r"multiplicity: \w+", "multiplicity: bonferroni", _design_text(post_hoc=True)))
    with pytest.raises(KVBenchError, match="multiplicity must be holm or gatekeeping"):
        registration.load(path)


def test_charged_looks_make_every_later_boundary_stricter():
    plain, charged = Design(150, 10), Design(150, 10, charged=(4, 34, 58))
    assert charged.looks == (4, 10, 20, 30, 34, 40, 50, 58, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150)
    assert charged.is_charged(1) and not charged.is_charged(2)
    a = 0.025 / 3
    last_plain = sequential.nominal_level(a, plain, plain.n_looks)
    last_charged = sequential.nominal_level(a, charged, charged.n_looks)
    assert last_charged < last_plain
    # as published (the early looks at the fixed-sample level) the error is well above the share; the plain
    # design's error is the share (Monte Carlo, 10^6 paths: ±3 standard errors)
    assert sequential.published_error(a, charged) > 2 * a
    assert sequential.published_error(a, plain) == pytest.approx(a, abs=3 * (a / 1e6) ** 0.5)


def test_gatekeeping_passes_a_pooled_rejection_to_its_own_per_task_hypotheses():
    d = Design(2, 1)
    key = "\t".join
    weights, trans = sequential.gatekeeping_graph(["pooled", "x", "y"], ["a", "b"], lambda sc, s: key((sc, s)))
    assert weights[key(("pooled", "a"))] == 0.5 and weights[key(("x", "a"))] == 0
    tiny = 1e-12
    # look 1: pooled a is rejected at alpha/2; x/a then holds alpha/4 and is rejected at once; x/b stays gated
    ps = [{key(("pooled", "a")): tiny, key(("x", "a")): tiny, key(("x", "b")): tiny, key(("y", "a")): 0.5,
           key(("y", "b")): 0.5, key(("pooled", "b")): 0.5}]
    rejected, shares = sequential.graph_through_looks(ps, 0.025, d, weights, trans)
    assert set(rejected) == {key(("pooled", "a")), key(("x", "a"))}
    assert rejected[key(("x", "a"))][1] == pytest.approx(0.025 / 4)
    assert shares[key(("x", "b"))] == 0 and shares[key(("y", "a"))] == pytest.approx(0.025 / 4 + 0.025 / 4)
    # Holm is the complete graph with equal weights: the same rejections as holm_through_looks
    hyps = sorted(ps[0])
    holm_w = {h: 1 / len(hyps) for h in hyps}
    holm_t = {h: {k: 1 / (len(hyps) - 1) for k in hyps if k != h} for h in hyps}
    assert set(sequential.graph_through_looks(ps, 0.025, d, holm_w, holm_t)[0]) == \
        set(sequential.holm_through_looks(ps, 0.025, d))


def test_clusters_are_connected_components_of_shared_works():
    meta = [{"source_docs": ["w1"]}, {"source_docs": ["w2", "w3"]}, {"source_docs": ["w3", "w1"]},
            {"source_docs": ["w9"]}]
    recs = pd.DataFrame({"task": ["legal"] * 4, "sample_id": list("abcd"),
                         "document_id": ["w1", "w2", "w3", "w9"], "sample_meta": [json.dumps(m) for m in meta]})
    ids = paired.document_ids(recs)
    assert ids.nunique() == 2 and len(set(ids[:3])) == 1  # w1-w3-w2 joined through the third context
    # the same works in another task are another cluster; the label never depends on row order
    assert paired.document_ids(recs.iloc[::-1]).loc[ids.index].tolist() == ids.tolist()
    assert set(paired.document_ids(recs.assign(task="papers"))) != set(ids)


def test_the_committed_design_lists_every_look_published_before_the_first_design():
    # The headline's earlier looks are the claim checks committed before the sweep file first declared looks;
    # each look is its smallest per-task context count (a look is a prefix of every task).
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    first = subprocess.run(["git", "log", "--reverse", "--format=%H", "-S", "look_every", "--",
                            "conf/sweep/headline.yaml"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not first:
        pytest.skip("history without the sweep file's design")
    before = subprocess.run(["git", "log", "--format=%H", f"{first[0]}~1", "--", "results/headline/claim_check.md"],
                            cwd=ROOT, capture_output=True, text=True).stdout.split()
    looks = []
    for commit in before:
        text = subprocess.run(["git", "show", f"{commit}:results/headline/claim_check.md"], cwd=ROOT,
                              capture_output=True, text=True).stdout
        per_task = [int(c) for scope, c in re.findall(r"^\| (\w+) \|[^\n]*?n = \d+ questions / (\d+) contexts", text,
                                                      re.M) if scope in ("fiction", "legal", "papers")]
        looks.append(min(per_task))
    declared = yaml.safe_load(HEADLINE_DESIGN.read_text())["post_hoc"]["earlier_looks"]
    assert sorted(looks) == declared


def test_every_committed_page_of_the_post_hoc_headline_says_exploratory_first():
    # The headline's design was registered after its records: each page that shows its verdicts says so before
    # any verdict, naming the design file by its current content hash.
    sha = registration.content_hash(yaml.safe_load(HEADLINE_DESIGN.read_text()))[:12]
    for page in ("leaderboard.md", "claim_check.md"):
        text = (ROOT / "results" / "headline" / page).read_text()
        first_verdict = min(i for i in (text.find("holds"), text.find("fails"), len(text)) if i >= 0)
        banner = text.find("**Exploratory (post hoc design)**")
        assert 0 <= banner < first_verdict, page
        assert f"`headline.yaml` (sha256 {sha}" in text[banner:first_verdict], page  # code, not escaped backticks
