"""Integrity, fourth pass (issue 53): publishing never seals a forged file.

``scripts/publish_results.sh`` ran ``kvbench verify --write`` before ``leaderboard --strict``, so a forged file
lying in ``results/`` was hashed into the manifest and became the README's answer line. It now seals a tree only
when every file is in the committed manifest or vouched for by the run that wrote it; these tests run the script
itself on a copy of a real (tiny) store, and the seal (``kvbench verify --write --against``) on the cases."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench import manifest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path, store_dir) -> Path:
    """A checkout in miniature: the publish script and a published results/ tree (manifest written)."""
    out = tmp_path / "repo"
    (out / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "publish_results.sh", out / "scripts")
    shutil.copytree(store_dir, out / "results", ignore=shutil.ignore_patterns("*.md", ".*"))
    manifest.write_manifest(out / "results")
    return out


def _publish(repo: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "KVBENCH_FUSED": "0"}
    return subprocess.run(["bash", "scripts/publish_results.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def _forge_store_file(results: Path) -> str:
    real = sorted((results / "store").glob("*.parquet"))[0]
    rows = pd.read_parquet(real)
    rows = rows[rows["strategy"] != "full"].assign(score=1.0, config_hash="f0f0f0f0f0f0",
                                                   run_id="alpha-tiny-llama-f0f0f0f0f0f0")
    rows.to_parquet(results / "store" / "zz-forged.parquet", index=False)
    return "store/zz-forged.parquet (no run of this tree wrote it)"


def _stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


def test_publish_refuses_a_tree_with_a_forged_file(repo):
    results = repo / "results"
    before = (results / manifest.MANIFEST).read_bytes()
    named = _forge_store_file(results)
    proc = _publish(repo)  # today: the forgery hashed into the manifest, then ranked
    assert proc.returncode == 2, proc.stderr
    err = _stderr_lines(proc)
    assert len(err) == 1 and named in err[0] and "refusing to seal" in err[0], err
    assert (results / manifest.MANIFEST).read_bytes() == before
    assert not (results / "leaderboard.md").exists()


def test_publish_checks_the_committed_manifest_not_a_rewritten_one(repo):
    """A forger who also rewrote the working tree's manifest: the script reads git HEAD's."""
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "published")
    results = repo / "results"
    named = _forge_store_file(results)
    manifest.write_manifest(results)  # the forgery listed in the working copy's manifest
    proc = _publish(repo)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_publish_refuses_a_hidden_forgery(repo):
    results = repo / "results"
    real = sorted((results / "store").glob("*.parquet"))[0]
    shutil.copy(real, results / "store" / ".forged.parquet")
    proc = _publish(repo)
    assert proc.returncode == 2 and "store/.forged.parquet (a hidden file)" in proc.stderr, proc.stderr


def _seal(capsys, results: Path, against: Path | None, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    args = ["--results-dir", str(results), "--write", *(["--against", str(against)] if against else []), *extra]
    code = manifest.main(args)
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_a_store_file_edited_after_its_run_is_refused(capsys, repo):
    results = repo / "results"
    real = sorted((results / "store").glob("*.parquet"))[0]
    pd.read_parquet(real).assign(score=1.0).to_parquet(real, index=False)
    code, err = _seal(capsys, results, None)
    assert code == 2 and len(err) == 1, err
    assert f"store/{real.name} (score of sample" in err[0] and f"differs from runs/{real.stem}" in err[0]


def test_records_of_another_run_under_a_run_id_are_refused(capsys, repo):
    results = repo / "results"
    runs = sorted((results / "runs").iterdir())
    other = (runs[1] / "records.jsonl").read_text().splitlines()[0]
    with (runs[0] / "records.jsonl").open("a") as fh:
        fh.write(other + "\n")
    code, err = _seal(capsys, results, None)
    assert code == 2 and len(err) == 1, err
    assert f"runs/{runs[0].name}/records.jsonl (its run's records.jsonl holds a record of run" in err[0]


def test_a_new_round_and_a_new_run_are_vouched_for_by_their_runs(capsys, tmp_path, repo):
    """What a sweep adds between two publishes — grown records, a rewritten store file, a whole new run — is
    sealed: the committed manifest predates them, their runs vouch for them."""
    results = repo / "results"
    run = sorted((results / "runs").iterdir())[-1]
    aside = tmp_path / "aside"
    aside.mkdir()
    shutil.move(run, aside / run.name)
    shutil.move(results / "store" / f"{run.name}.parquet", aside / f"{run.name}.parquet")
    records = sorted((results / "runs").iterdir())[0] / "records.jsonl"
    full = records.read_bytes()
    records.write_bytes(b"".join(full.splitlines(keepends=True)[:2]))  # the first round only
    committed = manifest.write_manifest(results)
    saved = tmp_path / "committed.sha256"
    shutil.copy(committed, saved)
    records.write_bytes(full)  # the next rounds
    shutil.move(aside / run.name, run)
    shutil.move(aside / f"{run.name}.parquet", results / "store" / f"{run.name}.parquet")
    code, err = _seal(capsys, results, saved)
    assert code == 0 and err == [], err
    assert manifest.verify(results).ok


def test_a_tree_never_published_is_sealed_when_its_runs_vouch_for_every_file(capsys, tmp_path, repo):
    results = repo / "results"
    (results / manifest.MANIFEST).unlink()
    empty = tmp_path / "empty.sha256"
    empty.write_text("")
    assert _seal(capsys, results, empty) == (0, [])
    named = _forge_store_file(results)
    code, err = _seal(capsys, results, empty)
    assert code == 2 and named in err[0]
    code, err = _seal(capsys, results, empty, "--accept", "store/zz-forged.parquet")  # the user's own import
    assert code == 0, err


def test_a_file_kvbench_never_writes_is_refused(capsys, repo):
    results = repo / "results"
    run = sorted((results / "runs").iterdir())[0]
    (run / "notes.json").write_text(json.dumps({"score": 1.0}))
    code, err = _seal(capsys, results, None)
    assert code == 2 and f"runs/{run.name}/notes.json (kvbench never writes such a file)" in err[0], err
