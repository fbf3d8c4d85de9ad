"""The leaderboard: every strategy measured in the result store, ranked on one page per (model, spec version).

``kvbench leaderboard`` (or ``python -m kvbench.leaderboard``) reads ``<results-dir>/store``, pairs every
strategy's records with the ``full`` baseline on identical samples, summarises them with
:func:`kvbench.report.summarize`, and writes

* ``leaderboard.md`` / ``leaderboard.csv`` / ``leaderboard.html`` — one row per (strategy, parameters);
  per task: accuracy delta with its paired-bootstrap 95% CI, memory reduction, KV bytes per token,
  prefill seconds, decode ms/token and the number of samples, plus the same figures pooled over all
  tasks (``all.*``, only for strategies measured on every task);
* ``claim_check.md`` — see :mod:`kvbench.claims`;
* with ``--plots``, the comparison plots of :mod:`kvbench.plots` into ``<out-dir>/plots``.

Only records of one spec version, model, hardware profile and dtype are ranked together: accuracy
deltas of different models (or specs) answer different questions, and latency from different hardware
cannot share a column. Mixing is refused with one line naming what was found and the flag that selects.

Output is a pure function of the store and the flags — no timestamps, a stable sort, fixed float
formatting — so regenerating from the same store is byte-identical.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.claims import OVERALL, check_claims, render_claims
from kvbench.errors import KVBenchError
from kvbench.report import BASELINE, summarize
from kvbench.results import atomic_write_text, read_store, stable_hash

#: Fields that must hold a single value among the records ranked together, with the flag selecting one.
HOMOGENEOUS: dict[str, str] = {
    "spec_version": "--spec-version",
    "model": "--model",
    "hardware": "--hardware",
    "dtype": "--dtype",
}

#: Per-task metrics of the table, as (summary column, markdown header, format). ``delta_pp`` is rendered
#: together with its CI columns.
TASK_METRICS: tuple[tuple[str, str, str], ...] = (
    ("delta_pp", "Δ acc pp [95% CI]", "delta"),
    ("memory_reduction", "mem. red.", "pct"),
    ("bytes_per_token", "KV B/tok", "bytes"),
    ("prefill_s", "prefill s", "s"),
    ("decode_ms_per_token", "decode ms/tok", "ms"),
    ("n", "n", "int"),
)
#: Summary columns copied into the CSV per task (the markdown shows a subset).
CSV_TASK_COLUMNS = ("n", "accuracy", "delta_pp", "delta_ci_low", "delta_ci_high", "relative_loss",
                    "memory_reduction", "bytes_per_token", "kept_fraction", "prefill_s", "ttft_s",
                    "decode_ms_per_token")
OVERALL_COLUMNS = ("n", "delta_pp", "delta_ci_low", "delta_ci_high", "relative_loss", "memory_reduction")
ROW_COLUMNS = ("strategy", "name", "family", "params", "model", "spec_version")

#: Sort direction per metric: True when larger is better (shown first by ``--sort``).
HIGHER_IS_BETTER = {
    "n": True, "accuracy": True, "delta_pp": True, "delta_ci_low": True, "delta_ci_high": True,
    "relative_loss": False, "memory_reduction": True, "bytes_per_token": False, "kept_fraction": False,
    "prefill_s": False, "ttft_s": False, "decode_ms_per_token": False,
}
DEFAULT_SORT = f"{OVERALL}.delta_pp"
CSV_FLOAT_FORMAT = "%.6g"


# ------------------------------------------------------------------------------------------ selection


@dataclass(frozen=True)
class Filters:
    """Which records to rank; ``None`` keeps everything for that field."""

    model: str | None = None
    tasks: tuple[str, ...] | None = None
    hardware: str | None = None
    spec_version: str | None = None
    dtype: str | None = None

    def describe(self) -> str:
        """The filter flags as they would be typed, for the page header."""
        parts = [f"--{k.replace('_', '-')} {v}" for k, v in
                 (("model", self.model), ("hardware", self.hardware), ("spec_version", self.spec_version),
                  ("dtype", self.dtype)) if v is not None]
        if self.tasks:
            parts.append("--task " + ",".join(self.tasks))
        return " ".join(parts) or "(none)"


def select_records(records: pd.DataFrame, filters: Filters) -> pd.DataFrame:
    """Apply ``filters``; an empty selection raises an error naming the values that do exist."""
    if records.empty:
        raise KVBenchError("the result store is empty; run a benchmark first, e.g. "
                           "`python -m kvbench strategies=[full,int8] task=legal`")
    out = records
    for col, wanted in (("model", filters.model), ("hardware", filters.hardware),
                        ("spec_version", filters.spec_version), ("dtype", filters.dtype)):
        if wanted is None:
            continue
        if col not in out.columns:
            raise KVBenchError(f"records carry no {col!r} field, so {HOMOGENEOUS[col]} cannot select")
        have = _distinct(out[col])
        out = out[out[col].astype(str) == str(wanted)]
        if out.empty:
            raise KVBenchError(f"no records with {col} {wanted!r}; found: {', '.join(have) or '(none)'}")
    if filters.tasks:
        have = _distinct(out["task"])
        missing = [t for t in filters.tasks if t not in have]
        if missing:
            raise KVBenchError(f"no records for task {', '.join(missing)}; found: {', '.join(have)}")
        out = out[out["task"].isin(filters.tasks)]
    return out.reset_index(drop=True)


def check_comparable(records: pd.DataFrame) -> None:
    """Refuse to rank records of different spec versions, models, hardware profiles or dtypes together."""
    mixed = []
    for col, flag in HOMOGENEOUS.items():
        if col in records.columns:
            found = _distinct(records[col])
            if len(found) > 1:
                mixed.append((col, flag, found))
    if mixed:
        what = "; ".join(f"{col.replace('_', ' ')}s {', '.join(found)}" for col, _, found in mixed)
        flags = " and ".join(f"{flag} {found[0]}" for _, flag, found in mixed)
        raise KVBenchError(f"the selected records mix {what}; only one of each is ranked together — "
                           f"select with e.g. {flags}")


def _distinct(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna()})


def _json_text(value: Any) -> str:
    """Nested fields are JSON strings in the store but dicts in records.jsonl; compare them as text."""
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    return json.dumps(value, sort_keys=True, default=str)


def paired_records(records: pd.DataFrame) -> pd.DataFrame:
    """Records ready for :func:`summarize`: one per (task, strategy, sample), keyed by what the sample *is*.

    Different runs reuse sample ids (a task at two context lengths, two runs that both include
    ``full``), and ``summarize`` pairs on ``sample_id`` alone. So ``sample_id`` is replaced by a key
    that also covers the sample's exact length, metadata (depth, seed, template, variant) and the
    run conditions that change its tokens; of identical measurements from several runs the one from the
    last store file (sorted run ids) is kept. Rows are sorted by that key so the bootstrap CIs do not
    depend on which store file was read first.
    """
    df = records.copy()
    parts = df.apply(lambda r: [r.get("sample_id"), r.get("context_tokens"), _json_text(r.get("sample_meta")),
                                r.get("seed"), r.get("query_aware"), r.get("dtype")], axis=1)
    df["sample_id"] = [f"{p[0]}#{stable_hash(p, 10)}" for p in parts]
    df = df.drop_duplicates(subset=["task", "strategy", "sample_id"], keep="last")
    return df.sort_values(["task", "strategy", "sample_id"], kind="mergesort").reset_index(drop=True)


def overall_summary(records: pd.DataFrame, tasks: Sequence[str]) -> pd.DataFrame:
    """Per-strategy figures pooled over ``tasks`` (task column :data:`OVERALL`), paired per sample.

    Only strategies measured on every task are pooled: a strategy seen on the easy task alone would
    otherwise look better than one measured everywhere.
    """
    have = records.groupby("strategy")["task"].agg(lambda s: set(s))
    complete = [s for s, seen in have.items() if set(tasks) <= seen]
    pooled = records[records["strategy"].isin(complete)].copy()
    if pooled.empty or BASELINE not in complete:
        return pd.DataFrame(columns=summarize(pd.DataFrame()).columns)
    pooled["sample_id"] = pooled["task"].astype(str) + "/" + pooled["sample_id"].astype(str)
    pooled["task"] = OVERALL
    return summarize(pooled)


# ------------------------------------------------------------------------------------------- the table


@dataclass
class Leaderboard:
    """Everything the renderers need; ``table`` holds raw values under the CSV column names."""

    table: pd.DataFrame
    summary: pd.DataFrame  # per (task, strategy) rows plus the OVERALL rows
    records: pd.DataFrame  # the paired records the summary was computed from
    tasks: list[str]
    meta: dict[str, str] = field(default_factory=dict)
    sort: str = DEFAULT_SORT
    reverse: bool = False


def _params_text(value: Any) -> str:
    text = _json_text(value)
    try:
        params = json.loads(text)
    except (TypeError, ValueError):
        return text
    if not isinstance(params, dict):
        return text
    return ", ".join(f"{k}={params[k]}" for k in sorted(params))


def build(records: pd.DataFrame, filters: Filters = Filters(), sort: str | None = None,
          reverse: bool = False) -> Leaderboard:
    """Select, check, pair and summarise ``records`` (as :func:`kvbench.results.read_store` returns them)."""
    chosen = select_records(records, filters)
    check_comparable(chosen)
    if BASELINE not in set(chosen["strategy"]):
        raise KVBenchError(f"no {BASELINE!r} baseline records in the selection; every run records it, so the "
                           "store is incomplete — rerun a benchmark")
    paired = paired_records(chosen)
    tasks = sorted(paired["task"].astype(str).unique())
    if OVERALL in tasks:
        raise KVBenchError(f"a task named {OVERALL!r} clashes with the pooled columns; filter it out with --task")
    per_task = summarize(paired)
    overall = overall_summary(paired, tasks)
    summary = pd.concat([per_task, overall], ignore_index=True) if not overall.empty else per_task

    firsts = paired.drop_duplicates("strategy").set_index("strategy")
    rows = []
    for label in sorted(paired["strategy"].unique()):
        first = firsts.loc[label]
        row: dict[str, Any] = {
            "strategy": label,
            "name": first.get("strategy_name", label),
            "family": first.get("family", ""),
            "params": _params_text(first.get("params")),
            "model": str(first.get("model", "")),
            "spec_version": str(first.get("spec_version", "")),
        }
        for scope in [*tasks, OVERALL]:
            hit = summary[(summary["task"] == scope) & (summary["strategy"] == label)]
            cols = OVERALL_COLUMNS if scope == OVERALL else CSV_TASK_COLUMNS
            for col in cols:
                row[f"{scope}.{col}"] = hit[col].iloc[0] if not hit.empty else float("nan")
        rows.append(row)
    table = pd.DataFrame(rows)
    meta = {
        "model": ", ".join(_distinct(chosen["model"])),
        "spec_version": ", ".join(_distinct(chosen["spec_version"])),
        "hardware": ", ".join(_distinct(chosen["hardware"])) if "hardware" in chosen else "",
        "dtype": ", ".join(_distinct(chosen["dtype"])) if "dtype" in chosen else "",
        "records": str(len(paired)),
        "filters": filters.describe(),
    }
    lb = Leaderboard(table=table, summary=summary, records=paired, tasks=tasks, meta=meta)
    return sort_leaderboard(lb, sort or DEFAULT_SORT, reverse)


def sort_leaderboard(lb: Leaderboard, column: str, reverse: bool = False) -> Leaderboard:
    """Order rows best-first by ``column`` (any CSV column); ``reverse`` flips it. Missing values go last.

    "Best" is larger for accuracy, deltas and memory reduction, smaller for bytes, loss and latency;
    text columns sort alphabetically. Ties fall back to the pooled memory reduction (more first) and
    then the strategy label: successive stable sorts, so the order never depends on input order.
    """
    table = lb.table
    if column not in table.columns:
        raise KVBenchError(f"cannot sort by {column!r}; valid columns: {', '.join(table.columns)}")
    metric = column.rsplit(".", 1)[-1]
    numeric = metric in HIGHER_IS_BETTER
    ascending = not HIGHER_IS_BETTER[metric] if numeric else True
    if reverse:
        ascending = not ascending
    order = table.sort_values("strategy", kind="mergesort")
    tiebreak = f"{OVERALL}.memory_reduction"
    if tiebreak in order.columns and tiebreak != column:
        order = order.sort_values(tiebreak, ascending=False, kind="mergesort", na_position="last")
    key = (lambda s: pd.to_numeric(s, errors="coerce")) if numeric else (lambda s: s.astype(str))
    order = order.sort_values(column, ascending=ascending, kind="mergesort", na_position="last", key=key)
    lb.table = order.reset_index(drop=True)
    lb.sort, lb.reverse = column, reverse
    return lb


# ----------------------------------------------------------------------------------------- rendering


def _isnan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def fmt(value: Any, kind: str) -> str:
    """Fixed formatting per kind of figure; missing values print as ``–``."""
    if _isnan(value):
        return "–"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "pp":
        return f"{value:+.1f}"
    if kind == "bytes":
        return f"{value:,.1f}"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "ms":
        return f"{value:.2f}"
    if kind == "int":
        return f"{int(value)}"
    return str(value)


def fmt_delta(delta: Any, low: Any, high: Any) -> str:
    """``+0.0 [-2.1, +1.9]``: the point estimate with its paired-bootstrap CI."""
    if _isnan(delta):
        return "–"
    return f"{fmt(delta, 'pp')} [{fmt(low, 'pp')}, {fmt(high, 'pp')}]"


def display_columns(lb: Leaderboard) -> list[tuple[str, str, list[str]]]:
    """(header, sort-key column, cells) per displayed column, in order; shared by markdown and HTML."""
    t = lb.table
    cols: list[tuple[str, str, list[str]]] = [
        ("strategy", "strategy", list(t["strategy"])),
        ("family", "family", list(t["family"])),
    ]
    for scope in [OVERALL, *lb.tasks]:
        if f"{scope}.delta_pp" not in t.columns:
            continue
        name = "all tasks" if scope == OVERALL else scope
        metrics = TASK_METRICS if scope != OVERALL else (TASK_METRICS[0], TASK_METRICS[1], TASK_METRICS[-1])
        for col, header, kind in metrics:
            key = f"{scope}.{col}"
            if kind == "delta":
                cells = [fmt_delta(d, lo, hi) for d, lo, hi in
                         zip(t[key], t[f"{scope}.delta_ci_low"], t[f"{scope}.delta_ci_high"], strict=True)]
            else:
                cells = [fmt(v, kind) for v in t[key]]
            cols.append((f"{name}: {header}", key, cells))
    cols += [("model", "model", list(t["model"])), ("spec", "spec_version", list(t["spec_version"]))]
    return cols


def _header_lines(lb: Leaderboard) -> list[str]:
    m = lb.meta
    direction = "reversed" if lb.reverse else "best first"
    return [
        f"Model **{m['model']}**, measurement spec v{m['spec_version']}, hardware profile {m['hardware']}, "
        f"dtype {m['dtype']}; {m['records']} records; tasks: {', '.join(lb.tasks)}; filters: {m['filters']}.",
        "",
        f"Δ acc: strategy − `{BASELINE}` accuracy in percentage points on identical samples, with the paired "
        "bootstrap 95% CI (spec §2). mem. red.: 1 − KV bytes held / dense 16-bit bytes (spec §1). "
        "KV B/tok: bytes held per context token. prefill s: the shared full-attention prefill (median); "
        "decode ms/tok: median time per output token (spec §3). *all tasks* pools the samples of every task "
        "(strategies measured on every task only).",
        "",
        f"Sorted by `{lb.sort}` ({direction}). Regenerate with `kvbench leaderboard`; columns and raw values "
        "are in leaderboard.csv.",
    ]


def render_markdown(lb: Leaderboard) -> str:
    """The leaderboard as a GitHub-flavoured markdown page."""
    cols = display_columns(lb)
    lines = ["# kvbench leaderboard", "", *_header_lines(lb), ""]
    lines.append("| " + " | ".join(h for h, _, _ in cols) + " |")
    lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|")
    for i in range(len(lb.table)):
        lines.append("| " + " | ".join(_md_cell(c[2][i]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def render_csv(lb: Leaderboard) -> str:
    """Raw values, one row per strategy, fixed float format."""
    return lb.table.to_csv(index=False, float_format=CSV_FLOAT_FORMAT, lineterminator="\n")


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;white-space:nowrap}
th{background:#f0f0f0;cursor:pointer;position:sticky;top:0}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
p{max-width:70em}"""

