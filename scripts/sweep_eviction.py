"""Sweep every eviction strategy (and one eviction + quantization composition) over compression ratios.

One ``python -m kvbench strategies=[...] strategies_params.compression_ratio=<r>`` job per (task, ratio), so
every eviction strategy shares each sample's prefill and the ``full`` baseline (reused from the baseline store
after the first job); the composition runs as its own job. Each job's ``results/runs/<run-id>/summary.csv`` is
read back and the table — accuracy, accuracy delta against ``full`` (paired, percentage points), measured
memory reduction, KL to ``full``, time to first token and decode latency — is written to
``results/eviction_sweep.csv`` and ``results/eviction_sweep.md``.

Usage::

    python scripts/sweep_eviction.py                      # all tasks in conf/task, all strategies
    python scripts/sweep_eviction.py --tasks legal --ratios 0.5,0.875 --extra task.n_samples=4
    python scripts/sweep_eviction.py --dry-run            # print the commands only
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _jobs
import pandas as pd
from _jobs import ROOT, fmt

RATIOS = (0.25, 0.5, 0.75, 0.875)
#: The order of the committed sweep, kept so its job commands (and so its run ids) stay the same.
_SWEPT_ORDER = ("streaming_llm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random")


def eviction_strategies() -> tuple[str, ...]:
    """Every registered eviction strategy (plugins included), the committed sweep's in its order, new ones after."""
    import strategies

    names = strategies.family_names("eviction")
    return tuple(sorted(names, key=lambda n: (_SWEPT_ORDER.index(n) if n in _SWEPT_ORDER else len(_SWEPT_ORDER), n)))


STRATEGIES = eviction_strategies()
#: The composition swept alongside: SnapKV eviction, then int8 storage of the kept tokens.
COMPOSE = ("compose", "snapkv", "int8")
COLUMNS = ["task", "strategy", "ratio", "label", "n", "accuracy", "baseline_accuracy", "delta_pp",
           "delta_ci_low", "delta_ci_high", "memory_reduction", "kept_fraction", "kl", "top1_agreement",
           "ttft_s", "decode_ms_per_token"]


@dataclass
class Job:
    task: str
    strategy: str
    ratio: float
    overrides: list[str] = field(default_factory=list)

    def command(self, python: str, extra: list[str]) -> list[str]:
        return _jobs.kvbench_command(python, self.task, self.overrides, extra)


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=None, help="comma-separated task names (default: every conf/task/*.yaml)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated eviction strategies")
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="comma-separated compression ratios")
    ap.add_argument("--no-compose", action="store_true", help=f"skip the {COMPOSE[1]} + {COMPOSE[2]} rows")
    _jobs.add_common_args(ap)
    args = ap.parse_args(argv)

    tasks = _jobs.task_list(args.tasks, default_tasks)
    if not tasks:
        return 2
    results_dir = _jobs.resolve_results_dir(args.results_dir)
    extra = [*args.extra, f"results_dir={results_dir}"]
    todo = jobs(tasks, [s for s in args.strategies.split(",") if s],
                [float(r) for r in args.ratios.split(",")], not args.no_compose)
    rows, failures = _jobs.run_jobs(todo, args.python, extra, results_dir, args.dry_run,
                                    lambda job, run_dir: rows_from_run(run_dir, job.strategy, job.ratio))
    if args.dry_run:
        return 0
    failed = [f"{shown}: {reason}" for shown, reason in failures]
    table = build_table(rows)
    return _jobs.write_table(table, to_markdown(table, failed), results_dir, "eviction_sweep", len(failed))


if __name__ == "__main__":
    raise SystemExit(main())
