"""The eviction ratio sweep (``conf/sweep/eviction.yaml``, run by ``kvbench sweep``) and its table.

The grid — every eviction strategy at four compression ratios, one job per ratio so the strategies share each
sample's prefill and the ``full`` baseline — is the sweep file; this script runs it (any launcher, rounds or
overrides ``kvbench sweep`` takes) into ``results/eviction`` and tabulates the jobs of that sweep run from the
run directory each job points to: accuracy, accuracy delta against ``full`` (paired, percentage points),
measured memory reduction, KL to ``full``, time to first token and decode latency, written to
``<results-dir>/eviction_sweep.csv`` and ``.md``.

Usage::

    python scripts/sweep_eviction.py                              # the committed grid, then the table
    python scripts/sweep_eviction.py --dry-run                    # jobs and commands only
    python scripts/sweep_eviction.py --table-only                 # the table of the last sweep run
    python scripts/sweep_eviction.py --launcher joblib -- task=papers task.n_samples=20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _jobs
import pandas as pd
from _jobs import ROOT, fmt

SWEEP = "eviction"
COLUMNS = ["task", "strategy", "ratio", "label", "n", "accuracy", "baseline_accuracy", "delta_pp",
           "delta_ci_low", "delta_ci_high", "memory_reduction", "kept_fraction", "kl", "top1_agreement",
           "ttft_s", "decode_ms_per_token"]
#: Where a job's overrides set the compression ratio: every listed strategy's, or a composition's evictor.
RATIO_KEYS = ("strategies_params.compression_ratio", "strategy.evict_params.compression_ratio",
              "strategy.compression_ratio")


def job_strategy_and_ratio(overrides: list[str]) -> tuple[str, float]:
    """The table's strategy (``*``: the run's own labels; ``compose:<evict>+<quantize>`` for a composition)
    and ratio of one sweep job, from its overrides."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    ratio = next((float(values[k]) for k in RATIO_KEYS if k in values), float("nan"))
    name = values.get("strategy", "*") if "strategies" not in values else "*"
    if name == "compose":
        name = f"compose:{values.get('strategy.evict')}+{values.get('strategy.quantize')}"
    return name, ratio


def rows_from_run(run_dir: Path, strategy: str, ratio: float) -> list[dict]:
    """The non-baseline rows of a run's ``summary.csv``, tagged with the sweep's strategy and ratio."""
    summary = pd.read_csv(run_dir / "summary.csv")
    rows = []
    for rec, base in _jobs.baseline_pairs(summary):
        name = rec["strategy"].split("(", 1)[0] if strategy == "*" else strategy
        rows.append({**{c: rec.get(c) for c in COLUMNS if c in rec}, "label": rec["strategy"],
                     "strategy": name, "ratio": ratio,
                     "baseline_accuracy": _jobs.first(base, "accuracy")})
    return rows


def build_table(rows: list[dict]) -> pd.DataFrame:
    return _jobs.with_columns(rows, COLUMNS).sort_values(["task", "strategy", "ratio"]).reset_index(drop=True)


def _markdown_row(r: Any) -> str:
    return (f"| {r.strategy} | {r.ratio} | {fmt(r.accuracy, '.3f')} | {_jobs.delta_ci(r)} | "
            f"{fmt(100 * r.memory_reduction, '.1f')}% | {fmt(r.kl, '.4f')} | "
            f"{fmt(r.ttft_s, '.2f')} | {fmt(r.decode_ms_per_token, '.1f')} |")


def to_markdown(table: pd.DataFrame, failed: list[str] | None = None) -> str:
    return _jobs.to_markdown(
        "Eviction sweep",
        "Accuracy delta is paired against the `full` baseline on the same samples (percentage points, "
        "95% bootstrap CI); memory reduction is measured from the bytes each cache holds after "
        "compression, against a dense 16-bit cache of the same tokens.",
        table, ["strategy", "ratio", "accuracy", "delta pp (95% CI)", "memory reduction", "KL", "TTFT s",
                "decode ms/tok"],
        _markdown_row, "Failed jobs", [f"- `{f}`" for f in failed or []])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Other arguments go to `kvbench sweep` (--dry-run, --launcher, --rounds, "
                                        "-- overrides).")
    ap.add_argument("--results-dir", default="results/eviction", help="every job's results_dir and the table's")
    ap.add_argument("--table-only", action="store_true", help="only tabulate the last run of the sweep")
    args, sweep_args = ap.parse_known_args(argv)
    results_dir = _jobs.resolve_results_dir(args.results_dir)
    if not args.table_only:
        from kvbench import sweep

        rc = sweep.main([SWEEP, "--results-dir", str(results_dir), *sweep_args])
        if rc == 2 or "--dry-run" in sweep_args:
            return rc
    from kvbench.errors import KVBenchError
    from kvbench.sweep import job_runs

    try:
        jobs = job_runs(results_dir, SWEEP)
    except KVBenchError as exc:
        print(f"sweep_eviction.py: error: {exc}", file=sys.stderr)
        return 2
    rows, failed = [], []
    for overrides, run_dir, reason in jobs:
        if run_dir is None or not (run_dir / "summary.csv").is_file():
            failed.append(f"{' '.join(overrides)}: {reason or 'no summary.csv'}")
            continue
        rows += rows_from_run(run_dir, *job_strategy_and_ratio(overrides))
    table = build_table(rows)
    return _jobs.write_table(table, to_markdown(table, failed), results_dir, "eviction_sweep", len(failed))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as `python scripts/sweep_eviction.py`: import this checkout's kvbench
    raise SystemExit(main())
