"""Benchmark the quantization strategies on the embedded model: memory, accuracy, KL, decode speed vs full.

One ``python -m kvbench strategies=[full,int8,int4,...] task=<task>`` job per task, all strategies at
their YAML defaults sharing each sample's prefill; with ``--variants``, extra single-strategy jobs for
the non-default formats (FP8 E5M2 per channel, 4-bit BFP, outlier channels, int8 per channel). Each
job's ``results/runs/<run-id>/summary.csv`` is read back and one table is written to
``results/quantization_bench.csv`` and ``results/quantization_bench.md``: measured memory reduction
(and the bits per element it implies), accuracy and its paired delta against ``full``, KL to ``full``,
top-1 agreement, and decode ms/token with its ratio to ``full``'s in the same run.

Usage::

    python scripts/bench_quantization.py                         # every task in conf/task, default length
    python scripts/bench_quantization.py --tasks legal --variants --extra task.n_samples=4
    python scripts/bench_quantization.py --dry-run               # print the commands only
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Any

import _jobs
import pandas as pd
from _jobs import ROOT, fmt

STRATEGIES = ("int8", "int4", "int2", "fp8", "bfp", "channel_sparse", "hf_quantized")
#: Non-default formats, one job each: (label, overrides).
VARIANTS = (
    ("int8 channel axis", ["strategy=int8", "strategy.axis=channel", "strategy.group_size=32"]),
    ("fp8 e5m2 per channel", ["strategy=fp8", "strategy.format=e5m2", "strategy.scale=channel"]),
    ("bfp 4-bit mantissas", ["strategy=bfp", "strategy.mantissa_bits=4"]),
    ("channel_sparse outlier", ["strategy=channel_sparse", "strategy.mode=outlier"]),
    ("hf_quantized 2-bit", ["strategy=hf_quantized", "strategy.nbits=2"]),
)
COLUMNS = ["task", "strategy", "n", "context_tokens", "memory_reduction", "bits_per_element", "accuracy",
           "baseline_accuracy", "delta_pp", "delta_ci_low", "delta_ci_high", "kl", "top1_agreement",
           "decode_ms_per_token", "decode_vs_full"]


@dataclass
class Job:
    task: str
    label: str
    overrides: list[str]

    def command(self, python: str, extra: list[str]) -> list[str]:
        return _jobs.kvbench_command(python, self.task, self.overrides, extra)


def backend_installed() -> bool:
    """hf_quantized's default backend; without it that strategy would fail the whole shared job."""
    return (importlib.util.find_spec("optimum") is not None
            and importlib.util.find_spec("optimum.quanto") is not None)


def default_tasks() -> list[str]:
    """Every task in conf/task that runs as shipped (no mandatory ``???`` field such as a user's corpus)."""
    import yaml

    tasks = []
    for path in sorted((ROOT / "conf" / "task").glob("*.yaml")):
        conf = yaml.safe_load(path.read_text()) or {}
        if "???" not in [v for v in conf.values() if isinstance(v, str)]:
            tasks.append(path.stem)
    return tasks


def jobs(tasks: list[str], names: list[str], variants: bool) -> list[Job]:
    out = []
    for task in tasks:
        out.append(Job(task, "defaults", [f"strategies=[full,{','.join(names)}]"]))
        if variants:
            out += [Job(task, label, list(ov)) for label, ov in VARIANTS
                    if "hf_quantized" not in ov[0] or "hf_quantized" in names]
    return out


def rows_from_summary(summary: pd.DataFrame) -> list[dict]:
    """Non-baseline rows of one run's summary, with the run's own ``full`` as the reference for speed."""
    rows = []
    for rec, base in _jobs.baseline_pairs(summary):
        base_ms = _jobs.first(base, "decode_ms_per_token")
        reduction = float(rec.get("memory_reduction", float("nan")))
        ms = float(rec.get("decode_ms_per_token", float("nan")))
        rows.append({
            **{c: rec.get(c) for c in COLUMNS if c in rec},
            # the reduction is against a dense 16-bit cache, so it fixes the held bits per element
            "bits_per_element": 16 * (1 - reduction),
            "baseline_accuracy": _jobs.first(base, "accuracy"),
            "decode_vs_full": ms / base_ms if base_ms else float("nan"),
        })
    return rows


