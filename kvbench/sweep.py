"""Named sweeps: a grid in ``conf/sweep/*.yaml`` expanded into Hydra multiruns, with the job count up front.

``kvbench sweep conf/sweep/paper.yaml [--dry-run] [--launcher joblib] [-- extra hydra overrides]``

A sweep file has

* ``overrides`` — Hydra overrides applied to every job (``model=smollm2-135m``);
* ``axes`` — ``key: sweep`` pairs crossed with every block (``task: legal,papers,fiction``);
* ``blocks`` — named sub-grids, each a product of its own ``key: sweep`` pairs. Blocks exist because
  parameters differ between strategies: ``strategy.compression_ratio`` is swept for eviction strategies
  only, quantizers have no such parameter.
* ``launcher`` (default ``basic``), ``launcher_overrides`` (per launcher name: the Hydra overrides it gets,
  e.g. ``joblib: [hydra.launcher.n_jobs=2]``), and ``estimate`` (seconds, see :func:`estimate_seconds`).

Values use Hydra's own sweep syntax (``a,b,c``, ``range(1,4)``, ``choice(...)``, ``glob(...)``) and are
expanded by Hydra's own parser and :class:`BasicSweeper` logic, so the count printed is exactly the
number of jobs Hydra launches. Each block is one ``python -m kvbench -m ...`` multirun; blocks run one
after another, jobs inside a block run as the launcher allows. Jobs are idempotent (the run id hashes
everything that determines the records), so re-running a sweep skips finished jobs and resumes partial
ones, and stores from several machines merge (:func:`kvbench.results.read_store`).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import KVBenchError

#: ``--launcher`` choices: Hydra launcher plugin config names and the pip package providing each.
LAUNCHERS = {
    "basic": None,
    "joblib": "hydra-joblib-launcher",
    "submitit_local": "hydra-submitit-launcher",
    "submitit_slurm": "hydra-submitit-launcher",
    "ray": "hydra-ray-launcher",
}
#: Fallback cost model when the store has nothing to calibrate from (embedded model on a 2-core CPU).
DEFAULT_ESTIMATE = {"startup_s": 20.0, "sample_s_per_1k_tokens": 3.0, "context_tokens": 2048, "n_samples": 10}


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
    estimate: dict[str, float] = field(default_factory=dict)

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


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of ``overrides`` (one override list per job)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        return BasicSweeper.split_arguments(parsed, None)[0]
    except HydraException as exc:
        raise KVBenchError(f"bad sweep override in {overrides}: {str(exc).splitlines()[0]}") from None


def load_sweep(path: str | Path, launcher: str | None = None, extra: list[str] | None = None) -> Sweep:
    """Read a sweep file and expand every block into its jobs; duplicate jobs are an error."""
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
    unknown = sorted(set(data) - {"name", "overrides", "axes", "blocks", "launcher", "launcher_overrides",
                                  "estimate", "description"})
    if unknown:
        raise KVBenchError(f"{p}: unknown key {', '.join(unknown)}; valid: name, description, overrides, axes, "
                           "blocks, launcher, launcher_overrides, estimate")
    fixed = [str(o) for o in data.get("overrides") or []] + list(extra or [])
    axes = [f"{k}={_sweep_value(v)}" for k, v in (data.get("axes") or {}).items()]
    raw_blocks = data.get("blocks") or {"all": {}}
    if not isinstance(raw_blocks, dict):
        raise KVBenchError(f"{p}: blocks must map a block name to its key: sweep pairs")
    blocks = []
    seen: dict[frozenset[str], str] = {}
    for name, grid in raw_blocks.items():
        overrides = fixed + axes + [f"{k}={_sweep_value(v)}" for k, v in (grid or {}).items()]
        block = Block(str(name), overrides, expand(overrides))
        for job in block.jobs:
            key = frozenset(job)
            if key in seen:
                raise KVBenchError(f"{p}: job {' '.join(sorted(job))} appears in blocks {seen[key]!r} and "
                                   f"{name!r}; each job must be listed once (it would run twice at once)")
            seen[key] = str(name)
        blocks.append(block)
    chosen = launcher or str(data.get("launcher", "basic"))
    if chosen not in LAUNCHERS:
        raise KVBenchError(f"unknown launcher {chosen!r}; valid: {', '.join(LAUNCHERS)}")
    per_launcher = data.get("launcher_overrides") or {}
    if not isinstance(per_launcher, dict):
        raise KVBenchError(f"{p}: launcher_overrides must map a launcher name to its overrides")
    launcher_overrides = [str(o) for o in per_launcher.get(chosen) or []]
    return Sweep(str(data.get("name", p.stem)), blocks, chosen, launcher_overrides,
                 {**DEFAULT_ESTIMATE, **(data.get("estimate") or {})})


def _job_value(job: list[str], key: str, default: float) -> float:
    for o in job:
        k, _, v = o.partition("=")
        if k.lstrip("+~") == key:
            try:
                return float(v)
            except ValueError:
                return default
    return default


def calibrate(results_dir: str | Path) -> float | None:
    """Measured seconds per sample per strategy per 1k context tokens, from the result store (median), or
    ``None`` when the store has no timed records."""
    try:
        from kvbench.results import read_store

        df = read_store(results_dir)
    except Exception:  # an unreadable store only costs the calibration
        return None
    need = {"prefill_s", "compress_s", "query_s", "decode_ms_per_token", "decode_steps", "context_tokens"}
    if df.empty or not need <= set(df.columns):
        return None
    seconds = (df["prefill_s"].fillna(0) + df["compress_s"].fillna(0) + df["query_s"].fillna(0)
               + df["decode_ms_per_token"].fillna(0) * df["decode_steps"].fillna(0) / 1000)
    per_1k = (seconds / (df["context_tokens"] / 1000)).replace([math.inf, -math.inf], math.nan).dropna()
    return float(per_1k.median()) if not per_1k.empty else None


def estimate_seconds(sweep: Sweep, results_dir: str | Path = "results") -> tuple[float, str]:
    """Serial seconds for the whole sweep and where the per-sample rate came from.

    Each job loads the model (``startup_s``) and evaluates ``n_samples`` samples for its strategy plus the
    ``full`` baseline (reused from the baseline cache after the first job of a task and length, so counted
    once per job here as prefill + strategy).
    """
    est = sweep.estimate
    rate = calibrate(results_dir)
    source = f"measured in {results_dir}/store" if rate is not None else "sweep file / defaults"
    rate = rate if rate is not None else float(est["sample_s_per_1k_tokens"])
    total = 0.0
    for block in sweep.blocks:
        for job in block.jobs:
            ctx = _job_value(job, "task.context_tokens", float(est["context_tokens"]))
            n = _job_value(job, "task.n_samples", float(est["n_samples"]))
            total += float(est["startup_s"]) + n * 2 * rate * ctx / 1000
    return total, source


def _fmt_duration(seconds: float) -> str:
    h, rem = divmod(int(round(seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def commands(sweep: Sweep, python: str = sys.executable) -> list[list[str]]:
    """One ``python -m kvbench -m ...`` command per block, with its own sweep directory."""
    out = []
    for i, block in enumerate(sweep.blocks):
        launcher = [] if sweep.launcher == "basic" else [f"hydra/launcher={sweep.launcher}"]
        out.append([python, "-m", "kvbench", "-m", *block.overrides, *launcher, *sweep.launcher_overrides,
                    f"hydra.sweep.dir=${{results_dir}}/multirun/{sweep.name}/{i:02d}-{block.name}"])
    return out


def parallelism(sweep: Sweep) -> int:
    """Jobs running at once under the chosen launcher (for the wall-time estimate)."""
    for o in sweep.launcher_overrides:
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
        epilog="Anything after `--` is passed to every job as a Hydra override "
               "(e.g. -- hydra.launcher.n_jobs=2 hardware.threads=1).")
    parser.add_argument("sweep", help="sweep YAML (e.g. conf/sweep/paper.yaml) or a name in conf/sweep/")
    parser.add_argument("--dry-run", action="store_true", help="print the job count, estimate and commands only")
    parser.add_argument("--launcher", choices=list(LAUNCHERS), default=None,
                        help="Hydra launcher (default: the sweep file's, else basic)")
    parser.add_argument("--results-dir", default="results", help="store used to calibrate the time estimate")
    parser.add_argument("--list", action="store_true", help="also print every job's overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        sweep = load_sweep(args.sweep, args.launcher, extra)
        _check_launcher(sweep.launcher)
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        return 2
    serial, source = estimate_seconds(sweep, args.results_dir)
    par = parallelism(sweep)
    print(f"sweep {sweep.name}: {sweep.n_jobs} jobs in {len(sweep.blocks)} multirun(s), launcher {sweep.launcher}")
    for block in sweep.blocks:
        print(f"  {block.name}: {len(block.jobs)} jobs")
        if args.list:
            for job in block.jobs:
                print("    " + " ".join(job))
    print(f"estimate: {_fmt_duration(serial)} of job time ({source}); "
          f"~{_fmt_duration(serial / par)} wall at {par} job(s) at once. Finished jobs are skipped.")
    cmds = commands(sweep)
    for cmd in cmds:
        print("$ " + shlex.join(cmd[0:1] + cmd[1:]))
    if args.dry_run:
        return 0
    for cmd in cmds:
        rc = subprocess.run(cmd, check=False).returncode
        if rc != 0:
            print(f"kvbench: error: multirun exited with status {rc}: {shlex.join(cmd)}", file=sys.stderr)
            return rc
    return 0


def _check_launcher(name: str) -> None:
    """A missing launcher plugin is one line naming the package, not Hydra's config-group error."""
    package = LAUNCHERS[name]
    if package is None:
        return
    module = "hydra_plugins." + package.replace("-", "_")
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise KVBenchError(f"launcher {name!r} needs the Hydra plugin {package}: pip install {package}")


if __name__ == "__main__":
    raise SystemExit(main())
