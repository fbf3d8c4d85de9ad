"""The committed grids are sweep files run by ``kvbench sweep``: conf/sweep/leaderboard.yaml, eviction.yaml and
headline.yaml hold exactly the jobs scripts/reproduce_leaderboard.sh, scripts/sweep_eviction.py and
scripts/reproduce_headline.sh ran when they looped over the grid themselves (same overrides, so the same
composed configs and run ids), and the scripts are thin wrappers that pass their arguments on."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from kvbench import sweep as sweep_mod

ROOT = Path(__file__).resolve().parents[1]


def _normalized(jobs: list[list[str]]) -> set[frozenset[str]]:
    """Each job's overrides as Hydra's sweeper writes them (``true`` -> ``True``), order aside."""
    from kvbench.config import hydra_context, parse_jobs

    with hydra_context() as loader:
        return {frozenset(o for o in parse_jobs(job, True, loader)[0]) for job in jobs}


def _configs(jobs: list[list[str]]) -> list[dict]:
    """Every job's composed, resolved config: what its run id is a content hash of."""
    from omegaconf import OmegaConf

    from kvbench.config import compose_jobs, hydra_context

    with hydra_context():
        return sorted((OmegaConf.to_container(cfg, resolve=True) for _, cfg in compose_jobs(jobs)), key=repr)


def _sweep_jobs(name: str, extra: list[str]) -> list[list[str]]:
    return [job for block in sweep_mod.load_sweep(name, extra=extra).blocks for job in block.jobs]


# ---------------------------------------------------------------- the grids the scripts ran before, as code


def _old_leaderboard_jobs(results_dir: str = "results") -> list[list[str]]:
    """scripts/reproduce_leaderboard.sh's `cell` at its defaults (JOBS=1, ROUND=0): one run per (task, setting)."""
    from kvbench import strategies

    names = ",".join(strategies.available())
    return [[f"strategies=[{names}]", f"task={task}", f"task.query_aware={qa}", "task.n_samples=100",
             "model=smollm2-135m", "hardware=cpu", f"results_dir={results_dir}", "engine.progress=false"]
            for task in ("legal", "papers", "fiction") for qa in ("true", "false")]


#: scripts/sweep_eviction.py's strategy order, kept so the committed runs' labels (and ids) stay the same.
_OLD_EVICTION_ORDER = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random")


def _old_eviction_jobs(results_dir: str) -> list[list[str]]:
    """The committed eviction table's run: `sweep_eviction.py --tasks legal --no-compose --extra
    task.n_samples=3 --results-dir results/eviction`, one job per ratio (its ``jobs()`` + ``kvbench_command``)."""
    return [["task=legal", f"strategies=[{','.join(_OLD_EVICTION_ORDER)}]",
             f"strategies_params.compression_ratio={ratio}", "engine.progress=false", "task.n_samples=3",
             f"results_dir={results_dir}"] for ratio in (0.25, 0.5, 0.75, 0.875)]


# ------------------------------------------------------------------------------------------------ the tests


def test_leaderboard_sweep_is_the_grid_the_script_ran():
    """Query-aware jobs are the script's (same composed configs); query-agnostic ones carry 4 questions per context, 25
    contexts per task (100 questions), a new grid by design."""
    from kvbench import strategies

    old = _old_leaderboard_jobs()
    new = _sweep_jobs("leaderboard", ["results_dir=results"])  # the wrapper's --results-dir
    assert len(new) == 6
    def setting(jobs: list[list[str]], value: str) -> list[list[str]]:  # the sweeper writes `True`, the script `true`
        return [j for j in jobs if f"task.query_aware={value}" in (o.lower() for o in j)]

    aware, agnostic = setting(new, "true"), setting(new, "false")
    assert len(aware) == len(agnostic) == 3
    old_aware = setting(old, "true")
    assert _normalized(aware) == _normalized(old_aware) and _configs(aware) == _configs(old_aware)
    moved = [[o if o != "task.n_samples=100" else "task.n_samples=25" for o in j] + ["task.questions_per_context=4"]
             for j in setting(old, "false")]
    assert _normalized(agnostic) == _normalized(moved) and _configs(agnostic) == _configs(moved)
    infos = sweep_mod.describe_jobs(sweep_mod.load_sweep("leaderboard", extra=["results_dir=results"]))
    assert sorted((j.n_samples, j.questions_per_context, j.n_questions) for j in infos) == \
        [(25, 4, 100)] * 3 + [(100, 1, 100)] * 3
    # the file lists every registered strategy, in the registry's order (the labels are in the run id)
    listed = next(o for o in new[0] if o.startswith("strategies="))
    assert listed == f"strategies=[{','.join(strategies.available())}]"
    # JOBS=2 on two cores gave every run hardware.threads=1: the joblib launcher's settings, two at a time
    sw = sweep_mod.load_sweep("leaderboard", launcher="joblib", extra=["results_dir=results"])
    assert _normalized(sw.blocks[0].jobs) == _normalized([[*job, "hardware.threads=1"] for job in old_aware])
    assert sweep_mod.parallelism(sw) == 2
    # a setting after `--` wins over the file's launcher settings
    sw = sweep_mod.load_sweep("leaderboard", launcher="joblib", extra=["hydra.launcher.n_jobs=3", "hardware.threads=4"])
    assert sweep_mod.parallelism(sw) == 3 and all("hardware.threads=4" in job for b in sw.blocks for job in b.jobs)


