"""Command line: ``python -m kvbench [hydra overrides]`` runs a benchmark; ``kvbench advise|calc|calibrate|hardware|
leaderboard|lmeval|plan|sweep|verify ...`` dispatch to their own tools. Bad input ends with one line on stderr and exit
status 2, never a traceback, and nothing written. Before the first job starts, every job of a (multi)run is
composed and checked as far as it can be without the model's weights (:func:`kvbench.config.check_overrides`):
group choices and keys, engine settings, each strategy built from its parameters, and — when the model's
tokenizer loads — its samples against the task's minimum and the model's window. What only the run itself can
find (weights that fail to load, an error while measuring) fails that job alone.

A multirun behaves like Hydra's: each job directory (``<sweep dir>/<n>/``) holds ``.hydra/{config,hydra,
overrides}.yaml`` and, once the job ran, ``run`` (a symlink) and ``run_dir.txt`` naming its run directory under
``results_dir/runs/``. A job that still fails at run time writes ``error.txt`` there and the others run on; the
multirun then lists every failure and exits with status 1. ``--cfg job`` prints the composed config with every
value the run will use (interpolations resolved, each strategy's parameters as built).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from kvbench.config import GROUPS, check_overrides, conf_dir, group_options, register_configs
from kvbench.errors import KVBenchError

SUBCOMMANDS = {
    "advise": "kvbench.advise",
    "calc": "kvbench.calc_cli",
    "calibrate": "kvbench.calibrate",
    "design": "kvbench.design_cli",
    "hardware": "kvbench.hardware_probe",
    "leaderboard": "kvbench.leaderboard",
    "lmeval": "kvbench.lmeval",
    "plan": "kvbench.plan",
    "sweep": "kvbench.sweep",
    "verify": "kvbench.manifest",
    "throughput": "kvbench.throughput",
}
SUBCOMMAND_HELP = {
    "advise": "which strategy to use on a device, model, context and load (fits, speed, accuracy evidence)",
    "calibrate": "tune a needle task on your corpus until the full baseline reaches a target accuracy",
    "calc": "KV-cache size and time for any model/context/hardware, from the formulas (`kvbench calc claim`)",
    "design": "register the confirmatory study for your model and hardware (writes the design, plans n)",
    "hardware": "measure this machine into a hardware profile (`kvbench hardware probe`)",
    "leaderboard": "tables, claim check and plots from the result store",
    "lmeval": "lm-evaluation-harness with a compressed cache",
    "plan": "questions each claim needs to be decided (spec v1.2 §2.4), from the store or from assumptions",
    "sweep": "a named grid (conf/sweep/*.yaml) as Hydra multiruns, with a time projection (--dry-run)",
    "verify": "check a results directory against its MANIFEST.sha256 (every unlisted, missing or altered file)",
    "throughput": "sequences that fit a memory budget per strategy, and their batched decode speed",
}

# Registered at import: launchers that run jobs in other processes (joblib, submitit, Ray) compose there too.
register_configs()


def fail(message: str, code: int = 2) -> None:
    from kvbench.results import safe_message

    print(f"kvbench: error: {safe_message(message)}", file=sys.stderr)
    raise SystemExit(code)


#: Environment variable naming the file where multirun jobs (in this or a launcher's worker process) append
#: one JSON line per failure; the launching process reads it once Hydra returns.
FAILURES_ENV = "KVBENCH_MULTIRUN_FAILURES"


def _job(cfg: DictConfig) -> Any:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kvbench.runner import run, validate_cfg

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    multirun = hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN
    try:
        summary = run(cfg, validate_cfg(cfg))
    except (KVBenchError, OmegaConfBaseException, OSError) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, KVBenchError):
            from kvbench.paths import os_error

            exc = os_error(exc)  # a directory that cannot be created, a cache that cannot be written: one line
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not multirun:
            fail(message)
        _record_failure(hydra_cfg, message)  # the other jobs run on; the launcher reports every failure
        return
    if multirun:
        _point_to_run(Path(hydra_cfg.runtime.output_dir), summary.attrs.get("run_dir"))
    return summary  # Hydra callbacks read it (kvbench.tracking: its run_dir)


def _point_to_run(job_dir: Path, run_dir: str | None) -> None:
    """``run`` (symlink) and ``run_dir.txt`` in a multirun job's directory: which run this job became."""
    if not run_dir:
        return
    target = Path(run_dir).resolve()
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "run_dir.txt").write_text(f"{target}\n")
    link = job_dir / "run"
    if link.is_symlink() or link.exists():
        link.unlink()
    with contextlib.suppress(OSError):  # a filesystem without symlinks: run_dir.txt is the pointer
        link.symlink_to(target, target_is_directory=True)


