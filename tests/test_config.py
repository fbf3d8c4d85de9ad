"""One source of truth for the configuration: schemas generated from the dataclasses, every override parsed by
Hydra (sweeps included), every job checked before anything runs, and bad input as one line with exit 2."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvbench import cli, strategies
from kvbench import sweep as sweep_mod
from kvbench.config import (
    check_overrides,
    compose_config,
    conf_dir,
    hydra_context,
    parse_jobs,
    resolve_strategies,
    strategy_defaults,
    task_defaults,
    validate_cfg,
)
from kvbench.errors import KVBenchError
from kvbench.results import read_store

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _tiny_job(results: Path) -> list[str]:
    """A job of a few milliseconds: the tiny random Llama on one row of the jsonl fixture, two new tokens."""
    return ["model=tiny-llama", "task=jsonl", f"task.path={FIXTURE}", "task.n_samples=1", "hardware.threads=1",
            "engine.progress=false", f"results_dir={results}"]


def _fails(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the CLI in this process; it must exit 2 with exactly one line on stderr. Returns that line."""
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, expected", [
    (["task.context_tokens=abc"], "task.context_tokens=abc: expected an integer"),
    (["task.n_samples=abc"], "task.n_samples=abc: expected an integer"),
    (["seed=abc"], "seed=abc: expected an integer"),
    (["engine.chunk_tokens=abc"], "engine.chunk_tokens=abc: expected an integer"),
    (["engine.warmup=maybe"], "engine.warmup=maybe: expected true or false"),
    (["strategy=int8,int4"], "strategy=int8,int4 is a sweep: add -m"),
    (["strategy=choice(int8"], "cannot parse override"),
    (["strategies=[int8]", "strategy.group_size=32"], "use strategies_params.int8.group_size="),
    (["task.context_tokenz=3"], "did you mean task.context_tokens?"),
    (["engine.prefil=chunked"], "did you mean engine.prefill?"),
    (["strategy=snapkv", "strategy.compresion_ratio=0.5"], "did you mean 'compression_ratio'?"),
    (["strategy=int8", "strategy.group_size=abc"], "strategy.group_size=abc: expected an integer"),
    (["strategies=[int8,snapkv]", "strategies_params.window_sze=3"], "window_sze matches no parameter"),
    (["strategies=[int8,snapkv]", "strategies_params.snapkv.window_sze=3"], "did you mean 'window_size'?"),
    (["strategies=[int8,snapkv]", "strategies_params.h2o.window_size=3"], "not in strategies=[int8,snapkv]"),
    (["strategies=[int8,snapkv]", "strategies_params.snapkv.window_size=x"], "snapkv.window_size='x': expected an"),
    (["-m", "strategy=interval(0.1,0.5)"], "interval() needs a sampling sweeper"),
    (["-m", "strategy=int8,nope"], "unknown strategy 'nope'; valid:"),
    (["-m", "task=glob(nope*)"], "task=glob(nope*) matches no task; valid:"),
    # every job is checked before the first runs: int8 has no compression_ratio, snapkv would have run first
    (["-m", "strategy=snapkv,int8", "strategy.compression_ratio=0.5"], "'int8' has no parameter 'compression_ratio'"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, expected, tmp_path, capsys):
    flags = [a for a in args if a.startswith("-")]
    line = _fails([*flags, *_tiny_job(tmp_path / "results"), *[a for a in args if a not in flags]], capsys)
    assert expected in line, line
    assert line.startswith("kvbench: error: ")
    assert not (tmp_path / "results").exists()