def test_re_measured_leaderboard_is_every_strategy_on_the_calibrated_tasks():
    """conf/sweep/leaderboard_fused.yaml (issue 49 item 6): every registered strategy in the registry's order, each
    task in both query settings at 100 questions, at 4,096 tokens with the distractors the calibration chose
    (results/calibration: legal and fiction none, papers one), on the calibration side of the document pools (no
    work of the confirmatory study's side) with its own seed, read by the kernel it names."""
    from kvbench import strategies

    confirm = {c["task"]["name"]: c for c in _configs(_sweep_jobs("confirm", []))}
    configs = _configs(_sweep_jobs("leaderboard_fused", []))
    assert len(configs) == 6
    for cfg in configs:
        t = cfg["task"]
        assert cfg["strategies"] == strategies.available() and cfg["engine"]["reader"] == "fused"
        assert cfg["results_dir"] == "results/fused"
        assert t["pool"] == "calibration" != confirm[t["name"]]["task"]["pool"] and t["seed"] != 4049
        assert t["context_tokens"] == 4096 and t["distractors"] == confirm[t["name"]]["task"]["distractors"]
    assert sorted((c["task"]["name"], c["task"]["query_aware"], c["task"]["n_samples"] *
                   (1 if c["task"]["query_aware"] else c["task"]["questions_per_context"])) for c in configs) == \
        sorted((n, qa, 100) for n in ("legal", "papers", "fiction") for qa in (True, False))


def test_eviction_sweep_is_the_committed_grid(tmp_path):
    from kvbench import strategies

    out = str(tmp_path / "eviction")
    old, new = _old_eviction_jobs(out), _sweep_jobs("eviction", [f"results_dir={out}"])
    assert len(new) == 4 and _normalized(new) == _normalized(old)
    assert _configs(new) == _configs(old)
    assert set(_OLD_EVICTION_ORDER) == set(strategies.family_names("eviction"))  # every eviction strategy
    # the committed runs were these jobs: each run's config.yaml holds one of the ratios
    committed = sorted(yaml.safe_load(p.read_text())["strategies_params"]["compression_ratio"]
                       for p in (ROOT / "results" / "eviction" / "runs").glob("*/config.yaml"))
    assert committed == [0.25, 0.5, 0.75, 0.875]


def test_headline_rounds_are_the_file_s_per_round():
    """reproduce_headline.sh looped `kvbench sweep headline -- engine.max_new_samples=16` ROUNDS times; the
    file now says per_round: 16 (questions). task.n_samples=150 counts contexts of 8 questions, so a task's
    1,200 questions take 75 rounds (counting contexts as questions stopped the sweep after 10)."""
    sw = sweep_mod.load_sweep("headline")
    assert sw.per_round == 16
    jobs = sweep_mod.describe_jobs(sw)
    [info] = {(j.n_samples, j.questions_per_context) for j in jobs}
    assert info == (150, 8)
    assert sweep_mod.rounds_needed(sw, jobs) == math.ceil(150 * 8 / 16) == 75
    single = sweep_mod.JobInfo("smollm2-135m", "cpu", 4096, 150, [("full", "full")])
    assert sweep_mod.rounds_needed(sw, [single]) == math.ceil(150 / 16) == 10
    # resumed: the rounds the job with the most questions left needs, none once every job holds all of them
    # (resumed at 6,400 of 6,400 lines, the confirmatory sweep went on launching its 80 rounds, each job idle)
    part = [sweep_mod.JobInfo("smollm2-135m", "cpu", 4096, 150, [("full", "full")], done=d) for d in (100, 140)]
    assert sweep_mod.rounds_needed(sw, part) == math.ceil(50 / 16) == 4
    full = [sweep_mod.JobInfo("smollm2-135m", "cpu", 4096, 150, [("full", "full")], done=d) for d in (150, 160)]
    assert sweep_mod.rounds_needed(sw, full) == 0
    cmds = [c for r in (1, 2) for c in sweep_mod.commands(sw, python="python", stamp="T", round_no=r)]
    assert all("engine.max_new_samples=16" in c for c in cmds)
    assert [c[-1] for c in cmds] == [f"hydra.sweep.dir=${{results_dir}}/multirun/headline/T/round-0{r}/00-headline"
                                     for r in (1, 2)]
    # the jobs themselves did not change: the round limit is not part of a run's identity
    assert len(sw.blocks[0].jobs) == 3 and not any("max_new_samples" in o for o in sw.blocks[0].jobs[0])


