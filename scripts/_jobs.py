"""Shared by the benchmark scripts that tabulate runs (and bench_quantization.py's one-job-at-a-time loop; the
committed grids run through ``kvbench sweep`` and conf/sweep/*.yaml instead).

Imported as a sibling module (``import _jobs``): running ``python scripts/<name>.py`` puts this directory on
``sys.path``, and tests that import a script put it there themselves.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pandas as pd

from kvbench import fmt as kvfmt

ROOT = Path(__file__).resolve().parents[1]
RESULTS_LINE = re.compile(r"^results:\s*(\S+)\s*$", re.MULTILINE)


class Job(Protocol):
    def command(self, python: str, extra: list[str]) -> list[str]: ...


def kvbench_command(python: str, task: str, overrides: list[str], extra: list[str]) -> list[str]:
    """One job's ``python -m kvbench`` command line: the task, the job's overrides, no progress bars, ``extra``."""
    return [python, "-m", "kvbench", f"task={task}", *overrides, "engine.progress=false", *extra]


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """``--extra``, ``--results-dir``, ``--python`` and ``--dry-run``."""
    ap.add_argument("--extra", action="append", default=[], help="extra override for every job (repeatable)")
    ap.add_argument("--results-dir", default="results", help="kvbench's results_dir")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--dry-run", action="store_true")


def task_list(tasks: str | None, default: Callable[[], list[str]]) -> list[str]:
    """``--tasks`` split on commas, else ``default()``; says on stderr what to do when that leaves none."""
    out = tasks.split(",") if tasks else default()
    if not out:
        print("no tasks: pass --tasks or add conf/task/*.yaml", file=sys.stderr)
    return out


def resolve_results_dir(results_dir: str) -> Path:
    """``--results-dir``, relative paths taken from the repository root (where the jobs run)."""
    path = Path(results_dir)
    return path if path.is_absolute() else ROOT / path


def run_dir_from_output(stdout: str, results_dir: Path, started: float) -> Path | None:
    """The run directory a job printed (``results: <dir>``), else the newest one written since it started."""
    found = RESULTS_LINE.findall(stdout)
    if found:
        path = Path(found[-1])
        return path if path.is_absolute() else ROOT / path
    runs = [p for p in (results_dir / "runs").glob("*/summary.csv") if p.stat().st_mtime >= started]
    return max(runs, key=lambda p: p.stat().st_mtime).parent if runs else None


def run_jobs(todo: Sequence[Job], python: str, extra: list[str], results_dir: Path, dry_run: bool,
             collect: Callable[[Any, Path], list[dict]]) -> tuple[list[dict], list[tuple[str, str]]]:
    """Run each job in turn (or only print its command with ``dry_run``); ``collect(job, run_dir)`` turns a
    finished run into table rows. Returns the rows and, per failed job, its shown command and the reason."""
    rows: list[dict] = []
    failed: list[tuple[str, str]] = []
    for i, job in enumerate(todo, 1):
        cmd = job.command(python, extra)
        shown = " ".join(cmd[1:])
        print(f"[{i}/{len(todo)}] {shown}", flush=True)
        if dry_run:
            continue
        started = time.time() - 1
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        run_dir = run_dir_from_output(proc.stdout, results_dir, started) if proc.returncode == 0 else None
        if run_dir is None or not (run_dir / "summary.csv").is_file():
            reason = (proc.stderr.strip().splitlines() or ["no summary.csv"])[-1]
            print(f"  failed: {reason}", file=sys.stderr)
            failed.append((shown, reason))
            continue
        rows += collect(job, run_dir)
    return rows, failed


def baseline_pairs(summary: pd.DataFrame) -> Iterator[tuple[dict, pd.DataFrame]]:
    """Each non-``full`` record of a run's summary with the summary's ``full`` row(s) for the same task."""
    for rec in summary.to_dict("records"):
        if rec["strategy"] == "full":
            continue
        yield rec, summary[(summary["task"] == rec["task"]) & (summary["strategy"] == "full")]


def first(frame: pd.DataFrame, column: str) -> float:
    """``frame[column]``'s first value as a float, NaN when ``frame`` is empty."""
    return float(frame[column].iloc[0]) if len(frame) else float("nan")


def with_columns(rows: list[dict], columns: list[str]) -> pd.DataFrame:
    """``rows`` as a frame of exactly ``columns`` (NaN where no row has one)."""
    table = pd.DataFrame(rows)
    for c in columns:
        if c not in table:
            table[c] = float("nan")
    return table[columns]


def fmt(v: object, spec: str) -> str:
    """``v`` formatted with ``spec``; ``-`` when missing (:func:`kvbench.fmt.number`)."""
    return kvfmt.number(v, spec, kvfmt.MISSING_ASCII)


def delta_ci(r: Any) -> str:
    """A row's paired accuracy delta with its CI: ``-25.0 [-50.0, +0.0]``."""
    return kvfmt.interval(r.delta_pp, r.delta_ci_low, r.delta_ci_high, missing=kvfmt.MISSING_ASCII)


def to_markdown(title: str, intro: str, table: pd.DataFrame, headers: list[str], row: Callable[[Any], str],
                notes_title: str, notes: list[str]) -> str:
    """The report: ``title``, ``intro``, then per task (with ``full``'s accuracy when the rows carry it) one
    table of ``headers`` with a ``row(r)`` line per table row, then ``notes`` (markdown items) if any."""
    lines = [f"# {title}", "", intro, ""]
    for task, grp in table.groupby("task", sort=True):
        base = grp["baseline_accuracy"].dropna()
        lines += [f"## {task}" + (f" (full: accuracy {base.iloc[0]:.3f})" if len(base) else ""), "",
                  "| " + " | ".join(headers) + " |", "|---|" + "---:|" * (len(headers) - 1)]
        lines += [row(r) for r in grp.itertuples()]
        lines.append("")
    if notes:
        lines += [f"## {notes_title}", "", *notes, ""]
    return "\n".join(lines)


def write_table(table: pd.DataFrame, markdown: str, results_dir: Path, stem: str, n_failed: int) -> int:
    """``<stem>.csv`` and ``<stem>.md`` under ``results_dir``; the exit status (1 when a job failed)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(results_dir / f"{stem}.csv", index=False)
    (results_dir / f"{stem}.md").write_text(markdown)
    print(f"wrote {results_dir / f'{stem}.md'} ({len(table)} rows, {n_failed} failed jobs)")
    return 1 if n_failed else 0