def _record_failure(hydra_cfg: DictConfig, message: str) -> None:
    job_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    from kvbench.results import safe_message

    print(safe_message(f"kvbench: error: job {hydra_cfg.job.num} ({' '.join(overrides)}): {message}"), file=sys.stderr)
    with contextlib.suppress(OSError):  # the failure may be this very directory; the list below still has it
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "error.txt").write_text(message + "\n")
    path = os.environ.get(FAILURES_ENV)
    if path:
        line = json.dumps({"num": int(hydra_cfg.job.num), "overrides": overrides, "error": message}) + "\n"
        with open(path, "a", encoding="utf-8") as fh:  # one short O_APPEND write per failure
            fh.write(line)


def _multirun(argv: list[str], overrides: list[str], n_jobs: int) -> None:
    """Run Hydra's multirun with ``.hydra/`` in every job dir; afterwards report every failed job, exit 1."""
    extra = [] if any(o.startswith("hydra.output_subdir=") for o in overrides) else ["hydra.output_subdir=.hydra"]
    fd, path = tempfile.mkstemp(prefix="kvbench-failures-", suffix=".jsonl")
    os.close(fd)
    os.environ[FAILURES_ENV] = path
    sys.argv = [sys.argv[0], *argv, *extra]
    try:
        try:
            _hydra_entry()()
        except SystemExit as exc:
            if exc.code:
                raise
        failures = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    finally:
        os.environ.pop(FAILURES_ENV, None)
        Path(path).unlink(missing_ok=True)
    if failures:
        print(f"kvbench: error: {len(failures)} of {n_jobs} job(s) failed (the others ran):", file=sys.stderr)
        for f in sorted(failures, key=lambda f: f["num"]):
            print(f"  job {f['num']} ({' '.join(f['overrides'])}): {f['error']}", file=sys.stderr)
        raise SystemExit(1)


#: The directories Hydra itself creates (``hydra.run.dir`` holds ``.hydra/`` when an output subdir is set).
HYDRA_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def _check_hydra_dirs(overrides: list[str]) -> None:
    """A ``hydra.run.dir``/``hydra.sweep.dir`` override Hydra could not create (``/proc/...``, a system
    directory) is one line before Hydra starts, not Hydra's traceback. Values with interpolations (the default
    ``${results_dir}/multirun/...``) are checked through ``results_dir``."""
    from kvbench.paths import check_output_dir

    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key.lstrip("+") in HYDRA_DIRS and "${" not in value:
            check_output_dir(value.strip("'\""), key.lstrip("+"))


def print_job_config(overrides: list[str]) -> None:
    """``--cfg job``: the composed config as the run uses it — interpolations resolved (``task.seed``, a task
    length fitted to the model) and each strategy's parameters as built (``compression_ratio: 0.5``, not the
    ``null`` that means "the default")."""
    from omegaconf import OmegaConf

    from kvbench.config import compose_config, resolve_strategies

    cfg = compose_config(overrides)
    built = {s.name: s.params() for s in resolve_strategies(cfg)}
    data = OmegaConf.to_container(cfg, resolve=True)
    if cfg.get("strategies"):
        data["strategies_params"] = {name: built[name] for name in map(str, cfg.strategies) if name in built}
    else:
        data["strategy"] = {"name": str(cfg.strategy.name), **built.get(str(cfg.strategy.name), {})}
    print(OmegaConf.to_yaml(OmegaConf.create(data)), end="")