# Click a header to sort by it; click again to flip. Cells carry their raw value in data-v, so numbers
# sort numerically and missing values (empty data-v) stay last.
_JS = """document.querySelectorAll("th").forEach(function(th,col){th.addEventListener("click",function(){
var tb=th.closest("table").tBodies[0],asc=!th.classList.contains("asc");
th.parentNode.querySelectorAll("th").forEach(function(h){h.classList.remove("asc","desc")});
th.classList.add(asc?"asc":"desc");
var rows=Array.prototype.slice.call(tb.rows);rows.sort(function(a,b){
var x=a.cells[col].getAttribute("data-v"),y=b.cells[col].getAttribute("data-v");
if(x===""||y===""){return x===y?0:(x===""?1:-1)}
var nx=parseFloat(x),ny=parseFloat(y),c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
return asc?c:-c});rows.forEach(function(r){tb.appendChild(r)})})});"""


def render_html(lb: Leaderboard) -> str:
    """A self-contained page: inline CSS, inline click-to-sort script, no external assets."""
    cols = display_columns(lb)
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in cols)
    body = []
    for i in range(len(lb.table)):
        cells = []
        for _, key, shown in cols:
            raw = lb.table[key].iloc[i]
            numeric = isinstance(raw, (numbers.Number, np.number)) and not isinstance(raw, (bool, np.bool_))
            value = "" if _isnan(raw) else (format(float(raw), ".6g") if numeric else str(raw))
            cls = ' class="num"' if numeric else ""
            cells.append(f'<td{cls} data-v="{esc(value)}">{esc(shown[i])}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    intro = "".join(f"<p>{esc(line).replace('**', '')}</p>" for line in _header_lines(lb) if line)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>kvbench leaderboard</title>\n"
            f"<style>\n{_CSS}\n</style></head>\n<body>\n<h1>kvbench leaderboard</h1>\n{intro}\n"
            f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body) +
            f"\n</tbody></table>\n<script>\n{_JS}\n</script>\n</body></html>\n")


