"""Named sweeps: a grid in ``conf/sweep/*.yaml`` expanded into Hydra multiruns, with the job count up front.

``kvbench sweep conf/sweep/paper.yaml [--dry-run] [--launcher joblib] [-- extra hydra overrides]``

A sweep file has

* ``overrides`` — Hydra overrides applied to every job (``model=smollm2-135m``);
* ``axes`` — ``key: sweep`` pairs crossed with every block (``task: legal,papers,fiction``);
* ``blocks`` — named sub-grids, each a product of its own ``key: sweep`` pairs. Blocks exist because
  parameters differ between strategies: ``strategy.compression_ratio`` is swept for eviction strategies
  only, quantizers have no such parameter.
* ``launcher`` (default ``basic``) and ``launcher_overrides`` (per launcher name: the Hydra overrides it gets,
  e.g. ``joblib: [hydra.launcher.n_jobs=2, hardware.threads=1]``: jobs at once and each job's threads, so part
  of every job's overrides and, through ``hardware.threads``, of its run identity; ``--`` overrides win);
* ``per_round`` (default 0: every job runs to its ``task.n_samples`` in one pass) — run the grid in rounds, each
  job adding at most this many samples per round (``engine.max_new_samples``, not part of a run's identity; a
  sample is one question, and ``task.n_samples`` counts contexts when each carries several), so
  a sweep stopped between rounds leaves every job within ``per_round`` samples of the others. ``--per-round``
  overrides it; ``--rounds N`` runs N rounds (default: enough for the job with the most questions left).
* ``design`` (optional) — the sweep's pre-registered looks, for a sweep judged while it grows (spec v1.2 §2.5,
  :mod:`kvbench.sequential`): ``look_every`` contexts per task between looks, ``spending``
  (``obrien-fleming``, default, or ``pocock``); the planned contexts are the file's ``task.n_samples``.
  ``kvbench leaderboard --design <sweep>`` and ``kvbench plan --design <sweep>`` judge its store by it.

Values use Hydra's own sweep syntax (``a,b,c``, ``range(1,4)``, ``choice(...)``, ``glob(...)``) and are
expanded by Hydra's own parser and :class:`BasicSweeper` logic (``glob`` against the group's options), so the
count printed is exactly the number of jobs Hydra launches. Before anything runs, every job is composed and
checked as ``python -m kvbench`` checks it — its samples built with the model's tokenizer against the task's
own minimum length and the model's window — dry run or not: one impossible job refuses the whole sweep.
``--results-dir X`` is every job's ``results_dir`` (runs, store, multirun directories), not only the store the
projection reads. The time projection (:func:`project`) uses only
timings measured on this kind of machine: records in the result store for the same model, hardware and
context length; jobs with none are reported as not measured yet.

Each block is one ``python -m kvbench -m ...`` multirun; blocks run one after another, jobs inside a block
run as the launcher allows. A job failing at run time does not stop the others: every block runs, and the
failures are listed at the end with exit status 1. Jobs are idempotent (the run id hashes everything that
determines the records), so re-running a sweep skips finished jobs and resumes partial ones, and stores from
several machines merge (:func:`kvbench.results.read_store`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import KVBenchError
from kvbench.projection import JobInfo, Projection, _fmt_duration, project, projection_text  # noqa: F401
from kvbench.sequential import Design

#: ``--launcher`` choices: Hydra launcher plugin config names and the pip package providing each.
LAUNCHERS = {
    "basic": None,
    "joblib": "hydra-joblib-launcher",
    "submitit_local": "hydra-submitit-launcher",
    "submitit_slurm": "hydra-submitit-launcher",
    "ray": "hydra-ray-launcher",
}
#: How to install a launcher where ``pip install <package>`` is not it: hydra-ray-launcher 1.2.2 pins an older
#: major version of a serializer joblib 1.6 needs newer, so pip cannot resolve both (docs/scale-out.md, "Ray").
INSTALL = {"ray": "pip install 'ray<3' && pip install --no-deps hydra-ray-launcher"}
SWEEP_KEYS = ("name", "description", "overrides", "axes", "blocks", "launcher", "launcher_overrides", "per_round",
              "design")
#: The engine setting a round limits (``kvbench.config``'s ``engine.max_new_samples``).
ROUND_LIMIT = "engine.max_new_samples"


@dataclass
class Block:
    """One multirun: a name and its full override list (fixed overrides, axes, block sweeps)."""

    name: str
    overrides: list[str]
    jobs: list[list[str]] = field(default_factory=list)


@dataclass
class Sweep:
    name: str
    blocks: list[Block]
    launcher: str = "basic"
    launcher_overrides: list[str] = field(default_factory=list)
    per_round: int = 0  # samples each job adds per round; 0: no rounds
    design: Design | None = None  # its pre-registered looks (spec v1.2 §2.5); None: judged at a fixed n

    @property
    def n_jobs(self) -> int:
        return sum(len(b.jobs) for b in self.blocks)


def _sweep_value(value: Any) -> str:
    """A YAML value as Hydra override text: lists become ``a,b,c`` sweeps, scalars stay themselves."""
    if isinstance(value, (list, tuple)):
        return ",".join(_sweep_value(v) for v in value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def literal(value: str) -> str:
    """``value`` as a Hydra override value read literally: a plain path as it is, anything else quoted, so a
    comma is no sweep (``A,B`` stays one directory), its quotes escaped and ``${`` not an interpolation."""
    if re.fullmatch(r"[A-Za-z0-9_./~+@%:-]+", value):
        return value
    return "'" + value.replace("'", "\\'").replace("${", "\\${") + "'"


#: What a sweep or block name may be: one path component (the names are directories under results_dir/multirun).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_name(path: Path, what: str, name: str) -> str:
    if not _NAME.fullmatch(name) or ".." in name:
        raise KVBenchError(f"{path}: {what} {name!r} must be one path component of letters, digits, '_', '-' and "
                           "'.' (it names a directory under results_dir/multirun)")
    return name


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of ``overrides`` (one override list per job, ``hydra.*`` left out)."""
    from kvbench.config import hydra_context, parse_jobs

    try:
        with hydra_context() as loader:
            return parse_jobs(overrides, True, loader)
    except KVBenchError as exc:
        raise KVBenchError(f"bad sweep override in {overrides}: {exc}") from None


def load_sweep(path: str | Path, launcher: str | None = None, extra: list[str] | None = None,
               per_round: int | None = None) -> Sweep:
    """Read a sweep file and expand every block into its jobs; duplicate jobs are an error. ``per_round``
    (``--per-round``) replaces the file's."""
    p = Path(path)
    if not p.is_file():
        from kvbench.config import conf_dir

        named = conf_dir() / "sweep" / f"{path}.yaml"
        if not named.is_file():
            raise KVBenchError(f"no sweep file {path!r} (a path, or a name in {conf_dir() / 'sweep'})")
        p = named
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise KVBenchError(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if "estimate" in data:
        raise KVBenchError(f"{p}: `estimate` is no longer read: the projection comes from timings measured here "
                           "(the result store); remove it")
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise KVBenchError(f"{p}: unknown key {', '.join(unknown)}; valid: {', '.join(SWEEP_KEYS)}")
    fixed = [str(o) for o in data.get("overrides") or []]
    axes = [f"{k}={_sweep_value(v)}" for k, v in (data.get("axes") or {}).items()]
    raw_blocks = data.get("blocks") or {"all": {}}
    if not isinstance(raw_blocks, dict):
        raise KVBenchError(f"{p}: blocks must map a block name to its key: sweep pairs")
    chosen = launcher or str(data.get("launcher", "basic"))
    if chosen not in LAUNCHERS:
        raise KVBenchError(f"unknown launcher {chosen!r}; valid: {', '.join(LAUNCHERS)}")
    per_launcher = data.get("launcher_overrides") or {}
    if not isinstance(per_launcher, dict):
        raise KVBenchError(f"{p}: launcher_overrides must map a launcher name to its overrides")
    launcher_overrides = [str(o) for o in per_launcher.get(chosen) or []]
    blocks = []
    seen: dict[frozenset[str], str] = {}
    for name, grid in raw_blocks.items():
        _check_name(p, "block name", str(name))
        # The launcher's settings are part of every job (hardware.threads is part of its identity); `extra` last:
        # a key given again replaces the file's value or sweep (`-- task=legal` runs one task).
        overrides = (fixed + axes + [f"{k}={_sweep_value(v)}" for k, v in (grid or {}).items()]
                     + launcher_overrides + list(extra or []))
        block = Block(str(name), overrides, expand(overrides))
        for job in block.jobs:
            key = frozenset(job)
            if key in seen:
                raise KVBenchError(f"{p}: job {' '.join(sorted(job))} appears in blocks {seen[key]!r} and "
                                   f"{name!r}; each job must be listed once (it would run twice at once)")
            seen[key] = str(name)
        blocks.append(block)
    rounds = data.get("per_round", 0) if per_round is None else per_round
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise KVBenchError(f"{p}: per_round must be an integer >= 0 (got {rounds!r})")
    if rounds and any(o.startswith(ROUND_LIMIT + "=") for b in blocks for o in b.overrides):
        raise KVBenchError(f"{p}: {ROUND_LIMIT} is set by per_round (--per-round); do not also pass it")
    design = None
    if data.get("design") is not None:
        planned = [o.split("=", 1)[1] for b in blocks for o in b.overrides if o.startswith("task.n_samples=")]
        if len(set(planned)) > 1:
            raise KVBenchError(f"{p}: a design needs one planned task.n_samples for every job "
                               f"(got {', '.join(sorted(set(planned)))})")
        try:
            n = int(planned[-1]) if planned else None
        except ValueError:
            raise KVBenchError(f"{p}: task.n_samples must be an integer for a design (got {planned[-1]!r})") from None
        try:
            design = Design.from_mapping(data["design"], n)
        except KVBenchError as exc:
            raise KVBenchError(f"{p}: {exc}") from None
    return Sweep(_check_name(p, "sweep name", str(data.get("name", p.stem))), blocks, chosen, launcher_overrides,
                 rounds, design)


def load_design(path: str | Path) -> Design:
    """The sequential design of a sweep file (``--design`` of ``kvbench leaderboard`` and ``kvbench plan``):
    one line naming the problem when it has none."""
    sweep = load_sweep(path)
    if sweep.design is None:
        raise KVBenchError(f"sweep {path!r} declares no design (a `design:` block with look_every)")
    return sweep.design


def rounds_needed(sweep: Sweep, jobs: list[JobInfo]) -> int:
    """Rounds for the job with the most questions left to reach all of them (1 without ``per_round``; 0 when
    every job already has all its questions: a resumed sweep launches no round of jobs that find nothing to do,
    each of which would still load the model). ``per_round`` counts questions (``engine.max_new_samples``),
    ``task.n_samples`` counts contexts; ``done`` is what each job holds with every strategy."""
    if not sweep.per_round:
        return 1
    left = [max(0, j.n_questions - j.done) for j in jobs] or [1]
    return math.ceil(max(left) / sweep.per_round)


def describe_jobs(sweep: Sweep) -> list[JobInfo]:
    """Compose and check every job as ``python -m kvbench`` would (one-line :class:`KVBenchError` on the first
    bad one), and return what each job's cost depends on."""
    from kvbench.config import JobError, check_job, check_task_fits, compose_jobs, hydra_context, resolve_strategies

    where = {tuple(job): block.name for block in sweep.blocks for job in block.jobs}
    info: dict[tuple[str, ...], JobInfo] = {}
    with hydra_context():
        try:
            for job, cfg in compose_jobs([list(j) for j in where]):
                try:
                    check_job(cfg, job)
                    check_task_fits(cfg)
                except KVBenchError as exc:
                    raise JobError(str(exc), job) from None
                strategies = resolve_strategies(cfg)
                run_id, done = finished(cfg, strategies)
                info[tuple(job)] = JobInfo(
                    str(cfg.model.name), str(cfg.hardware.name), int(cfg.task.get("context_tokens") or 0),
                    int(cfg.task.get("n_samples") or 1), [(s.name, s.label()) for s in strategies],
                    str(cfg.results_dir), int(cfg.task.get("questions_per_context") or 1), done, run_id)
        except JobError as exc:
            raise KVBenchError(f"block {where[tuple(exc.job)]!r}, job {' '.join(exc.job)}: {exc}") from None
    return [info[tuple(job)] for block in sweep.blocks for job in block.jobs]


_MODELS: dict[str, Any] = {}  # one load per model for a sweep's jobs (the identity reads the checkpoint)


def finished(cfg: Any, strategies: list[Any]) -> tuple[str, int]:
    """``(run id, questions stored with every strategy)`` of a composed job, found exactly as the run itself
    would find them (:func:`kvbench.runner.run_identity`): the model's checkpoint is read for its identity,
    no sample is run. ``("", 0)`` when the model cannot be loaded (the run reports that itself)."""
    import json

    from kvbench.models import load_model
    from kvbench.results import RunStore, quiet_warnings
    from kvbench.runner import _hardware, run_identity

    try:
        profile, device = _hardware(cfg)
        dtype = cfg.model.get("dtype") or profile.dtype
        key = json.dumps([str(cfg.model.name), str(cfg.model.get("path")), dtype, device, int(cfg.seed),
                          cfg.model.get("attn_implementation")])
        if key not in _MODELS:
            _MODELS[key] = load_model(cfg.model.name, dtype=dtype, device=device, path=cfg.model.get("path"),
                                      seed=cfg.seed, attn_implementation=cfg.model.get("attn_implementation"))
        run_id = run_identity(cfg, _MODELS[key], strategies, profile, device, dtype).run_id
    except KVBenchError:
        return "", 0
    store = RunStore(Path(str(cfg.results_dir)).expanduser(), run_id)
    if not store.dir.is_dir():
        return run_id, 0
    labels = {s.label() for s in strategies}
    with quiet_warnings():
        records = store.load_records(quiet=True)
    seen: dict[str, set[str]] = {}
    for r in records:
        seen.setdefault(str(r.get("sample_id")), set()).add(str(r.get("strategy")))
    return run_id, sum(1 for got in seen.values() if labels <= got)


def commands(sweep: Sweep, python: str = sys.executable, stamp: str | None = None,
             round_no: int = 1) -> list[list[str]]:
    """One ``python -m kvbench -m ...`` command per block, with its own sweep directory under one timestamp (a
    re-run never overwrites an earlier run's ``multirun.yaml``; finished jobs are still skipped). With
    ``per_round``, round ``round_no``'s: the round limit added, its directories under ``round-NN/``."""
    import time

    stamp = stamp or time.strftime("%Y-%m-%d_%H-%M-%S")
    where = f"{stamp}/round-{round_no:02d}" if sweep.per_round else stamp
    limit = [f"{ROUND_LIMIT}={sweep.per_round}"] if sweep.per_round else []
    out = []
    for i, block in enumerate(sweep.blocks):
        launcher = [] if sweep.launcher == "basic" else [f"hydra/launcher={sweep.launcher}"]
        out.append([python, "-m", "kvbench", "-m", *block.overrides, *limit, *launcher,
                    f"hydra.sweep.dir=${{results_dir}}/multirun/{sweep.name}/{where}/{i:02d}-{block.name}"])
    return out


def job_runs(results_dir: str | Path, name: str) -> list[tuple[list[str], Path | None, str]]:
    """The jobs of the newest run of sweep ``name`` under ``results_dir/multirun/``: per job its overrides, the
    run directory it became (None when it failed) and, when it failed, the last line of its ``error.txt``. A
    job run in several rounds is listed once, as its last round left it."""
    runs = Path(results_dir) / "multirun" / name
    stamps = sorted(p for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
    if not stamps:
        raise KVBenchError(f"no run of sweep {name!r} under {runs} (run `kvbench sweep {name}` first)")
    out: dict[tuple[str, ...], tuple[list[str], Path | None, str]] = {}
    for job in sorted(p.parent.parent for p in stamps[-1].rglob(".hydra/overrides.yaml")):
        overrides = [str(o) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []]
        overrides = [o for o in overrides if not o.startswith(ROUND_LIMIT + "=")]
        pointer, error = job / "run_dir.txt", job / "error.txt"
        run = Path(pointer.read_text().strip()) if pointer.is_file() else None
        reason = "" if run else ((error.read_text().strip().splitlines() or [""])[-1] if error.is_file()
                                 else "no run_dir.txt (not finished)")
        out[tuple(overrides)] = (overrides, run, reason)
    return list(out.values())


def parallelism(sweep: Sweep) -> int:
    """Jobs running at once under the chosen launcher (for the wall-time estimate): the last setting given, the
    file's launcher_overrides or one after ``--``."""
    given = sweep.blocks[0].overrides if sweep.blocks else sweep.launcher_overrides
    for o in reversed(given):
        for key in ("hydra.launcher.n_jobs", "hydra.launcher.array_parallelism"):
            if o.startswith(key + "="):
                try:
                    n = int(o.split("=", 1)[1])
                except ValueError:
                    continue
                return max(n, 1) if n > 0 else (os.cpu_count() or 1)
    if sweep.launcher == "joblib":
        return os.cpu_count() or 1
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbench sweep", description="Run a named grid of benchmark jobs as Hydra multiruns.",
        epilog="Anything after `--` is passed to every job as a Hydra override, replacing the file's value or "
               "sweep of the same key (e.g. -- hydra.launcher.n_jobs=2 hardware.threads=1 task=legal).")
    parser.add_argument("sweep", help="sweep YAML (e.g. conf/sweep/paper.yaml) or a name in conf/sweep/")
    parser.add_argument("--dry-run", action="store_true", help="print the job count, estimate and commands only")
    parser.add_argument("--launcher", choices=list(LAUNCHERS), default=None,
                        help="Hydra launcher (default: the sweep file's, else basic)")
    parser.add_argument("--results-dir", default=None,
                        help="every job's results_dir (runs, store, multirun dirs) and the store whose timings "
                             "project the time (default: the jobs' own results_dir)")
    parser.add_argument("--list", action="store_true", help="also print every job's overrides")
    parser.add_argument("--per-round", type=int, default=None, metavar="K",
                        help=f"each job adds at most K samples per round ({ROUND_LIMIT}, not part of a run's "
                             "identity; default: the sweep file's per_round; 0: no rounds)")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help="run N rounds (needs per_round; default: enough for the job with the most questions left)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if args.results_dir is not None:  # last, so it wins over a results_dir in the sweep file
        extra.append(f"results_dir={literal(args.results_dir)}")
    try:
        if args.per_round is not None and args.per_round < 0:
            raise KVBenchError(f"--per-round must be >= 0 (got {args.per_round})")
        sweep = load_sweep(args.sweep, args.launcher, extra, args.per_round)
        if args.rounds is not None and (args.rounds < 1 or not sweep.per_round):
            raise KVBenchError(f"--rounds must be >= 1 (got {args.rounds})" if args.rounds < 1 else
                               "--rounds needs per_round in the sweep file or --per-round K (samples per round)")
        _check_launcher(sweep.launcher)
        jobs = describe_jobs(sweep)
    except KVBenchError as exc:
        from kvbench.results import safe_message

        print(f"kvbench: error: {safe_message(exc)}", file=sys.stderr)
        return 2
    par = parallelism(sweep)
    n_rounds = args.rounds or rounds_needed(sweep, jobs)
    print(f"sweep {sweep.name}: {sweep.n_jobs} jobs in {len(sweep.blocks)} multirun(s), launcher {sweep.launcher}"
          + (f"; {n_rounds} round(s), each job adding up to {sweep.per_round} samples (questions) per round"
             if sweep.per_round else ""))
    if sweep.design is not None:
        print(f"  judged group-sequentially (spec v1.2 §2.5): {sweep.design.describe()}; "
              f"kvbench leaderboard --design {sweep.name}")
    for block in sweep.blocks:
        print(f"  {block.name}: {len(block.jobs)} jobs")
        if args.list:
            for job in block.jobs:
                print("    " + " ".join(job))
    store = args.results_dir or (jobs[0].results_dir if jobs else "results")
    complete = [j for j in jobs if j.done >= j.n_questions]
    print(f"done: {len(complete)} of {len(jobs)} jobs finished, "
          f"{sum(min(j.done, j.n_questions) for j in jobs)} of {sum(j.n_questions for j in jobs)} questions stored "
          f"with all their strategies in {store}")
    if args.list:
        for j in jobs:
            print(f"    {j.run_id or '(model not loadable)'}: {min(j.done, j.n_questions)} of {j.n_questions}")
    print(projection_text(project(jobs, store), len(jobs), par))
    import time

    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    rounds = [commands(sweep, stamp=stamp, round_no=r) for r in range(1, n_rounds + 1)]
    for cmd in (c for cmds in rounds for c in cmds):
        print("$ " + shlex.join(cmd))
    if not rounds:
        print("nothing to run: every job holds all its questions")
    if args.dry_run:
        return 0
    for r, cmds in enumerate(rounds, 1):
        if n_rounds > 1:
            print(f"round {r} of {n_rounds}", flush=True)
        failed = []
        for block, cmd in zip(sweep.blocks, cmds, strict=True):
            rc = subprocess.run(cmd, check=False).returncode
            if rc != 0:  # its failed jobs are listed above; the other blocks still run
                failed.append(f"{block.name} (status {rc})")
        if failed:  # a later round would fail the same jobs again; the finished ones are kept
            stopped = f" (stopped after round {r} of {n_rounds})" if n_rounds > 1 else ""
            print(f"kvbench: error: {len(failed)} of {len(cmds)} multirun(s) had failed jobs: {', '.join(failed)}"
                  + stopped, file=sys.stderr)
            return 1
    return 0


def _check_launcher(name: str) -> None:
    """A missing launcher plugin is one line naming the package, not Hydra's config-group error."""
    package = LAUNCHERS[name]
    if package is None:
        return
    module = "hydra_plugins." + package.replace("-", "_")
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise KVBenchError(f"launcher {name!r} needs the Hydra plugin {package}: "
                           f"{INSTALL.get(name, f'pip install {package}')}")


if __name__ == "__main__":
    raise SystemExit(main())
