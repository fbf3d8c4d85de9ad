"""Integrity, fourth pass (issue 53): the results tree — hidden and linked forgeries.

A forged store file that is hidden (``store/.forged.parquet``) or a symbolic link (in ``store/``, or in place of
``runs/<id>/records.jsonl``) was read by the leaderboard but skipped by the manifest: ``kvbench verify`` said the
files matched and ``kvbench leaderboard --strict`` ranked the forgery first. One list of the tree's files
(:func:`kvbench.results.tree.results_files`) now serves the manifest, verify and every reader, and refuses such
an entry, named, in one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvbench import manifest
from kvbench.errors import KVBenchError
from kvbench.results import read_store, results_files


@pytest.fixture
def results(tmp_path, store_dir) -> Path:
    out = tmp_path / "results"
    shutil.copytree(store_dir, out)
    manifest.write_manifest(out)
    return out


def _main(capsys, mod, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = mod.main(list(args))
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _forged(results: Path) -> pd.DataFrame:
    """The first store file's int8 rows with every score set to 1 (the forgery that ranked first)."""
    real = sorted((results / "store").glob("*.parquet"))[0]
    rows = pd.read_parquet(real)
    return rows[rows["strategy"] != "full"].assign(score=1.0)


def _hidden_store_file(results: Path, tmp_path: Path) -> str:
    _forged(results).to_parquet(results / "store" / ".forged.parquet", index=False)
    return "store/.forged.parquet (a hidden file)"


def _linked_store_file(results: Path, tmp_path: Path) -> str:
    target = tmp_path / "elsewhere.parquet"
    _forged(results).to_parquet(target, index=False)
    (results / "store" / "zz-linked.parquet").symlink_to(target)
    return "store/zz-linked.parquet (a symbolic link)"


def _linked_records(results: Path, tmp_path: Path) -> str:
    records = sorted((results / "runs").glob("*/records.jsonl"))[0]
    target = tmp_path / "records.jsonl"
    target.write_bytes(records.read_bytes())
    records.unlink()
    records.symlink_to(target)
    return f"runs/{records.parent.name}/records.jsonl (a symbolic link)"


def _hidden_run(results: Path, tmp_path: Path) -> str:
    run = sorted((results / "runs").iterdir())[0]
    shutil.copytree(run, results / "runs" / ".shadow")
    return "runs/.shadow (a hidden directory)"


def _linked_run_dir(results: Path, tmp_path: Path) -> str:
    run = sorted((results / "runs").iterdir())[0]
    shutil.copytree(run, tmp_path / "other-run")
    (results / "runs" / "zz-linked-run").symlink_to(tmp_path / "other-run", target_is_directory=True)
    return "runs/zz-linked-run (a symbolic link)"


def _fifo_in_store(results: Path, tmp_path: Path) -> str:
    os.mkfifo(results / "store" / "zz-pipe.parquet")
    return "store/zz-pipe.parquet (not a regular file)"


FORGERIES = [_hidden_store_file, _linked_store_file, _linked_records, _hidden_run, _linked_run_dir, _fifo_in_store]


@pytest.mark.parametrize("forge", FORGERIES, ids=lambda f: f.__name__.strip("_"))
def test_verify_refuses_a_hidden_or_linked_entry_naming_it(capsys, tmp_path, results, forge):
    named = forge(results, tmp_path)
    code, err = _main(capsys, manifest, "--results-dir", str(results))  # today: "36 file(s) match"
    assert code == 2 and len(err) == 1, err
    assert named in err[0] and "no kvbench writer makes" in err[0]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
@pytest.mark.parametrize("forge", FORGERIES, ids=lambda f: f.__name__.strip("_"))
def test_the_leaderboard_refuses_a_hidden_or_linked_entry(capsys, tmp_path, results, forge, strict):
    from kvbench import leaderboard

    named = forge(results, tmp_path)
    out = tmp_path / "lb"
    code, err = _main(capsys, leaderboard, "--results-dir", str(results), "--out-dir", str(out),
                      *(["--strict"] if strict else []))  # today: the forgery ranked first, exit 0
    assert code == 2 and len(err) == 1, err
    assert named in err[0]
    assert not out.exists()


def test_the_manifest_is_never_written_over_a_hidden_file(capsys, tmp_path, results):
    before = (results / manifest.MANIFEST).read_bytes()
    named = _hidden_store_file(results, tmp_path)
    code, err = _main(capsys, manifest, "--results-dir", str(results), "--write")
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert (results / manifest.MANIFEST).read_bytes() == before


def test_every_reader_reads_the_files_the_manifest_lists(tmp_path, results):
    listed = set(manifest.read_manifest(results))
    assert set(results_files(results)) == listed
    df = read_store(results)
    assert set(df["source_file"]) <= listed


def test_what_kvbench_itself_leaves_hidden_is_neither_listed_nor_refused(capsys, results):
    run = sorted((results / "runs").iterdir())[0]
    (run / ".lock").write_text("")
    (run / ".claims").mkdir()
    (run / ".claims" / "s0-abc.claim").write_text("{}")
    (run / ".records.jsonl.k2j3.tmp").write_text("{")  # an atomic write in flight, or left by a kill
    (results / "store" / ".kvbench-write-probe.x1.tmp").write_text("")
    (results / ".workers").mkdir()
    code, err = _main(capsys, manifest, "--results-dir", str(results))
    assert code == 0 and err == [], err


def test_a_results_dir_that_is_itself_a_link_is_read(capsys, tmp_path, results):
    """Only entries inside runs/, store/ and baselines/ are held to the rule: a results_dir on another disk,
    reached through a link, is the user's choice."""
    link = tmp_path / "linked-results"
    link.symlink_to(results, target_is_directory=True)
    assert _main(capsys, manifest, "--results-dir", str(link))[0] == 0
    assert len(read_store(link)) == len(read_store(results))


def test_resume_refuses_a_linked_records_file(tmp_path, results):
    from kvbench.results import RunStore

    _linked_records(results, tmp_path)
    run = sorted((results / "runs").iterdir())[0]
    with pytest.raises(KVBenchError, match="is a symbolic link"):
        RunStore(results, run.name).load_records()
