"""Integrity: the run store — each (config, sample, strategy) stored once (issue 49, item 3), and the records a
resumed run keeps checked by the leaderboard's rule (issue 53, item 5).

``results/long8k`` held context 004 twice: a second worker, whose pid namespace differed from the first's under
the same host name, took the first's live claim for a dead one's and stored the sample again (``full`` from the
stored baseline, ``int8`` re-timed under contention), and nothing refused it. The writer now refuses a record
it already holds, claims say where their pid can be checked, and every reader — resume, ``kvbench verify``
(whatever the manifest says), the leaderboard's store reader — refuses a file holding a record twice."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pandas as pd
import pytest
import test_integrity as ti

from kvbench import manifest
from kvbench.errors import KVBenchError
from kvbench.results import ActiveWorker, RunStore, SampleClaims, read_store

pytestmark = pytest.mark.usefixtures("single_torch_thread")
kvbench, _base, _run_dir = ti.kvbench, ti._base, ti._run_dir
qa = ti.qa


def _rec(sample: str, strategy: str, **extra) -> dict:
    return {"config_hash": "h", "sample_id": sample, "strategy": strategy, "task": "t", "model": "m", "score": 1.0,
            **extra}


def _keys(store: RunStore) -> list[tuple]:
    lines = store.records_path.read_text().splitlines()
    return [(json.loads(x)["sample_id"], json.loads(x)["strategy"]) for x in lines]


# ------------------------------------------------------------------------------------------------- the writer


def test_the_writer_refuses_a_record_it_already_holds(tmp_path, capsys):
    store = RunStore(tmp_path, "run")
    assert len(store.append([_rec("s0", "full"), _rec("s0", "int8")])) == 2
    written = store.append([_rec("s0", "full", score=0.0), _rec("s0", "int8"), _rec("s1", "full")])
    assert [r["sample_id"] for r in written] == ["s1"]
    assert _keys(store) == [("s0", "full"), ("s0", "int8"), ("s1", "full")]
    assert [r["score"] for r in store.load_records()] == [1.0, 1.0, 1.0]  # the first measurement stands
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 record(s) already stored" in err[0] and "'s0'" in err[0]


def test_the_writer_refuses_a_record_twice_in_one_unit(tmp_path, capsys):
    store = RunStore(tmp_path, "run")
    store.append([_rec("s0", "full"), _rec("s0", "full", score=0.0)])
    assert _keys(store) == [("s0", "full")]
    assert "already stored" in capsys.readouterr().err


def test_the_writer_sees_what_another_writer_appended(tmp_path, capsys):
    """Two workers hold two RunStore objects of one run: each one's cache of stored keys follows the file."""
    a, b = RunStore(tmp_path, "run"), RunStore(tmp_path, "run")
    a.append([_rec("s0", "full")])
    b.append([_rec("s1", "full")])
    a.append([_rec("s1", "full"), _rec("s2", "full")])
    b.append([_rec("s0", "full")])
    assert _keys(a) == [("s0", "full"), ("s1", "full"), ("s2", "full")]


def test_two_workers_that_both_computed_a_sample_store_it_once(tmp_path, capsys):
    """The long8k case: worker b took worker a's claim for a dead one's and computed the sample too."""
    store = RunStore(tmp_path, "run")
    with ActiveWorker(tmp_path) as worker:
        a, b = SampleClaims(store, {"full", "int8"}, worker), SampleClaims(store, {"full", "int8"}, worker)
        assert "s0" not in a
        claim = a._path("s0")
        claim.unlink()  # as if b had judged a's claim dead and taken it over
        assert "s0" not in b
        a.write([_rec("s0", "full"), _rec("s0", "int8")])
        b.write([_rec("s0", "full", prefill_s=9.0), _rec("s0", "int8", prefill_s=9.0)])
    assert _keys(store) == [("s0", "full"), ("s0", "int8")]
    assert all("prefill_s" not in r for r in store.load_records())
    assert not list((store.dir / ".claims").iterdir())


def test_a_claim_from_another_pid_namespace_is_not_taken_for_a_dead_one(tmp_path):
    """Same host name, another container: its pid cannot be checked from here, so its claim is not taken over
    (it looked dead: the cause of long8k's duplicate)."""
    store = RunStore(tmp_path, "run")
    path = SampleClaims(store, {"full"})._path("s0")
    path.parent.mkdir(parents=True)
    dead_here = 2 ** 22 + 12345  # above pid_max's default: no process of this namespace has it
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_here, "pid_scope": "other-boot/pid:[1]",
                                "started": 0}))
    os.utime(path)
    claims = SampleClaims(store, {"full"})
    assert "s0" in claims and "s0" in claims.elsewhere  # held elsewhere: not computed here
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_here, "started": 0}))
    assert "s0" not in SampleClaims(store, {"full"})  # an owner of this namespace (or an older file): pid checked


# ------------------------------------------------------------------------------------------------- the readers


def _duplicated_line(records: Path) -> None:
    first = records.read_text().splitlines()[0]
    with records.open("a") as fh:
        fh.write(first + "\n")