def build_table(rows: list[dict]) -> pd.DataFrame:
    table = _jobs.with_columns(rows, COLUMNS).drop_duplicates(subset=["task", "strategy"], keep="first")
    return table.sort_values(["task", "memory_reduction"]).reset_index(drop=True)


def _markdown_row(r: Any) -> str:
    return (f"| {r.strategy} | {fmt(100 * r.memory_reduction, '.1f')}% | "
            f"{fmt(r.bits_per_element, '.2f')} | {fmt(r.accuracy, '.3f')} | {_jobs.delta_ci(r)} | "
            f"{fmt(r.kl, '.4f')} | {fmt(r.top1_agreement, '.3f')} | "
            f"{fmt(r.decode_ms_per_token, '.1f')} | {fmt(r.decode_vs_full, '.2f')}x |")


def to_markdown(table: pd.DataFrame, notes: list[str]) -> str:
    return _jobs.to_markdown(
        "Quantization benchmark",
        "Memory reduction is measured from the bytes each cache really holds (packed codes, scales, "
        "zero points, full-precision residuals) against a dense 16-bit cache of the same tokens; "
        "bits/element is 16 x (1 - reduction). Accuracy delta is paired against `full` on the same "
        "samples (percentage points, 95% bootstrap CI); KL and top-1 agreement compare next-token "
        "distributions with `full` over the teacher-forced answer; decode speed is relative to `full` "
        "in the same run.",
        table, ["strategy", "reduction", "bits/elt", "accuracy", "delta pp (95% CI)", "KL", "top-1",
                "decode ms/tok", "vs full"],
        _markdown_row, "Notes", [f"- {n}" for n in notes])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=None,
                    help="comma-separated task names (default: every conf/task/*.yaml that needs no input)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated quantizers")
    ap.add_argument("--variants", action="store_true", help="also run the non-default formats, one job each")
    ap.add_argument("--from-runs", default=None, metavar="RESULTS_DIR",
                    help="run nothing: tabulate the quantizers found in RESULTS_DIR/runs/*/summary.csv "
                         "(e.g. the leaderboard sweep, where every strategy shared each prefill)")
    _jobs.add_common_args(ap)
    args = ap.parse_args(argv)
    if args.from_runs:
        source = _jobs.resolve_results_dir(args.from_runs)
        summaries = [pd.read_csv(path) for path in sorted((source / "runs").glob("*/summary.csv"))]
        rows = [r for sm in summaries
                for r in rows_from_summary(sm[sm["family"].isin(["baseline", "quantization", "reference"])])]
        table = build_table(rows)
        notes = [f"tabulated from the runs in `{args.from_runs}` (no new jobs)"]
        return _jobs.write_table(table, to_markdown(table, notes), source, "quantization_bench", 0)

    tasks = _jobs.task_list(args.tasks, default_tasks)
    if not tasks:
        return 2
    notes: list[str] = []
    names = [s for s in args.strategies.split(",") if s]
    if "hf_quantized" in names and not backend_installed():
        names.remove("hf_quantized")
        notes.append("hf_quantized skipped: its quanto backend is not installed "
                     "(`pip install --no-deps optimum-quanto`)")
    results_dir = _jobs.resolve_results_dir(args.results_dir)
    extra = [*args.extra, f"results_dir={results_dir}"]
    rows, failed = _jobs.run_jobs(jobs(tasks, names, args.variants), args.python, extra, results_dir, args.dry_run,
                                  lambda job, run_dir: rows_from_summary(pd.read_csv(run_dir / "summary.csv")))
    notes += [f"failed: `{shown}`: {reason}" for shown, reason in failed]
    if args.dry_run:
        return 0
    table = build_table(rows)
    return _jobs.write_table(table, to_markdown(table, notes), results_dir, "quantization_bench", len(failed))


if __name__ == "__main__":
    raise SystemExit(main())
