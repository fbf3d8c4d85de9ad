"""The leaderboard: every strategy measured in the result store, ranked on one page per (model, spec version).

``kvbench leaderboard`` (or ``python -m kvbench.leaderboard``) reads ``<results-dir>/store``, pairs every
strategy's records with the ``full`` baseline on identical samples, summarises them with
:func:`kvbench.report.summarize`, and writes

* ``leaderboard.md`` / ``leaderboard.html`` — built around the question people ask ("which strategy saves
  the most KV memory while staying within the spec's accuracy margin?"): per query setting (see
  :mod:`kvbench.selection`), a one-sentence answer, then one compact table — rank, strategy, family,
  memory saved, pooled Δ with its 95% interval, verdict against the margin, n (questions / documents) —
  sorted by the verdict and then memory saved, ``full`` as the reference row. Offloading (``tiered``),
  whose figure is device memory rather than bytes saved, has its own section and is never ranked.
  Per-task figures and latency are in detail tables below (and in the CSV);
* ``leaderboard.csv`` — every raw figure, one row per (query setting, strategy): per task and pooled
  (``all.*``, only for strategies measured on every task) accuracy delta with its paired 95% CI, memory
  reduction, KV bytes per token, prefill seconds, decode ms/token, n, plus the rank, verdict and section;
* ``claim_check.md`` — :mod:`kvbench.claims`, per setting;
* with ``--plots`` (or ``--plots-only``), the figures of :mod:`kvbench.plots` into ``<out-dir>/plots``.

They go into ``--out-dir``; without it, into the results directory — unless that is a published tree (it carries
``MANIFEST.sha256``, as the committed ``results/`` does): a reader regenerating the board should not rewrite the
committed pages, so they go to ``results/adhoc/leaderboard/<name>`` (git-ignored, beside ad-hoc runs) with one
line saying so; ``scripts/publish_results.sh`` names ``--out-dir`` to republish.

Which records are read is :mod:`kvbench.selection`'s job (its filter flags are this command's). Only
records of one spec version, model, hardware profile and dtype are ranked together: accuracy deltas of
different models (or specs) answer different questions, and latency from different hardware cannot
share a column. Mixing is refused with one line naming what was found and the flag that selects.

Output is a pure function of the store and the flags — no timestamps, a stable sort, fixed float
formatting — so regenerating from the same store is byte-identical.

The package: :mod:`~kvbench.leaderboard.table` builds the table (selection, pairing, summaries, verdicts,
rank, sort); :mod:`~kvbench.leaderboard.render` writes the pages; this module writes the files and is the
command line. The names below are re-exported so ``from kvbench import leaderboard`` reads as one module.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvbench import manifest
from kvbench.leaderboard.render import (
    CSV_FLOAT_FORMAT,
    LATENCY_METRICS,
    TASK_METRICS,
    Column,
    answer_sentence,
    answer_shown,
    baseline_line,
    display_columns,
    fmt_value,
    inline_markdown,
    main_columns,
    render_claim_check,
    render_csv,
    render_html,
    render_markdown,
    task_columns,
)
from kvbench.leaderboard.table import (
    BASELINE_FLOOR,
    BEYOND,
    CSV_TASK_COLUMNS,
    DEFAULT_SORT,
    HIGHER_IS_BETTER,
    NOT_POOLED,
    OFFLOADING,
    OVERALL_COLUMNS,
    RANK_COLUMNS,
    RANKED,
    REFERENCE,
    ROW_COLUMNS,
    STOPPED,
    TEST_COLUMNS,
    UNDECIDED_IN,
    UNDECIDED_OUT,
    VERDICT_ORDER,
    WITHIN,
    Leaderboard,
    PooledScope,
    build,
    claim_verdicts,
    margin_pp,
    overall_summary,
    read_records,
    sort_leaderboard,
)
from kvbench.results import atomic_write_text, printable
from kvbench.selection import (
    Filters,
    add_design_argument,
    add_filter_arguments,
    design_from_args,
    filters_from_args,
    paired_records,
    run_cli,
)
from kvbench.vocab import DEPTH_KEYS, OVERALL


def write(lb: Leaderboard, out_dir: str | Path) -> list[Path]:
    """Write leaderboard.{md,csv,html} and claim_check.md; returns the paths."""
    out = Path(out_dir)
    paths = []
    for name, text in (("leaderboard.md", render_markdown(lb)), ("leaderboard.csv", render_csv(lb)),
                       ("leaderboard.html", render_html(lb)), ("claim_check.md", render_claim_check(lb))):
        path = out / name
        atomic_write_text(path, text)
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbench leaderboard",
        description="Rank every strategy in the result store: writes leaderboard.md/.csv/.html and "
                    "claim_check.md (and the plots with --plots).")
    add_filter_arguments(p)
    add_design_argument(p)
    p.add_argument("--out-dir", default=None,
                   help="where to write (default: the results directory; for a published one, with "
                        f"{manifest.MANIFEST}, {ADHOC}/<its name>)")
    p.add_argument("--sort", default=DEFAULT_SORT,
                   help=f"column to rank by, best first (any leaderboard.csv column, default {DEFAULT_SORT})")
    p.add_argument("--reverse", action="store_true", help="reverse the --sort order")
    p.add_argument("--plots", action="store_true", help="also draw the comparison plots into <out-dir>/plots")
    p.add_argument("--plots-only", action="store_true", help="draw the plots only (no tables, no claim check)")
    p.add_argument("--needle-strategy", action="append", default=None,
                   help="strategy (short or full label) for the needle heatmaps, repeatable "
                        "(default: the most informative per task)")
    p.add_argument("--measured-by", default=None,
                   help="the command that measured the store, quoted at the top of claim_check.md")
    p.add_argument("--strict", action="store_true",
                   help="refuse (instead of warning) when the results directory does not match its "
                        "MANIFEST.sha256, or has none (kvbench verify)")
    p.add_argument("--depth-key", default=None,
                   help=f"sample_meta key holding the needle depth (default: first of {', '.join(DEPTH_KEYS)})")
    return p


#: Where the board of a published results tree goes without ``--out-dir`` (git-ignored, as ad-hoc runs are).
ADHOC = Path("results/adhoc/leaderboard")


def default_out_dir(results_dir: str | Path) -> Path:
    """The results directory itself, or for a published tree (``MANIFEST.sha256``) ``ADHOC/<its name>``: its
    committed pages are regenerated only on purpose (``--out-dir``), never as a side effect of reading it."""
    results = Path(results_dir)
    if not (results / manifest.MANIFEST).is_file():
        return results
    return ADHOC / (results.resolve().name or "results")


def _write_from_args(args: argparse.Namespace) -> list[Path]:
    from kvbench.paths import check_output_dir

    # Held to results_dir's rules before anything is read or written: --out-dir /etc/x wrote into /etc as root.
    out_dir = check_output_dir(args.out_dir, "--out-dir") if args.out_dir is not None else \
        default_out_dir(args.results_dir)
    manifest.check(args.results_dir, strict=args.strict)
    lb = build(read_records(args.results_dir), filters_from_args(args), args.sort, args.reverse, args.depth_key,
               design_from_args(args))
    if args.measured_by:
        lb.meta["measured_by"] = args.measured_by
    paths = [] if args.plots_only else write(lb, out_dir)
    if args.plots or args.plots_only:
        from kvbench.plots import write_all

        paths += write_all(lb.records, lb.summary, out_dir / "plots", needle_strategies=args.needle_strategy,
                           pooled={s: lb.pooled_scope(s).text() for s in lb.settings})
    if args.out_dir is None and out_dir != Path(args.results_dir):  # said once it is done, as the one note
        print(f"kvbench leaderboard: {printable(str(args.results_dir))} is a published tree ({manifest.MANIFEST}) "
              f"and was left as committed; wrote to {printable(str(out_dir))} (--out-dir "
              f"{printable(str(args.results_dir))} rewrites its pages)", file=sys.stderr)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench leaderboard``; returns the exit status (0 ok, 2 bad input)."""
    return run_cli("leaderboard", build_parser(), argv, _write_from_args)


__all__ = [
    "ADHOC", "BASELINE_FLOOR", "BEYOND", "CSV_FLOAT_FORMAT", "CSV_TASK_COLUMNS", "DEFAULT_SORT", "HIGHER_IS_BETTER",
    "LATENCY_METRICS",
    "NOT_POOLED", "OFFLOADING", "OVERALL", "OVERALL_COLUMNS", "RANKED", "RANK_COLUMNS", "REFERENCE", "ROW_COLUMNS",
    "STOPPED", "TASK_METRICS", "TEST_COLUMNS", "UNDECIDED_IN", "UNDECIDED_OUT", "VERDICT_ORDER", "WITHIN", "Column",
    "Filters",
    "Leaderboard", "PooledScope", "answer_sentence", "answer_shown", "baseline_line",
    "build", "build_parser", "claim_verdicts", "default_out_dir", "display_columns",
    "fmt_value", "inline_markdown", "main", "main_columns", "margin_pp", "overall_summary", "paired_records",
    "read_records", "render_claim_check", "render_csv", "render_html", "render_markdown", "sort_leaderboard",
    "task_columns", "write",
]