def test_hydra_grammar_errors_exit_2_through_python_m(tmp_path):
    """The same path as a user's shell: no Hydra multi-line text, no traceback, exit status 2."""
    for args in (["strategy=int8,int4"], ["task.context_tokens=abc"]):
        proc = subprocess.run([sys.executable, "-m", "kvbench", *args, f"results_dir={tmp_path}/results"],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr


# -------------------------------------------------------------------------------- one source of truth


@pytest.mark.parametrize("name", strategies.available())
def test_strategy_config_is_its_dataclass(name):
    """The composed ``strategy=<name>`` node is the dataclass's defaults; the YAML holds no parameter value."""
    cfg = compose_config([f"strategy={name}"])
    assert dict(cfg.strategy) == strategy_defaults(name)
    assert strategies.build(name, {k: v for k, v in strategy_defaults(name).items() if k != "name"}).params() == \
        strategies.build(name).params()
    path = conf_dir() / "strategy" / f"{name}.yaml"
    if path.is_file():
        data = yaml.safe_load(path.read_text()) or {}
        assert set(data) <= {"defaults"}, f"{path} repeats {set(data) - {'defaults'}}"


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf" / "task").glob("*.yaml")))
def test_task_config_is_its_module_defaults(name):
    defaults = task_defaults(name)
    assert defaults is not None, f"kvbench/tasks/{name}.py has no {name.upper()}_DEFAULTS"
    cfg = compose_config([f"task={name}", "seed=7"])
    from omegaconf import OmegaConf

    required = {k for k in cfg.task if OmegaConf.is_missing(cfg.task, k)}
    composed = {k: cfg.task[k] for k in cfg.task if k not in ("name", "seed") and k not in required}
    composed = OmegaConf.to_container(OmegaConf.create(composed))
    assert composed == {k: v for k, v in defaults.items() if k != "seed"}
    assert cfg.task.seed == 7  # follows the top-level seed
    data = yaml.safe_load((conf_dir() / "task" / f"{name}.yaml").read_text()) or {}
    assert all(v == "???" for k, v in data.items() if k != "defaults"), "task YAMLs hold only required keys"


def test_new_dataclass_fields_flow_into_the_config(monkeypatch):
    """A field added to a strategy's dataclass is selectable with no YAML edit (others add fields in parallel)."""
    from kvbench import config

    @dataclasses.dataclass
    class Probe(strategies.strategy_class("full")):
        name = "probe_cfg"
        preset: str = "paper"
        level: int = 3

    monkeypatch.setitem(strategies._REGISTRY, "probe_cfg", Probe)
    cfg = compose_config(["strategy=probe_cfg", "strategy.level=5"])
    assert dict(cfg.strategy) == {"name": "probe_cfg", "preset": "paper", "level": 5}
    with pytest.raises(KVBenchError, match="expected an integer"):
        compose_config(["strategy=probe_cfg", "strategy.level=high"])
    monkeypatch.undo()
    config.register_configs()  # forgets the probe again
    with pytest.raises(KVBenchError, match="unknown strategy 'probe_cfg'"):
        compose_config(["strategy=probe_cfg"])


def test_per_strategy_and_shared_overrides_in_multi_strategy_runs():
    cfg = compose_config(["strategies=[snapkv,h2o,int8]", "strategies_params.compression_ratio=0.75",
                          "strategies_params.snapkv.window_size=8", "strategies_params.h2o.compression_ratio=0.5"])
    built = {s.name: s for s in resolve_strategies(cfg)}
    assert list(built) == ["full", "snapkv", "h2o", "int8"]
    assert (built["snapkv"].compression_ratio, built["snapkv"].window_size) == (0.75, 8)
    assert built["h2o"].compression_ratio == 0.5  # its own value wins over the shared one
    assert built["int8"].params() == strategies.build("int8").params()  # no compression_ratio: untouched


def test_compose_parameters_merge_deeply():
    cfg = compose_config(["strategy=compose", "strategy.evict_params.compression_ratio=0.75",
                          "strategy.quantize=int4", "strategy.quantize_params.group_size=64"])
    (s,) = [x for x in resolve_strategies(cfg) if x.name == "compose"]
    assert s.evict_params == {"compression_ratio": 0.75} and s.quantize_params == {"group_size": 64}


def test_strategies_never_make_kvbench_core_import_them():
    code = ("import sys, kvbench.capture, kvbench.errors, kvbench.quantizers; "
            "bad = [m for m in sys.modules if 'strategies' in m.split('.')]; "
            "assert not bad, bad; import kvbench.strategies.base; "
            "assert kvbench.strategies.base.LayerCapture is kvbench.capture.LayerCapture")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


def test_a_checked_job_builds_its_strategies_once(monkeypatch):
    """Issue 27: check_overrides builds (so validates) the strategies; the job then takes those, not new ones."""
    built: list[str] = []
    build = strategies.build
    monkeypatch.setattr(strategies, "build", lambda name, params=None: built.append(name) or build(name, params))
    check_overrides(["strategy=knorm", "strategy.compression_ratio=0.25"])
    assert sorted(built) == ["full", "knorm"]
    job = validate_cfg(compose_config(["strategy=knorm", "strategy.compression_ratio=0.25"]))
    assert [s.label() for s in job] == ["full", "knorm(budget_tokens=None,compression_ratio=0.25,decode_evict=False)"]
    assert len(built) == 2  # taken from the check
    validate_cfg(compose_config(["strategy=knorm", "strategy.compression_ratio=0.25"]))
    assert len(built) == 4  # a job not checked again is built afresh (the check's strategies are handed out once)


# ---------------------------------------------------------------------------------- Hydra's sweep grammar


def test_sweep_grammar_expands_as_hydra_does():
    with hydra_context() as loader:
        assert parse_jobs(["strategy=glob(int*,exclude=int2)"], True, loader) == [["strategy=int4"], ["strategy=int8"]]
        assert parse_jobs(["strategy=choice(int8,int4)", "task.n_samples=range(1,3)"], True, loader) == [
            ["strategy=int8", "task.n_samples=1"], ["strategy=int8", "task.n_samples=2"],
            ["strategy=int4", "task.n_samples=1"], ["strategy=int4", "task.n_samples=2"]]
        assert parse_jobs(["strategy=int8", "hydra.sweep.dir=x"], False, loader) == [["strategy=int8"]]
    assert check_overrides(["strategy=glob(*)"], multirun=True) == len(strategies.available())


def test_choice_range_glob_from_the_command_line_run(tmp_path):
    results = tmp_path / "results"
    sweeps = (["strategy=choice(int8,int4)", "task.max_new_tokens=range(2,3)"],
              ["strategy=glob(int*,exclude=int2)", "task.max_new_tokens=2"])
    for args in sweeps:
        try:
            cli.main(["-m", *args, *_tiny_job(results), f"hydra.sweep.dir={tmp_path}/m"])
        except SystemExit as exc:
            assert not exc.code
    store = read_store(results)
    labels = {s.split("(")[0] for s in store["strategy"]}
    assert labels == {"full", "int8", "int4"}
    assert store["run_id"].nunique() == 2  # the glob run found both jobs finished (same run ids)


def _sweep_file(path: Path, blocks: dict, results: Path) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "overrides": _tiny_job(results), "blocks": blocks}))
    return path


