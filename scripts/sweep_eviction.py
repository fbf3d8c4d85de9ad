"""Sweep every eviction strategy (and one eviction + quantization composition) over compression ratios.

One ``python -m kvbench strategies=[...] strategies_params.compression_ratio=<r>`` job per (task, ratio),
so every eviction strategy shares each sample's prefill and the ``full`` baseline (reused from the baseline
store after the first job); the composition runs as its own job. Each job's
``results/runs/<run-id>/summary.csv`` is read back and the table — accuracy, accuracy delta against ``full`` (paired, percentage points), measured memory
reduction, KL to ``full``, time to first token and decode latency — is written to
``results/eviction_sweep.csv`` and ``results/eviction_sweep.md``.

Usage::

    python scripts/sweep_eviction.py                      # all tasks in conf/task, all strategies
    python scripts/sweep_eviction.py --tasks legal --ratios 0.5,0.875 --extra task.n_samples=4
    python scripts/sweep_eviction.py --dry-run            # print the commands only
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RATIOS = (0.25, 0.5, 0.75, 0.875)
STRATEGIES = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random")
#: The composition swept alongside: SnapKV eviction, then int8 storage of the kept tokens.
COMPOSE = ("compose", "snapkv", "int8")
COLUMNS = ["task", "strategy", "ratio", "label", "n", "accuracy", "baseline_accuracy", "delta_pp",
           "delta_ci_low", "delta_ci_high", "memory_reduction", "kept_fraction", "kl", "top1_agreement",
           "ttft_s", "decode_ms_per_token"]
RESULTS_LINE = re.compile(r"^results:\s*(\S+)\s*$", re.MULTILINE)


@dataclass
class Job:
    task: str
    strategy: str
    ratio: float
    overrides: list[str] = field(default_factory=list)

    def command(self, python: str, extra: list[str]) -> list[str]:
        return [python, "-m", "kvbench", f"task={self.task}", *self.overrides, "engine.progress=false", *extra]


def jobs(tasks: list[str], names: list[str], ratios: list[float], compose: bool) -> list[Job]:
    """One job per (task, ratio) running every eviction strategy on the same prefills, plus the compose job."""
    out = []
    for task in tasks:
        for ratio in ratios:
            out.append(Job(task, "*", ratio, [f"strategies=[{','.join(names)}]",
                                              f"strategies_params.compression_ratio={ratio}"]))
            if compose:
                kind, evict, quant = COMPOSE
                out.append(Job(task, f"{kind}:{evict}+{quant}", ratio, [
                    f"strategy={kind}", f"strategy.evict={evict}", f"strategy.quantize={quant}",
                    f"strategy.evict_params.compression_ratio={ratio}"]))
    return out


def default_tasks() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "task").glob("*.yaml"))


def run_dir_from_output(stdout: str, results_dir: Path, started: float) -> Path | None:
    """The run directory a job printed (``results: <dir>``), else the newest one written since it started."""
    found = RESULTS_LINE.findall(stdout)
    if found:
        path = Path(found[-1])
        return path if path.is_absolute() else ROOT / path
    runs = [p for p in (results_dir / "runs").glob("*/summary.csv") if p.stat().st_mtime >= started]
    return max(runs, key=lambda p: p.stat().st_mtime).parent if runs else None


def rows_from_run(run_dir: Path, strategy: str, ratio: float) -> list[dict]:
    """The non-baseline rows of a run's ``summary.csv``, tagged with the sweep's strategy and ratio."""
    summary = pd.read_csv(run_dir / "summary.csv")
    rows = []
    for rec in summary.to_dict("records"):
        if rec["strategy"] == "full":
            continue
        base = summary[(summary["task"] == rec["task"]) & (summary["strategy"] == "full")]
        name = rec["strategy"].split("(", 1)[0] if strategy == "*" else strategy
        rows.append({**{c: rec.get(c) for c in COLUMNS if c in rec}, "label": rec["strategy"],
                     "strategy": name, "ratio": ratio,
                     "baseline_accuracy": float(base["accuracy"].iloc[0]) if len(base) else float("nan")})
    return rows


def build_table(rows: list[dict]) -> pd.DataFrame:
    table = pd.DataFrame(rows)
    for c in COLUMNS:
        if c not in table:
            table[c] = float("nan")
    return table[COLUMNS].sort_values(["task", "strategy", "ratio"]).reset_index(drop=True)


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def to_markdown(table: pd.DataFrame, failed: list[str] | None = None) -> str:
    lines = ["# Eviction sweep", "",
             "Accuracy delta is paired against the `full` baseline on the same samples (percentage points, "
             "95% bootstrap CI); memory reduction is measured from the bytes each cache holds after "
             "compression, against a dense 16-bit cache of the same tokens.", ""]
    for task, grp in table.groupby("task", sort=True):
        base = grp["baseline_accuracy"].dropna()
        lines += [f"## {task}" + (f" (full: accuracy {base.iloc[0]:.3f})" if len(base) else ""), "",
                  "| strategy | ratio | accuracy | delta pp (95% CI) | memory reduction | KL | TTFT s | "
                  "decode ms/tok |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in grp.itertuples():
            ci = f"{_fmt(r.delta_pp, '+.1f')} [{_fmt(r.delta_ci_low, '+.1f')}, {_fmt(r.delta_ci_high, '+.1f')}]"
            lines.append(f"| {r.strategy} | {r.ratio} | {_fmt(r.accuracy, '.3f')} | {ci} | "
                         f"{_fmt(100 * r.memory_reduction, '.1f')}% | {_fmt(r.kl, '.4f')} | "
                         f"{_fmt(r.ttft_s, '.2f')} | {_fmt(r.decode_ms_per_token, '.1f')} |")
        lines.append("")
    if failed:
        lines += ["## Failed jobs", "", *[f"- `{f}`" for f in failed], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: every conf/task/*.yaml)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated eviction strategies")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated compression ratios")
    ap.add_argument("--no-compose", action="store_true", help=f"skip the {COMPOSE[1]} + {COMPOSE[2]} rows")
    ap.add_argument("--extra", action="append", default=[], help="extra override for every job (repeatable)")
    ap.add_argument("--results-dir", default="results", help="kvbench's results_dir")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)

    tasks = args.tasks.split(",") if args.tasks else default_tasks()
    if not tasks:
        print("no tasks: pass --tasks or add conf/task/*.yaml", file=sys.stderr)
        return 2
    results_dir = Path(args.results_dir)
    results_dir = results_dir if results_dir.is_absolute() else ROOT / results_dir
    extra = [*args.extra, f"results_dir={results_dir}"]
    todo = jobs(tasks, [s for s in args.strategies.split(",") if s],
                [float(r) for r in args.ratios.split(",")], not args.no_compose)
    rows: list[dict] = []
    failed: list[str] = []
    for i, job in enumerate(todo, 1):
        cmd = job.command(args.python, extra)
        shown = " ".join(cmd[1:])
        print(f"[{i}/{len(todo)}] {shown}", flush=True)
        if args.dry_run:
            continue
        started = time.time() - 1
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        run_dir = run_dir_from_output(proc.stdout, results_dir, started) if proc.returncode == 0 else None
        if run_dir is None or not (run_dir / "summary.csv").is_file():
            reason = (proc.stderr.strip().splitlines() or ["no summary.csv"])[-1]
            print(f"  failed: {reason}", file=sys.stderr)
            failed.append(f"{shown}: {reason}")
            continue
        rows += rows_from_run(run_dir, job.strategy, job.ratio)
    if args.dry_run:
        return 0
    table = build_table(rows)
    results_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(results_dir / "eviction_sweep.csv", index=False)
    (results_dir / "eviction_sweep.md").write_text(to_markdown(table, failed))
    print(f"wrote {results_dir / 'eviction_sweep.md'} ({len(table)} rows, {len(failed)} failed jobs)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