def write(lb: Leaderboard, out_dir: str | Path) -> list[Path]:
    """Write leaderboard.{md,csv,html} and claim_check.md; returns the paths."""
    out = Path(out_dir)
    paths = []
    for name, text in (("leaderboard.md", render_markdown(lb)), ("leaderboard.csv", render_csv(lb)),
                       ("leaderboard.html", render_html(lb)),
                       ("claim_check.md", render_claims(check_claims(lb.summary, lb.meta, lb.records)))):
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
    p.add_argument("--results-dir", default="results", help="directory holding store/ (default results)")
    p.add_argument("--out-dir", default=None, help="where to write (default: the results directory)")
    p.add_argument("--model", default=None, help="rank only this model's records")
    p.add_argument("--task", action="append", default=None,
                   help="rank only these tasks (repeat the flag or separate with commas)")
    p.add_argument("--hardware", default=None, help="rank only records of this hardware profile")
    p.add_argument("--spec-version", default=None, help="rank only records of this measurement spec version")
    p.add_argument("--dtype", default=None, help="rank only records run in this dtype")
    p.add_argument("--sort", default=DEFAULT_SORT,
                   help=f"column to rank by, best first (any leaderboard.csv column, default {DEFAULT_SORT})")
    p.add_argument("--reverse", action="store_true", help="reverse the --sort order")
    p.add_argument("--plots", action="store_true", help="also draw the comparison plots into <out-dir>/plots")
    return p


