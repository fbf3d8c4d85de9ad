"""Integrity, fourth pass (issue 53): claims and worker files of owners that cannot be checked from here.

A claim or worker file written on another host (a new container) was never taken over: one sample was never
computed while the run exited 0 saying "rerun to include them", and a worker file marked every later record
``timing_contended=true``. Files a live worker keeps fresh (a heartbeat) now expire when nobody refreshed them
for ``OWNER_EXPIRY_SECONDS``, in one line naming the host, and a run that leaves samples undone exits non-zero."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import test_integrity as ti
from test_integrity_cache import _within

from kvbench.results import ActiveWorker, RunStore, SampleClaims
from kvbench.results import claims as claims_mod

pytestmark = pytest.mark.usefixtures("single_torch_thread")
kvbench, _base, _run_dir = ti.kvbench, ti._base, ti._run_dir
qa = ti.qa

ELSEWHERE = "other-container"


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(claims_mod, "_EXPIRED_NOTED", set())


def _foreign(path: Path, age: float, host: str = ELSEWHERE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": os.getpid(), "pid_scope": "elsewhere", "started": 0}))
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_a_claim_from_another_host_is_held_while_fresh_and_taken_over_once_stale(tmp_path, capsys):
    store = RunStore(tmp_path, "run")
    path = _foreign(SampleClaims(store, {"full"})._path("s0"), age=60)
    fresh = SampleClaims(store, {"full"})
    assert "s0" in fresh and fresh.held_by["s0"] == f"host {ELSEWHERE!r} (pid {os.getpid()})"
    _foreign(path, age=claims_mod.OWNER_EXPIRY_SECONDS + 60)
    assert "s0" not in SampleClaims(store, {"full"})  # today: held for ever
    assert json.loads(path.read_text())["host"] == socket.gethostname()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and f"host {ELSEWHERE!r}" in err[0] and "not refreshed for 11 min" in err[0], err


def _one_record_as_a_worker(tmp_path):
    """The record a worker writes for s0, with whatever worker files lie in the store."""
    store = RunStore(tmp_path, "run")
    with ActiveWorker(tmp_path) as worker:
        claims = SampleClaims(store, {"full"}, worker)
        assert "s0" not in claims
        claims.write([{"config_hash": "h", "sample_id": "s0", "strategy": "full", "score": 1.0}])
    (rec,) = store.load_records()
    return rec


def test_a_worker_file_from_another_host_expires_and_stops_marking_timings(tmp_path, capsys):
    rival = _foreign(tmp_path / ".workers" / "rival.json", age=claims_mod.OWNER_EXPIRY_SECONDS + 60)
    rec = _one_record_as_a_worker(tmp_path)
    assert rec["timing_contended"] is False and not rival.exists()  # today: true for every later record
    assert f"host {ELSEWHERE!r}" in capsys.readouterr().err


def test_a_worker_file_of_a_dead_pid_here_is_removed_and_marks_nothing(tmp_path):
    dead = tmp_path / ".workers" / "dead.json"
    dead.parent.mkdir()
    dead.write_text(json.dumps({"host": socket.gethostname(), "pid": 2 ** 22 + 12345, "started": 0}))
    rec = _one_record_as_a_worker(tmp_path)
    assert rec["timing_contended"] is False and not dead.exists()


def test_a_fifo_in_place_of_a_claim_or_worker_file_hangs_nobody(tmp_path):
    """Read as a file, a FIFO would block every worker that looks at it; it is an owner nobody can read: held
    for a minute (perhaps being written), then taken over, and never counted as a competing worker."""
    store = RunStore(tmp_path, "run")
    claim = SampleClaims(store, {"full"})._path("s0")
    claim.parent.mkdir(parents=True)
    os.mkfifo(claim)
    (tmp_path / ".workers").mkdir()
    os.mkfifo(tmp_path / ".workers" / "pipe.json")
    assert _within(10, lambda: "s0" in SampleClaims(store, {"full"}))  # today: blocks for ever
    old = time.time() - 120
    os.utime(claim, (old, old))
    with ActiveWorker(tmp_path) as worker:
        claims = SampleClaims(store, {"full"}, worker)
        assert _within(10, lambda: "s0" not in claims)
        assert _within(10, worker.others) == 0
    assert json.loads(claim.read_text())["pid"] == os.getpid()


def test_a_fresh_worker_file_from_another_host_still_counts(tmp_path):
    _foreign(tmp_path / ".workers" / "rival.json", age=5)
    with ActiveWorker(tmp_path) as worker:
        assert worker.others() == 1


def test_a_live_worker_keeps_its_file_and_claims_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(claims_mod, "HEARTBEAT_SECONDS", 0.05)
    store = RunStore(tmp_path, "run")
    with ActiveWorker(tmp_path) as worker:
        claims = SampleClaims(store, {"full"}, worker)
        assert "s0" not in claims
        old = time.time() - 3600
        for p in (worker.path, claims._path("s0")):
            os.utime(p, (old, old))
        time.sleep(0.5)
        assert all(time.time() - p.stat().st_mtime < 5 for p in (worker.path, claims._path("s0")))
        claims.release()
        assert not worker.fresh
    assert not worker.path.exists()


def test_two_containers_under_one_host_name_get_two_worker_files(tmp_path, monkeypatch):
    a = ActiveWorker(tmp_path).path
    monkeypatch.setattr(claims_mod, "_pid_scope", lambda: "another-boot/pid:[7]")
    assert ActiveWorker(tmp_path).path != a


def _second_sample_claimed_elsewhere(capsys, tmp_path: Path, qa: Path, age: float) -> tuple[list[str], Path]:
    """A finished two-sample run, its second sample's records removed and a claim on it from another host."""
    args = _base(tmp_path / "results", qa)
    code, err, out = kvbench(capsys, *args)
    assert code == 0, err
    run = _run_dir(out)
    lines = (run / "records.jsonl").read_text().splitlines(keepends=True)
    (run / "records.jsonl").write_text("".join(ln for ln in lines if json.loads(ln)["sample_id"] != "jsonl/q2"))
    _foreign(SampleClaims(RunStore(run.parent.parent, run.name), set())._path("jsonl/q2"), age=age)
    return args, run


def test_a_run_that_leaves_samples_undone_exits_non_zero_naming_the_host(capsys, tmp_path, qa):
    args, run = _second_sample_claimed_elsewhere(capsys, tmp_path, qa, age=30)
    code, err, out = kvbench(capsys, *args)  # today: exit 0, "rerun to include them"
    assert code == 2 and len(err) == 1, err
    assert "1 sample(s) left undone" in err[0] and f"host {ELSEWHERE!r}" in err[0]
    assert f"results: {run}" in out  # what finished is stored and shown


def test_a_stale_claim_from_another_host_is_computed_with_one_line(capsys, tmp_path, qa):
    args, run = _second_sample_claimed_elsewhere(capsys, tmp_path, qa, age=claims_mod.OWNER_EXPIRY_SECONDS + 60)
    code, err, _ = kvbench(capsys, *args)
    assert code == 0, err
    assert len(err) == 1 and f"host {ELSEWHERE!r}" in err[0], err
    ids = {json.loads(x)["sample_id"] for x in (run / "records.jsonl").read_text().splitlines()}
    assert ids == {"jsonl/q1", "jsonl/q2"}