def test_resume_refuses_a_records_file_holding_a_record_twice(capsys, tmp_path, qa):
    results = tmp_path / "results"
    args = _base(results, qa)
    code, err, out = kvbench(capsys, *args)
    assert code == 0, err
    records = _run_dir(out) / "records.jsonl"
    _duplicated_line(records)
    before = records.read_bytes()
    code, err, _ = kvbench(capsys, *args)
    assert code == 2 and len(err) == 1, err
    assert "records.jsonl holds sample" in err[0] and "twice (lines 1 and 5" in err[0]
    assert records.read_bytes() == before


def test_load_records_names_the_file_the_record_and_both_lines(tmp_path):
    store = RunStore(tmp_path, "run")
    store.append([_rec("s0", "full"), _rec("s1", "full")])
    _duplicated_line(store.records_path)
    with pytest.raises(KVBenchError, match=r"holds sample 's0', strategy 'full' \(config h\) twice \(lines 1 and 3; "
                                           r"1 duplicated record"):
        store.load_records()


@pytest.fixture
def results(tmp_path, store_dir) -> Path:
    out = tmp_path / "results"
    shutil.copytree(store_dir, out)
    manifest.write_manifest(out)
    return out


def _verify(capsys, root: Path) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = manifest.main(["--results-dir", str(root)])
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_verify_flags_a_duplicated_line_even_under_a_rewritten_manifest(capsys, results):
    assert _verify(capsys, results)[0] == 0
    records = sorted((results / "runs").glob("*/records.jsonl"))[0]
    _duplicated_line(records)
    manifest.write_manifest(results)  # the duplicate hashed into the manifest: the hashes all match
    code, err = _verify(capsys, results)
    assert code == 2 and len(err) == 1, err
    assert records.parent.name in err[0] and "twice (lines 1 and" in err[0]


def test_verify_flags_a_store_file_holding_a_row_twice(capsys, results):
    real = sorted((results / "store").glob("*.parquet"))[0]
    df = pd.read_parquet(real)
    pd.concat([df, df.iloc[[0]]]).to_parquet(real, index=False)
    manifest.write_manifest(results)
    code, err = _verify(capsys, results)
    assert code == 2 and len(err) == 1, err
    assert real.name in err[0] and f"twice (rows 1 and {len(df) + 1}; 1 duplicated" in err[0]


def _leaderboard(capsys, *args: str) -> tuple[int, list[str]]:
    from kvbench import leaderboard

    capsys.readouterr()
    code = leaderboard.main(list(args))
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_the_leaderboard_refuses_a_store_file_holding_a_row_twice(capsys, tmp_path, results):
    real = sorted((results / "store").glob("*.parquet"))[0]
    df = pd.read_parquet(real)
    pd.concat([df, df.iloc[[0]].assign(score=1.0)]).to_parquet(real, index=False)
    manifest.write_manifest(results)  # sealed after the duplicate: the hashes match
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 2 and len(err) == 1, err
    assert real.name in err[0] and "twice" in err[0]
    with pytest.raises(KVBenchError, match="twice"):
        read_store(results)


def test_the_leaderboard_refuses_an_unpublished_run_holding_a_record_twice(capsys, tmp_path, results):
    records = sorted((results / "runs").glob("*/records.jsonl"))[0]
    _duplicated_line(records)  # more lines than the published store: read as an unpublished run
    manifest.write_manifest(results)
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 2 and len(err) == 1, err
    assert "records.jsonl holds sample" in err[0] and "twice" in err[0]


# ------------------------------------------------------------------------------- resume checks what it keeps


def _edit_first(records: Path, **changes) -> None:
    lines = records.read_text().splitlines()
    first = json.loads(lines[0])
    first.update(changes)
    records.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


@pytest.mark.parametrize("changes, field", [
    ({"score": float("nan")}, "'score' is nan"),  # today: a traceback on resume
    ({"kv_bytes": -5}, "'kv_bytes' is -5"),  # today: published into the parquet store
    ({"sample_meta": [1, 2]}, "'sample_meta'"),
    ({"score": "1.0"}, "'score' is '1.0'"),
])
def test_resume_refuses_a_record_the_leaderboard_would_refuse(capsys, tmp_path, qa, changes, field):
    results = tmp_path / "results"
    args = _base(results, qa, "engine.max_new_samples=1")
    code, err, out = kvbench(capsys, *args)
    assert code == 0, err
    run = _run_dir(out)
    _edit_first(run / "records.jsonl", **changes)
    store = results / "store" / f"{run.name}.parquet"
    before = store.read_bytes()
    code, err, _ = kvbench(capsys, *_base(results, qa))
    assert code == 2 and len(err) == 1, err
    assert "records.jsonl" in err[0] and field.split()[0].strip("'") in err[0]
    assert store.read_bytes() == before  # nothing published from it
    assert len((run / "records.jsonl").read_text().splitlines()) == 2  # nor anything computed on top of it