def _hydra_entry() -> Callable[[], None]:
    return hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)


def help_text() -> str:
    groups = "\n".join(f"  {g:<9} {', '.join(group_options(g))}" for g in GROUPS)
    tools = "\n".join(f"  kvbench {name:<12} {text}" for name, text in SUBCOMMAND_HELP.items())
    return f"""kvbench: benchmark KV-cache strategies (quantization, eviction, tiering, recompute) for memory, latency
and accuracy on long documents.

Run a benchmark (Hydra overrides; `full` is always run as the baseline):
  python -m kvbench strategy=int8 task=legal
  python -m kvbench strategies=[int8,snapkv] strategies_params.snapkv.compression_ratio=0.75 task=papers
  python -m kvbench -m strategy=int8,int4 task=legal,papers      # multirun: one job per combination
  python -m kvbench -m 'strategy=glob(int*)' 'task.context_tokens=range(1024,4097,1024)'

Groups (select with group=name, override settings with group.key=value):
{groups}
Other keys: seed, results_dir, engine.prefill (shared|chunked), engine.chunk_tokens, engine.warmup,
  engine.reuse_baseline, engine.progress, engine.attention (auto|sdpa|kvbench),
  engine.linear (auto|native|float32|upcast), strategies, strategies_params.

Tools:
{tools}
  (`kvbench <tool> --help` for each)

Flags: -m/--multirun, --cfg job (print the composed config), --info, --hydra-help (Hydra's own flags).
Docs: README.md, docs/ (checklists for adding a strategy, task, metric or hardware profile: docs/checklists/).
"""


def main(argv: list[str] | None = None) -> None:
    from kvbench.spec import bound_heap_growth

    bound_heap_growth()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        try:
            module = importlib.import_module(SUBCOMMANDS[argv[0]])
            raise SystemExit(module.main(argv[1:]))
        except KVBenchError as exc:
            fail(str(exc))
    if "--help" in argv or "-h" in argv:
        print(help_text())
        raise SystemExit(0)
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    n_jobs = 1
    if not (args.hydra_help or args.info or args.shell_completion):
        try:
            _check_hydra_dirs(args.overrides)
            # Printing the config (--cfg job|hydra|all) runs no job, so the task's data is not read for it.
            n_jobs = check_overrides(args.overrides, multirun=args.multirun, samples=not args.cfg)
        except KVBenchError as exc:
            job = getattr(exc, "job", None)
            fail(f"job {' '.join(job)}: {exc}" if args.multirun and job else str(exc))
        except OSError as exc:  # preparing a job's samples met the filesystem (an unwritable cache)
            from kvbench.paths import os_error

            fail(str(os_error(exc)))
    if args.cfg == "job" and not args.multirun and not args.package:
        try:
            print_job_config(args.overrides)
        except KVBenchError as exc:
            fail(str(exc))
        raise SystemExit(0)
    if args.multirun and not (args.cfg or args.hydra_help or args.info or args.shell_completion):
        _multirun(argv, args.overrides, n_jobs)
        return
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()()


def console_main() -> None:
    interruptible(main)


def interruptible(entry: Callable[[], None]) -> None:
    """Ctrl-C ends with one line, never a traceback: every sample finished so far is already stored whole
    (records are appended one complete sample at a time), and rerunning the same command resumes."""
    try:
        entry()
    except KeyboardInterrupt:
        print("\nkvbench: interrupted; every finished sample is kept, and the same command resumes from there",
              file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:
        # The reader closed our stdout (`kvbench --help | head -3`): what it wanted is printed, so end quietly, as
        # command-line tools do; stdout goes to /dev/null so the interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0) from None
