"""Integrity, third pass (issue 44): two runs of one strategy never silently replace each other, a published
store is verifiable (``MANIFEST.sha256``, ``kvbench verify``), values are checked on read, every path stays
where it was told, and every hostile input ends in one line with exit status 2. Each case of the issue's
matrix is one test; runs go through the real CLI in-process on the tiny random Llama (helpers from
``test_integrity``)."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
from pathlib import Path

import pandas as pd
import pytest
import test_integrity as ti
import yaml

from kvbench import identity, manifest, models
from kvbench.results import read_store

pytestmark = pytest.mark.usefixtures("single_torch_thread")
kvbench, _base, _run_dir, _records, _files = ti.kvbench, ti._base, ti._run_dir, ti._records, ti._files
qa, checkpoint, read_only = ti.qa, ti.checkpoint, ti.read_only  # fixtures shared with the first passes


def _leaderboard(capsys, *args: str) -> tuple[int, list[str]]:
    from kvbench import leaderboard

    capsys.readouterr()
    code = leaderboard.main(list(args))
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


# ------------------------------------------------------------- one measurement per (model, task, sample, strategy)


def _second_run(results: Path, store_dir: Path, edit, name: str = "zz-forged.parquet") -> tuple[Path, Path]:
    """``store_dir`` copied to ``results`` plus a file of its first run's non-full records under a new run id and
    config hash (a copied parquet, or another run of the same strategies), ``edit`` applied."""
    if not results.exists():
        shutil.copytree(store_dir, results)
    real = sorted((results / "store").glob("*.parquet"))[0]
    rows = pd.read_parquet(real)
    rows = rows[rows["strategy"] != "full"].assign(config_hash="f0f0f0f0f0f0", run_id="alpha-tiny-llama-f0f0f0f0f0f0")
    forged = results / "store" / name
    edit(rows).to_parquet(forged, index=False)
    return real, forged


@pytest.mark.parametrize("edit", [
    lambda df: df.assign(score=1.0),  # int8 forged to +100 pp
    lambda df: pd.concat([df, df]).assign(score=1.0),  # the forged rows twice in their file
], ids=["scores-set-to-1", "rows-duplicated"])
def test_a_second_run_with_other_scores_is_refused_naming_both_files(capsys, tmp_path, store_dir, edit):
    results = tmp_path / "results"
    real, forged = _second_run(results, store_dir, edit)
    before = _files(results)
    code, err = _leaderboard(capsys, "--results-dir", str(results))  # today: 0, the last file's rows win
    assert code == 2 and len(err) == 1, err
    if len(pd.read_parquet(forged)) > len(pd.read_parquet(forged).drop_duplicates(["sample_id", "strategy"])):
        # a file holding a record twice is refused before any pairing (issue 49: one run stores each once)
        assert "store/zz-forged.parquet holds sample" in err[0] and "twice (rows 1 and" in err[0]
    else:
        assert f"store/{real.name}" in err[0] and "store/zz-forged.parquet" in err[0] and "score" in err[0]
        assert "nothing recorded tells the runs apart" in err[0]
    assert _files(results) == before


def test_two_runs_under_different_engine_settings_are_refused_naming_the_setting(capsys, tmp_path, store_dir):
    results = tmp_path / "results"
    _second_run(results, store_dir, lambda df: df.assign(prefill_mode="chunked:32", score=1.0 - df["score"]))
    code, err = _leaderboard(capsys, "--results-dir", str(results))
    assert code == 2 and len(err) == 1, err
    assert "prefill_mode" in err[0] and "'chunked:32'" in err[0] and "zz-forged.parquet" in err[0]


def test_a_second_run_that_agrees_is_one_measurement(capsys, tmp_path, store_dir):
    results = tmp_path / "results"
    _second_run(results, store_dir, lambda df: df.assign(prefill_s=df["prefill_s"] * 2))  # timings may differ
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 0 and err == [], err


# ------------------------------------------------------------------------------------------- a verifiable store


def test_manifest_names_every_unlisted_missing_or_altered_file(capsys, tmp_path, store_dir):
    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    assert manifest.main(["--results-dir", str(results)]) == 2  # no manifest yet: nothing vouches for the tree
    assert "has no MANIFEST.sha256" in capsys.readouterr().err
    assert manifest.main(["--write", "--results-dir", str(results)]) == 0
    listed = (results / "MANIFEST.sha256").read_text().splitlines()
    assert listed and all(len(ln.split("  ", 1)[0]) == 64 for ln in listed)
    assert any(ln.endswith(".parquet") for ln in listed) and any("records.jsonl" in ln for ln in listed)
    assert manifest.main(["--results-dir", str(results)]) == 0
    capsys.readouterr()
    _, forged = _second_run(results, store_dir, lambda df: df.assign(score=1.0))
    records = sorted(results.glob("runs/*/records.jsonl"))
    with records[0].open("a") as fh:
        fh.write("\n")  # altered
    gone = sorted((results / "store").glob("*.parquet"))[1]
    gone.unlink()  # missing
    (results / "baselines").mkdir(exist_ok=True)
    assert manifest.main(["--results-dir", str(results)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    rel = records[0].relative_to(results).as_posix()
    assert "unlisted (added since it was published) store/zz-forged.parquet" in err[0]
    assert f"missing store/{gone.name}" in err[0] and f"altered {rel}" in err[0]


def test_forged_store_file_warns_and_strict_refuses(capsys, tmp_path, store_dir):
    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    manifest.write_manifest(results)
    # An exact copy under another name changes no number: the leaderboard runs, and says the file is unlisted.
    real = sorted((results / "store").glob("*.parquet"))[0]
    shutil.copy(real, results / "store" / "zz-copy.parquet")
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 0 and len(err) == 1 and "warning" in err[0] and "store/zz-copy.parquet" in err[0], err
    (results / "store" / "zz-copy.parquet").unlink()
    _second_run(results, store_dir, lambda df: df.assign(score=1.0))  # a new run id, same samples, other scores
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 2 and len(err) == 2 and "warning" in err[0] and "zz-forged.parquet" in err[0], err
    before = _files(results)
    code, err = _leaderboard(capsys, "--strict", "--results-dir", str(results))
    assert code == 2 and len(err) == 1 and "unlisted" in err[0] and "store/zz-forged.parquet" in err[0], err
    assert _files(results) == before
    assert manifest.main(["--results-dir", str(results)]) == 2
    assert "store/zz-forged.parquet" in capsys.readouterr().err


def test_a_missing_baseline_is_no_mismatch_an_altered_one_is(capsys, tmp_path, qa):
    results = tmp_path / "results"
    assert kvbench(capsys, *_base(results, qa))[0] == 0
    manifest.write_manifest(results)
    baselines = sorted((results / "baselines").glob("*.safetensors"))
    baselines[0].unlink()  # a cache, not committed with a published tree
    assert manifest.verify(results).ok
    data = bytearray(baselines[1].read_bytes())
    data[-1] ^= 1
    baselines[1].write_bytes(bytes(data))
    assert manifest.verify(results).altered == [baselines[1].relative_to(results).as_posix()]


# ---------------------------------------------------------------------------------------- values checked on read


@pytest.mark.parametrize("column, value, expected", [
    ("score", float("nan"), "a number"),  # today: ValueError traceback
    ("score", 1.5, "a fraction in [0, 1]"),
    ("memory_reduction", float("inf"), "a finite number"),  # today: ranked first, "inf% less KV memory"
    ("kv_bytes", -5, "a non-negative number"),
    ("sample_meta", "[1, 2]", "a JSON object"),  # today: TypeError traceback
])
def test_a_bad_value_in_the_store_is_one_line_naming_file_and_field(capsys, tmp_path, store_dir, column, value,
                                                                    expected):
    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    path = sorted((results / "store").glob("*.parquet"))[0]
    rows = pd.read_parquet(path)
    rows[column] = rows[column].astype(object if isinstance(value, str) else float)
    rows.loc[rows.index[1], column] = value
    rows.to_parquet(path, index=False)
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 2 and len(err) == 1, err
    assert path.name in err[0] and f"field {column!r}" in err[0] and expected in err[0]
    assert not (tmp_path / "lb").exists()


def test_a_bad_value_in_unpublished_records_is_one_line(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    run_dir = _run_dir(out)
    recs = _records(run_dir)
    recs.append({**recs[-1], "sample_id": "jsonl/q3", "kv_bytes": -5})
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert code == 2 and len(err) == 1 and "records.jsonl" in err[0] and "'kv_bytes'" in err[0], err


# ------------------------------------------------------------------------------------------ caches never trusted


def test_a_consistently_forged_baseline_is_recomputed(capsys, tmp_path, qa):
    from kvbench.tasks.metrics import score

    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    truth = {r["sample_id"]: (r["score"], r["prediction"]) for r in _records(_run_dir(out)) if r["strategy"] == "full"}

    def forge(rec: dict) -> None:  # prediction and score edited together: the record agrees with itself
        rec["prediction"] = rec["answers"][0]
        rec["score"] = score(rec["metric"], rec["prediction"], rec["answers"])

    for f in ti._baselines(results).values():
        ti._rewrite_baseline(f, record=forge)
    code, err, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))  # today: reused silently
    assert code == 0 and len(err) == 2, err
    assert all("not sealed by this machine's kvbench" in ln for ln in err)
    full = {r["sample_id"]: (r["score"], r["prediction"]) for r in _records(_run_dir(out)) if r["strategy"] == "full"}
    assert full == truth


def test_an_edited_digest_cache_is_not_trusted(tmp_path, checkpoint):
    ckpt = tmp_path / "ck"
    shutil.copytree(checkpoint, ckpt)
    true = identity.directory_digest(ckpt)
    cache_file = ckpt / identity.DIGEST_FILE
    cache = json.loads(cache_file.read_text())
    cache["files"]["config.json"]["digest"] = "0" * 64  # size and mtime kept: only the hash is a lie
    cache_file.write_text(json.dumps(cache))
    assert identity.directory_digest(ckpt) == true  # today: a digest of bytes that are not there
    assert json.loads(cache_file.read_text())["files"]["config.json"]["digest"] != "0" * 64  # rewritten


# -------------------------------------------------------------------------------- tracebacks become one line


def _cache_is_a_file(tmp_path: Path, monkeypatch) -> Path:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVBENCH_CACHE", str(blocker / "cache"))
    return blocker


def _smollm2_from_the_tiny_checkpoint(monkeypatch, checkpoint: Path) -> None:
    import transformers

    monkeypatch.setattr(models, "embedded_gguf_dir", lambda: checkpoint)
    tiny = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)


@pytest.mark.parametrize("what", ["task=legal", "strategy=tiered", "model=smollm2-135m"])
def test_an_unwritable_cache_is_one_line(capsys, tmp_path, qa, monkeypatch, checkpoint, what):
    _cache_is_a_file(tmp_path, monkeypatch)
    if what == "model=smollm2-135m":
        _smollm2_from_the_tiny_checkpoint(monkeypatch, checkpoint)
        capsys.readouterr()  # the fixture's own loading bars
    args = [a for a in _base(tmp_path / "results", None if what == "task=legal" else qa)
            if not (what == "model=smollm2-135m" and a.startswith("model="))]
    code, err, _ = kvbench(capsys, *args, what)  # today: FileNotFoundError / NotADirectoryError traceback
    assert code == 2 and len(err) == 1 and "KVBENCH_CACHE" in err[0], err


def test_hydra_run_dir_in_a_system_directory_is_one_line(capsys, tmp_path, qa):
    for extra in (["hydra.run.dir=/proc/kvbench-x", "hydra.output_subdir=.hydra"], ["hydra.run.dir=/sys/x/y"]):
        code, err, _ = kvbench(capsys, *_base(tmp_path / "results", qa), *extra)  # today: Hydra traceback, exit 1
        assert code == 2 and len(err) == 1 and "hydra.run.dir" in err[0] and "system directory" in err[0], err
    assert not (tmp_path / "results").exists()


def test_records_file_replaced_by_a_directory_is_one_line(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa, "engine.max_new_samples=1"))
    path = _run_dir(out) / "records.jsonl"
    saved = path.read_bytes()
    path.unlink()
    path.mkdir()
    code, err, _ = kvbench(capsys, *_base(results, qa))  # today: IsADirectoryError traceback
    assert code == 2 and len(err) == 1 and "is not a file" in err[0] and str(path) in err[0], err
    code, err = _leaderboard(capsys, "--results-dir", str(results), "--out-dir", str(tmp_path / "lb"))
    assert any("is not a file" in ln for ln in err)  # the reader skips it with a warning
    path.rmdir()
    path.write_bytes(saved)
    assert kvbench(capsys, *_base(results, qa))[0] == 0 and len(_records(_run_dir(out))) == 4


def test_a_full_disk_while_storing_a_baseline_is_one_line_and_resumes(capsys, tmp_path, qa, monkeypatch):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa, "engine.max_new_samples=1"))
    path = _run_dir(out) / "records.jsonl"
    before = path.read_bytes()
    real_write = os.write

    def full_disk_for_baselines(fd, data):
        if "/baselines/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk_for_baselines)
    code, err, _ = kvbench(capsys, *_base(results, qa))  # today: SafetensorError traceback
    monkeypatch.undo()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err
    assert path.read_bytes() == before and not list((results / "baselines").glob(".*.tmp"))
    code, err, _ = kvbench(capsys, *_base(results, qa))
    assert code == 0 and len(_records(_run_dir(out))) == 4


def test_a_corpus_file_name_that_is_not_utf8_is_skipped(capsys, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("The harbour master kept a ledger of every ship. " * 200)
    (corpus / os.fsdecode(b"caf\xe9.txt")).write_text("A name of Latin-1 bytes. " * 200)
    results = tmp_path / "results"
    args = [a for a in _base(results, None) if not a.startswith("task.context_tokens")]
    code, err, out = kvbench(capsys, *args, "task=custom", f"task.corpus={corpus}", "task.context_tokens=1024")
    assert code == 0 and len(err) == 1 and "caf\\xe9.txt (name)" in err[0], err  # today: UnicodeEncodeError
    assert set(read_store(results)["task"]) == {"custom"}  # published


# ------------------------------------------------------------------------------------- writes only where told


def _sweep(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("data, expected", [
    ({"blocks": {"../../../escaped": {"strategy": "int8"}}}, "block name '../../../escaped'"),
    ({"name": "../up", "blocks": {"a": {"strategy": "int8"}}}, "sweep name '../up'"),
    ({"name": "a/b", "blocks": {"a": {"strategy": "int8"}}}, "sweep name 'a/b'"),
])
def test_sweep_and_block_names_are_one_path_component(capsys, tmp_path, qa, data, expected):
    from kvbench import sweep

    results = tmp_path / "deep" / "results"
    path = _sweep(tmp_path / "s.yaml", {"overrides": _base(results, qa)[:-1], **data})
    code = sweep.main([str(path), "--results-dir", str(results)])  # today: Hydra writes outside results_dir
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert _files(tmp_path) == {"s.yaml", "qa.jsonl"}


def test_sweep_results_dir_is_taken_literally(capsys, tmp_path, qa, monkeypatch):
    from kvbench import sweep

    monkeypatch.chdir(tmp_path)
    path = _sweep(tmp_path / "s.yaml", {"overrides": _base(Path("x"), qa)[:-1], "blocks": {"a": {"seed": "0,1"}}})
    assert sweep.main([str(path), "--results-dir", "A,B", "--dry-run"]) == 0  # today: a sweep over A and B
    out = capsys.readouterr().out
    command = shlex.split(next(ln for ln in out.splitlines() if ln.startswith("$ "))[2:])
    assert "2 jobs in 1 multirun(s)" in out and "results_dir='A,B'" in command
    loaded = sweep.load_sweep(path, extra=[f"results_dir={sweep.literal('A,B')}"])
    assert {info.results_dir for info in sweep.describe_jobs(loaded)} == {"A,B"}


@pytest.mark.parametrize("value, expected", [
    ("", "results_dir is empty"),  # today: runs/, store/, baselines/ in the working directory
    ("/etc", "inside the system directory /etc"),  # as root: /etc/runs
    ("/proc/self/x", "inside the system directory /proc"),
])
def test_results_dir_is_never_empty_nor_a_system_directory(capsys, tmp_path, qa, monkeypatch, value, expected):
    monkeypatch.chdir(tmp_path)
    code, err, _ = kvbench(capsys, *_base(Path("unused"), qa)[:-1], f"results_dir={value}")
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert _files(tmp_path) == {"qa.jsonl"} and not Path("/etc/runs").exists()


def test_a_results_dir_sweep_is_refused(capsys, tmp_path, qa):
    dirs = f"results_dir={tmp_path}/a,{tmp_path}/b"
    code, err, _ = kvbench(capsys, "-m", *_base(tmp_path / "results", qa)[:-1], dirs)
    assert code == 2 and len(err) == 1 and "results_dir is one directory" in err[0], err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_job_that_cannot_create_its_results_dir_is_refused_up_front(capsys, tmp_path, qa):
    from kvbench import sweep

    (tmp_path / "file").write_text("x")
    blocks = {name: {"results_dir": str(tmp_path / where)} for name, where in
              (("first", "ok1"), ("middle", "file/sub"), ("last", "ok2"))}
    path = _sweep(tmp_path / "s.yaml", {"overrides": _base(tmp_path, qa)[:-1], "blocks": blocks})
    code = sweep.main([str(path)])  # today: the middle job's traceback ends the sweep; the last never runs
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and "'middle'" in err[0] and "is not a directory" in err[0], err
    assert not (tmp_path / "ok1").exists() and not (tmp_path / "ok2").exists()


def test_a_job_failing_at_run_time_is_reported_and_the_sweep_goes_on(capsys, tmp_path, qa, monkeypatch):
    from kvbench import runner

    real_run = runner.run

    def run(cfg, strategies=None):
        if int(cfg.seed) == 1:  # its results_dir vanished under it: an OSError, not a kvbench error
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "results" / "runs"))
        return real_run(cfg, strategies)

    monkeypatch.setattr(runner, "run", run)
    results = tmp_path / "results"
    code, err, _ = kvbench(capsys, "-m", *_base(results, qa), "seed=0,1,2", f"hydra.sweep.dir={tmp_path}/m")
    assert code == 1, err  # today: a traceback, and the third job never runs
    assert any("1 of 3 job(s) failed" in ln for ln in err) and any("Permission denied" in ln for ln in err)
    assert sorted(read_store(results)["seed"].unique()) == [0, 2]


def test_unknown_plus_key_is_refused_like_a_misspelled_key(capsys, tmp_path, qa):
    code, err, _ = kvbench(capsys, *_base(tmp_path / "results", qa), "+resutls_dir=elsewhere")  # today: ignored
    assert code == 2 and len(err) == 1 and "unknown key resutls_dir" in err[0] and "results_dir" in err[0], err
    assert not (tmp_path / "results").exists()
    code, err, _ = kvbench(capsys, *_base(tmp_path / "results", qa), "++seed=3", "--cfg", "job")
    assert code == 0, err  # ++ on a key that exists is a plain override


# --------------------------------------------------------------------------------------------- escaping


ESC = "\x1b]0;PWNED\x07"


def test_control_characters_never_reach_any_output(capsys, tmp_path, store_dir):
    records = read_store(store_dir).drop(columns="source_file", errors="ignore")
    first = sorted(s for s in records["strategy"].unique() if s != "full")[0]
    records = records.assign(strategy=records["strategy"].replace({first: f"{ESC}{first}"}),
                             model=f"{ESC}tiny", task=records["task"].replace({"alpha": f"al{ESC}pha"}))
    results = tmp_path / "results"
    (results / "store").mkdir(parents=True)
    records.to_parquet(results / "store" / "hostile.parquet", index=False)
    out = tmp_path / "lb"
    capsys.readouterr()
    from kvbench import leaderboard

    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(out), "--plots"]) == 0
    captured = capsys.readouterr()
    for text in (captured.out, captured.err):
        assert "\x1b" not in text and "\x07" not in text  # today: ESC]0;... reaches the terminal
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".png" for p in written)
    for p in written:
        data = p.read_bytes()
        if p.suffix in (".md", ".csv", ".html"):
            assert b"\x1b" not in data and b"\x07" not in data, p.name
    assert "]0;PWNED" in (out / "leaderboard.md").read_text()  # the name stays readable, minus the controls


# ------------------------------------------------------------------------------------ a cut last line, resumed


def test_a_cut_last_line_then_resume_leaves_no_stale_duplicates(capsys, tmp_path, qa):
    results = tmp_path / "results"
    args = [a for a in _base(results, qa) if not a.startswith("strategy=")] + ["strategies=[int8,int4]"]
    _, _, out = kvbench(capsys, *args)
    path = _run_dir(out) / "records.jsonl"
    path.write_bytes(path.read_bytes()[:-40])  # a kill in the middle of q2's last record
    code, err, _ = kvbench(capsys, *args)
    assert code == 0, err
    lines = path.read_text().splitlines()
    keys = [(json.loads(x)["sample_id"], json.loads(x)["strategy_name"]) for x in lines]
    assert len(keys) == len(set(keys)) == 6  # today: 8 lines, q2's full and int8 twice
