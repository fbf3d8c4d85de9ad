"""Integrity, fourth pass (issue 53): the command line and task data — one line and exit 2, never a traceback.

``~seed`` and ``~results_dir`` ended in omegaconf tracebacks; a JSONL ``"answers": 4400`` or ``"answer": 4417`` in
a TypeError (also in a sweep, before any job started); ``"answers": {"a": 1}`` was accepted and scored against
``["a"]``; an unparseable override echoed its ESC/BEL bytes to the terminal; ``kvbench leaderboard --out-dir
/etc/x`` wrote into ``/etc`` although ``results_dir=/etc/...`` is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_integrity as ti
import yaml

pytestmark = pytest.mark.usefixtures("single_torch_thread")
kvbench, _base, _run_dir, _records, _files = ti.kvbench, ti._base, ti._run_dir, ti._records, ti._files
qa = ti.qa

CONTEXT = "The account number is 4400 and the branch code is 4417. " * 4


# ------------------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize("deletion, expected", [
    ("~seed", "seed cannot be deleted, every job reads it; set it instead, seed=<value> (default seed=0)"),
    ("~results_dir", "results_dir cannot be deleted"),
    ("~engine.batch_size", "engine.batch_size cannot be deleted"),
    ("~strategy", "every job needs a strategy; choose one instead, strategy=<name> (valid: "),
    ("~task", "every job needs a task"),
])
def test_deleting_a_key_every_job_reads_is_one_line(capsys, tmp_path, qa, monkeypatch, deletion, expected):
    monkeypatch.chdir(tmp_path)
    code, err, _ = kvbench(capsys, *_base(tmp_path / "results", qa), deletion)  # today: omegaconf traceback
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert _files(tmp_path) == {"qa.jsonl"}


def test_an_unparseable_override_is_printed_without_its_escapes(capsys, tmp_path, qa):
    code, err, _ = kvbench(capsys, *_base(tmp_path / "results", qa), "strategy=int8\x1b]0;PWNED\x07")
    assert code == 2 and len(err) == 1, err
    assert "\x1b" not in err[0] and "\x07" not in err[0] and "]0;PWNED" in err[0]


def test_a_multirun_job_error_is_printed_without_escapes(capsys, tmp_path, qa):
    code, err, _ = kvbench(capsys, "-m", *_base(tmp_path / "results", qa), "task.instruction=a\x1b[2Jb,c",
                           "task.n_samples=0")
    assert code == 2 and err, err
    assert not any("\x1b" in ln for ln in err)


# ------------------------------------------------------------------------------------------- task data


def _jsonl(tmp_path: Path, **answer) -> Path:
    path = tmp_path / "numbers.jsonl"
    path.write_text(json.dumps({"id": "n1", "context": CONTEXT, "input": "What is the account number?", **answer})
                    + "\n")
    return path


def _run(capsys, tmp_path: Path, data: Path, *extra: str) -> tuple[int, list[str], str]:
    args = [a for a in _base(tmp_path / "results", None, *extra) if not a.startswith("task.n_samples")]
    return kvbench(capsys, *args, "task=jsonl", f"task.path={data}", "task.n_samples=1")


@pytest.mark.parametrize("answer, expected", [
    ({"answers": 4400}, ["4400"]),  # today: TypeError: 'int' object is not iterable
    ({"answer": 4417}, ["4417"]),
    ({"answers": [4400, "four thousand four hundred", None]}, ["4400", "four thousand four hundred"]),
    ({"answer": 44.5}, ["44.5"]),
])
def test_numeric_answers_are_their_evident_strings(capsys, tmp_path, answer, expected):
    code, err, out = _run(capsys, tmp_path, _jsonl(tmp_path, **answer))
    assert code == 0, err
    assert {tuple(r["answers"]) for r in _records(_run_dir(out))} == {tuple(expected)}


@pytest.mark.parametrize("answer, expected", [
    ({"answers": {"a": 1}}, "the answers are a mapping ({'a': 1}), which names no answer"),  # today: scored vs ['a']
    ({"answers": [True]}, "an answer is bool (True)"),
    ({"answers": [["4400"]]}, "an answer is list (['4400'])"),
    ({"answers": [{"text": "4400"}]}, "an answer is a mapping"),
])
def test_answers_with_no_evident_string_are_one_line(capsys, tmp_path, answer, expected):
    code, err, _ = _run(capsys, tmp_path, _jsonl(tmp_path, **answer))
    assert code == 2 and len(err) == 1, err
    assert "row 0 of the jsonl task" in err[0] and expected in err[0]
    assert not (tmp_path / "results").exists()


def _sweep(tmp_path: Path, overrides: list[str]) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"overrides": overrides, "blocks": {"a": {"seed": "0,1"}}}))
    return path


@pytest.mark.parametrize("answer, extra, expected", [
    ({"answers": 4400}, [], None),  # today: TypeError before any job starts
    ({"answers": {"a": 1}}, [], "the answers are a mapping"),
    ({"answers": 4400}, ["~results_dir"], "results_dir cannot be deleted"),
])
def test_a_sweep_checks_every_job_before_any_starts(capsys, tmp_path, answer, extra, expected):
    from kvbench import sweep

    data = _jsonl(tmp_path, **answer)
    overrides = [a for a in _base(tmp_path / "results", None) if not a.startswith(("task.n_samples", "results_dir"))]
    path = _sweep(tmp_path, [*overrides, "task=jsonl", f"task.path={data}", "task.n_samples=1", *extra])
    capsys.readouterr()
    code = sweep.main([str(path), "--results-dir", str(tmp_path / "results"), "--dry-run"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    if expected is None:
        assert code == 0 and err == [], err
    else:
        assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "results").exists()


# ------------------------------------------------------------------------------------------- output paths


@pytest.mark.parametrize("value, expected", [
    ("/etc/kvbench-x", "--out-dir='/etc/kvbench-x' is inside the system directory /etc"),  # today: written as root
    ("/proc/self/x", "inside the system directory /proc"),
    ("", "--out-dir is empty"),
])
def test_leaderboard_out_dir_is_held_to_the_results_dir_rules(capsys, tmp_path, store_dir, value, expected):
    from kvbench import leaderboard

    capsys.readouterr()
    code = leaderboard.main(["--results-dir", str(store_dir), "--out-dir", value])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not Path("/etc/kvbench-x").exists()