def test_leaderboard_in_rounds_keeps_the_run_identity(capsys):
    """The old ROUND=2 with N_SAMPLES=5, now in questions: the query-aware job's 5 questions and the
    query-agnostic job's 5 contexts x 4 = 20 questions take ceil(20 / 2) = 10 rounds, each round the same two
    jobs plus the round limit."""
    rc = sweep_mod.main(["leaderboard", "--dry-run", "--per-round", "2", "--", "task=fiction", "task.n_samples=5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 jobs in 2 multirun(s), launcher basic; 10 round(s), each job adding up to 2 samples" in out
    cmds = [ln for ln in out.splitlines() if ln.startswith("$ ")]
    assert len(cmds) == 20 and all("task.n_samples=5" in c and "engine.max_new_samples=2" in c for c in cmds)
    assert [c.rsplit("/", 2)[1] for c in cmds[:4]] == ["round-01", "round-01", "round-02", "round-02"]
    assert sum("task.questions_per_context=4" in c for c in cmds) == 10


@pytest.mark.parametrize("argv, expected", [
    (["leaderboard", "--rounds", "2"], "--rounds needs per_round"),
    (["headline", "--rounds", "0"], "--rounds must be >= 1"),
    (["headline", "--per-round", "-1"], "--per-round must be >= 0"),
    (["headline", "--", "engine.max_new_samples=4"], "engine.max_new_samples is set by per_round"),
])
def test_bad_round_settings_are_one_line_and_exit_2(argv, expected, capsys):
    assert sweep_mod.main(["--dry-run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_bad_per_round_in_a_file_is_one_line(tmp_path):
    from kvbench.errors import KVBenchError

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"blocks": {"a": {"strategy": "int8"}}, "per_round": "many"}))
    with pytest.raises(KVBenchError, match="per_round must be an integer >= 0"):
        sweep_mod.load_sweep(path)


def test_reproduce_leaderboard_passes_its_arguments_to_kvbench_sweep(tmp_path):
    """The wrapper's --dry-run is the sweep's: jobs and commands, and nothing else runs (no leaderboard)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_leaderboard.sh"), "--dry-run", "--",
                           "task=legal", "task.n_samples=2"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                               "RESULTS_DIR": str(tmp_path / "r")}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "sweep leaderboard: 2 jobs in 2 multirun(s)" in proc.stdout
    cmds = [ln for ln in proc.stdout.splitlines() if ln.startswith("$ ")]
    assert len(cmds) == 2 and all(f"results_dir={tmp_path / 'r'}" in c and "task=legal" in c for c in cmds)
    assert not (tmp_path / "r").exists()


def _job_dir(root: Path, num: int, overrides: list[str], run: Path | None, error: str = "") -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if run is not None:
        (job / "run_dir.txt").write_text(f"{run}\n")
    if error:
        (job / "error.txt").write_text(error + "\n")


def test_eviction_table_comes_from_the_newest_sweep_run_s_job_pointers(tmp_path):
    """`sweep_eviction.py --table-only`: one row per strategy of each job the last sweep run pointed to (an
    older run of the sweep is ignored), a failed job listed with its error, exit status 1."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import sweep_eviction
    finally:
        sys.path.pop(0)
    run = tmp_path / "runs" / "legal-x-1"
    run.mkdir(parents=True)
    pd.DataFrame([
        {"task": "legal", "strategy": "full", "accuracy": 1.0},
        {"task": "legal", "strategy": "snapkv(compression_ratio=0.5)", "accuracy": 0.5, "delta_pp": -50.0},
        {"task": "legal", "strategy": "h2o(compression_ratio=0.5)", "accuracy": 0.25, "delta_pp": -75.0},
    ]).to_csv(run / "summary.csv", index=False)
    multirun = tmp_path / "multirun" / "eviction"
    _job_dir(multirun / "2026-01-01_00-00-00" / "00-eviction", 0, ["strategies_params.compression_ratio=0.9"], run)
    newest = multirun / "2026-02-01_00-00-00" / "00-eviction"
    _job_dir(newest, 0, ["strategies=[snapkv,h2o]", "strategies_params.compression_ratio=0.5"], run)
    _job_dir(newest, 1, ["strategies=[snapkv,h2o]", "strategies_params.compression_ratio=0.75"], None,
             "out of memory")
    assert sweep_eviction.main(["--table-only", "--results-dir", str(tmp_path)]) == 1
    table = pd.read_csv(tmp_path / "eviction_sweep.csv")
    assert table[["strategy", "ratio", "accuracy"]].values.tolist() == [["h2o", 0.5, 0.25], ["snapkv", 0.5, 0.5]]
    md = (tmp_path / "eviction_sweep.md").read_text()
    assert "## Failed jobs" in md and "compression_ratio=0.75: out of memory" in md
    assert sweep_eviction.job_strategy_and_ratio(["strategy=compose", "strategy.evict=snapkv", "strategy.quantize=int8",
                                                  "strategy.evict_params.compression_ratio=0.5"]) == (
        "compose:snapkv+int8", 0.5)


def test_eviction_table_without_a_sweep_run_is_one_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import sweep_eviction
    finally:
        sys.path.pop(0)
    assert sweep_eviction.main(["--table-only", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no run of sweep 'eviction'" in err[0]