def filters_from_args(args: argparse.Namespace) -> Filters:
    tasks = tuple(t for arg in args.task or [] for t in arg.split(",") if t) or None
    return Filters(model=args.model, tasks=tasks, hardware=args.hardware, spec_version=args.spec_version,
                   dtype=args.dtype)


def run_cli(command: str, parser: argparse.ArgumentParser, argv: list[str] | None,
            produce: Callable[[argparse.Namespace], list[Path]]) -> int:
    """Parse ``argv``, run ``produce`` and print the paths it wrote; a :class:`KVBenchError` becomes one
    ``kvbench <command>: error: ...`` line on stderr. Returns the exit status (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad arguments (2)
        return int(exc.code or 0)
    try:
        paths = produce(args)
    except KVBenchError as exc:
        print(f"kvbench {command}: error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _write_from_args(args: argparse.Namespace) -> list[Path]:
    out_dir = Path(args.out_dir or args.results_dir)
    filters = filters_from_args(args)
    lb = build(read_store(args.results_dir), filters, args.sort, args.reverse)
    paths = write(lb, out_dir)
    if args.plots:
        from kvbench.plots import write_all

        paths += write_all(lb.records, lb.summary, out_dir / "plots")
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench leaderboard``; returns the exit status (0 ok, 2 bad input)."""
    return run_cli("leaderboard", build_parser(), argv, _write_from_args)


if __name__ == "__main__":
    sys.exit(main())