def test_choice_range_glob_from_a_sweep_file_dry_run_and_real(tmp_path, capsys):
    results = tmp_path / "results"
    path = _sweep_file(tmp_path / "grammar.yaml", {
        "pick": {"strategy": "choice(int8,int4)", "task.max_new_tokens": "range(2,3)"},
        "globbed": {"strategy": "glob(int2*)"}}, results)
    assert sweep_mod.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "3 jobs in 2 multirun(s)" in out and "no measurement yet" in out
    assert not results.exists()
    assert sweep_mod.main([str(path)]) == 0
    assert {s.split("(")[0] for s in read_store(results)["strategy"]} == {"full", "int8", "int4", "int2"}


@pytest.mark.parametrize("dry", [True, False])
def test_interval_and_bad_jobs_in_a_sweep_file_fail_before_running(tmp_path, capsys, dry):
    results = tmp_path / "results"
    for blocks, expected in (({"a": {"strategy.compression_ratio": "interval(0.1,0.5)"}}, "interval() needs"),
                             ({"a": {"strategy": "snapkv,int8", "strategy.compression_ratio": 0.5}},
                              "'int8' has no parameter 'compression_ratio'")):
        path = _sweep_file(tmp_path / "bad.yaml", blocks, results)
        assert sweep_mod.main([str(path), *(["--dry-run"] if dry else [])]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
        assert not results.exists()


# ------------------------------------------------------------------------------------------------- help


def test_help_names_kvbench_its_tools_and_only_working_groups(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("kvbench:") and "powered by Hydra" not in out
    for tool in cli.SUBCOMMANDS:
        assert f"kvbench {tool}" in out
    for group in ("strategy", "task", "model", "hardware"):
        assert f"\n  {group}" in out
    assert "sweep:" not in out and "  sweep  " not in out.split("Tools:")[0]


def test_engine_reader_is_validated_against_the_readers():
    """``engine.reader`` takes kvbench.fused's choices (one list), anything else one line naming them."""
    from kvbench import fused

    for choice in fused.CHOICES:
        validate_cfg(compose_config([f"engine.reader={choice}"]))
    with pytest.raises(KVBenchError, match="unknown engine.reader 'fastest'; valid: auto, simd, fused, blocks"):
        validate_cfg(compose_config(["engine.reader=fastest"]))
