"""The leaderboard: every strategy measured in the result store, ranked on one page per (model, spec version).

``kvbench leaderboard`` (or ``python -m kvbench.leaderboard``) reads ``<results-dir>/store``, pairs every
strategy's records with the ``full`` baseline on identical samples, summarises them with
:func:`kvbench.report.summarize`, and writes

* ``leaderboard.md`` / ``leaderboard.csv`` / ``leaderboard.html`` — one row per (query setting, strategy);
  per task: accuracy delta with its paired 95% CI, memory reduction, KV bytes per token, prefill seconds,
  decode ms/token and the number of samples, plus the same figures pooled over all tasks (``all.*``, only
  for strategies measured on every task). The query-aware and query-agnostic settings (see
  :mod:`kvbench.selection`) are summarised apart and shown as two labelled tables; strategies are named by
  their short label (:mod:`kvbench.labels`), the full parameters are in the CSV;
* ``claim_check.md`` — :mod:`kvbench.claims`, per setting;
* with ``--plots`` (or ``--plots-only``), the figures of :mod:`kvbench.plots` into ``<out-dir>/plots``.

Which records are read is :mod:`kvbench.selection`'s job (its filter flags are this command's). Only
records of one spec version, model, hardware profile and dtype are ranked together: accuracy deltas of
different models (or specs) answer different questions, and latency from different hardware cannot
share a column. Mixing is refused with one line naming what was found and the flag that selects.

Output is a pure function of the store and the flags — no timestamps, a stable sort, fixed float
formatting — so regenerating from the same store is byte-identical.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import numbers
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench.claims import OVERALL, check_claims, render_claims
from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.record import HIGHER_IS_BETTER  # sort direction per metric: larger first where True
from kvbench.report import BASELINE, summarize
from kvbench.results import atomic_write_text, read_store
from kvbench.selection import (
    DEPTH_KEYS,
    SETTING_TEXT,
    SETTINGS,
    Filters,
    add_filter_arguments,
    check_comparable,
    filters_from_args,
    json_text,
    paired_records,
    run_cli,
    select_records,
)

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
CSV_TASK_COLUMNS = ("n", "accuracy", "accuracy_ci_low", "accuracy_ci_high", "delta_pp", "delta_ci_low",
                    "delta_ci_high", "relative_loss",
                    "memory_reduction", "bytes_per_token", "kept_fraction", "prefill_s", "ttft_s",
                    "decode_ms_per_token")
OVERALL_COLUMNS = ("n", "delta_pp", "delta_ci_low", "delta_ci_high", "relative_loss", "memory_reduction")
#: Summary columns of the paired test, copied into the CSV (per task and pooled) when the summary has them.
TEST_COLUMNS = ("delta_method", "n_only_strategy", "n_only_baseline", "mcnemar_p")
ROW_COLUMNS = ("setting", "strategy", "label", "name", "family", "params", "model", "spec_version")

DEFAULT_SORT = f"{OVERALL}.delta_pp"
CSV_FLOAT_FORMAT = "%.6g"


def overall_summary(records: pd.DataFrame, tasks: Sequence[str]) -> pd.DataFrame:
    """Per-strategy figures pooled over ``tasks`` (task column :data:`OVERALL`), paired per sample.

    Only strategies measured on every task are pooled: a strategy seen on the easy task alone would
    otherwise look better than one measured everywhere. Only one context length is pooled (spec v1.2 §2.3):
    the one most tasks were measured at (the longest on a tie); tasks at other lengths keep their own columns.
    """
    if "context_tokens" in records and records["context_tokens"].notna().any():
        per_length = records.groupby("context_tokens")["task"].nunique()
        records = records[records["context_tokens"] == max(per_length.index, key=lambda t: (per_length[t], t))]
        tasks = [t for t in tasks if t in set(records["task"])]
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

    table: pd.DataFrame  # one row per (setting, strategy)
    summary: pd.DataFrame  # per (setting, task, strategy) rows plus the OVERALL rows, with a setting column
    records: pd.DataFrame  # the paired records the summary was computed from (setting and depth columns)
    tasks: list[str]
    meta: dict[str, str] = field(default_factory=dict)
    sort: str = DEFAULT_SORT
    reverse: bool = False

    @property
    def settings(self) -> list[str]:
        """The query settings present, query-aware first."""
        have = set(self.table["setting"]) if "setting" in self.table else set()
        return [s for s in SETTINGS if s in have] + sorted(have - set(SETTINGS))


def _params_text(value: Any) -> str:
    text = json_text(value)
    try:
        params = json.loads(text)
    except (TypeError, ValueError):
        return text
    if not isinstance(params, dict):
        return text
    return ", ".join(f"{k}={params[k]}" for k in sorted(params))



def _summaries(paired: pd.DataFrame, tasks: list[str]) -> pd.DataFrame:
    """Per-task and pooled summaries, computed apart per query setting (the two settings never pair)."""
    parts = []
    for setting in [s for s in SETTINGS if s in set(paired["setting"])]:
        recs = paired[paired["setting"] == setting]
        if BASELINE not in set(recs["strategy"]):
            raise KVBenchError(f"no {BASELINE!r} baseline records in the {setting} setting; every run records "
                               "it, so the store is incomplete — rerun a benchmark")
        per_task = summarize(recs)
        overall = overall_summary(recs, tasks)
        both = pd.concat([per_task, overall], ignore_index=True) if not overall.empty else per_task
        # Keep the summary's own setting column when it provides one (it groups by setting itself).
        parts.append(both if "setting" in both.columns else both.assign(setting=setting))
    return pd.concat(parts, ignore_index=True)


def build(records: pd.DataFrame, filters: Filters | None = None, sort: str | None = None,
          reverse: bool = False, depth_key: str | None = None) -> Leaderboard:
    """Select, check, pair and summarise ``records`` (as :func:`kvbench.results.read_store` returns them)."""
    filters = filters or Filters()
    chosen = select_records(records, filters)
    check_comparable(chosen)
    if BASELINE not in set(chosen["strategy"]):
        raise KVBenchError(f"no {BASELINE!r} baseline records in the selection; every run records it, so the "
                           "store is incomplete — rerun a benchmark")
    paired = paired_records(chosen, depth_key)
    tasks = sorted(paired["task"].astype(str).unique())
    if OVERALL in tasks:
        raise KVBenchError(f"a task named {OVERALL!r} clashes with the pooled columns; filter it out with --task")
    summary = _summaries(paired, tasks)
    tests = [c for c in TEST_COLUMNS if c in summary.columns]

    firsts = paired.drop_duplicates("strategy").set_index("strategy")
    rows = []
    for setting in [s for s in SETTINGS if s in set(summary["setting"])]:
        in_setting = summary[summary["setting"] == setting]
        for label in sorted(in_setting["strategy"].unique()):
            first = firsts.loc[label]
            row: dict[str, Any] = {
                "setting": setting,
                "strategy": label,
                "label": shorten(label),
                "name": first.get("strategy_name", label),
                "family": first.get("family", ""),
                "params": _params_text(first.get("params")),
                "model": str(first.get("model", "")),
                "spec_version": str(first.get("spec_version", "")),
            }
            for scope in [*tasks, OVERALL]:
                hit = in_setting[(in_setting["task"] == scope) & (in_setting["strategy"] == label)]
                cols = (OVERALL_COLUMNS if scope == OVERALL else CSV_TASK_COLUMNS) + tuple(tests)
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


def _distinct(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna()})


def sort_leaderboard(lb: Leaderboard, column: str, reverse: bool = False) -> Leaderboard:
    """Order rows best-first by ``column`` (any CSV column) within each setting; ``reverse`` flips it.
    Missing values go last.

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
    if "setting" in order.columns:
        rank = {s: i for i, s in enumerate(SETTINGS)}
        order = order.sort_values("setting", kind="mergesort",
                                  key=lambda s: s.map(lambda v: rank.get(v, len(rank))))
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
    if kind == "acc":
        return f"{value:.3f}"
    return str(value)


def fmt_delta(delta: Any, low: Any, high: Any) -> str:
    """``+0.0 [-2.1, +1.9]``: the point estimate with its paired 95% interval (Newcombe's for binary scores, BCa
    bootstrap for continuous ones: :func:`kvbench.spec.accuracy_delta`)."""
    if _isnan(delta):
        return "–"
    return f"{fmt(delta, 'pp')} [{fmt(low, 'pp')}, {fmt(high, 'pp')}]"




def _discordant(plus: Any, minus: Any) -> str:
    if _isnan(plus) or _isnan(minus):
        return "–"
    return f"+{int(plus)} / −{int(minus)}"


def display_columns(lb: Leaderboard, table: pd.DataFrame | None = None) -> list[tuple[str, str, list[str]]]:
    """(header, sort-key column, cells) per displayed column, in order; shared by markdown and HTML."""
    t = lb.table if table is None else table
    cols: list[tuple[str, str, list[str]]] = [
        ("strategy", "label", list(t["label"])),
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
                cells = ["reference" if s == BASELINE else fmt_delta(d, lo, hi) for s, d, lo, hi in
                         zip(t["strategy"], t[key], t[f"{scope}.delta_ci_low"], t[f"{scope}.delta_ci_high"],
                             strict=True)]
            else:
                cells = [fmt(v, kind) for v in t[key]]
            cols.append((f"{name}: {header}", key, cells))
            if kind == "delta" and scope == OVERALL and f"{scope}.n_only_strategy" in t.columns:
                # The discordant pairs behind the delta: samples only the strategy / only full got right.
                cells = [_discordant(a, b) for a, b in
                         zip(t[f"{scope}.n_only_strategy"], t[f"{scope}.n_only_baseline"], strict=True)]
                cols.append((f"{name}: only strategy / only {BASELINE} right", f"{scope}.n_only_baseline", cells))
    cols += [("model", "model", list(t["model"])), ("spec", "spec_version", list(t["spec_version"]))]
    return cols


def _header_lines(lb: Leaderboard) -> list[str]:
    m = lb.meta
    direction = "reversed" if lb.reverse else "best first"
    method = ""
    if any(c.endswith(".delta_method") for c in lb.table.columns):
        method = " (method per row in the CSV's `delta_method`)"
    return [
        f"Model **{m['model']}**, measurement spec v{m['spec_version']}, hardware profile {m['hardware']}, "
        f"dtype {m['dtype']}; {m['records']} records; tasks: {', '.join(lb.tasks)}; filters: {m['filters']}.",
        "",
        f"Δ acc: strategy − `{BASELINE}` accuracy in percentage points on identical samples, with the paired "
        f"95% CI{method} (spec §2). mem. red.: 1 − KV bytes held / dense 16-bit bytes (spec §1); `tiered` "
        "keeps only its hot tier on the device, so its figure is device memory, not bytes saved. "
        "KV B/tok: bytes held per context token. prefill s: the shared full-attention prefill (median); "
        "decode ms/tok: median time per output token (spec §3). *all tasks* pools the samples of every task "
        "measured at the most common context length, never across lengths (strategies measured on every such "
        "task only). These columns are exploratory: unclustered and unadjusted; verdicts are in "
        "claim_check.md (spec §2.2-2.3). Strategies are named by the parameters that differ from "
        "their defaults; the full parameters are in leaderboard.csv.",
        "",
        f"Sorted by `{lb.sort}` ({direction}) within each query setting. Regenerate with `kvbench leaderboard`; "
        "columns and raw values are in leaderboard.csv.",
    ]


def _setting_heading(setting: str) -> str:
    return SETTING_TEXT.get(setting, setting)


def baseline_line(lb: Leaderboard, setting: str) -> str:
    """The baseline's own accuracy per task in one setting, with its 95% interval (Wilson for binary scores,
    BCa bootstrap for continuous ones, spec §2): what every Δ in the table is measured against."""
    rows = lb.summary[(lb.summary["setting"] == setting) & (lb.summary["strategy"] == BASELINE)]
    parts = []
    for task in lb.tasks:
        hit = rows[rows["task"] == task]
        if hit.empty or "accuracy_ci_low" not in hit.columns:
            continue
        r = hit.iloc[0]
        parts.append(f"{task} {fmt(r['accuracy'], 'acc')} [{fmt(r['accuracy_ci_low'], 'acc')}, "
                     f"{fmt(r['accuracy_ci_high'], 'acc')}] (n = {int(r['n'])})")
    if not parts:
        return ""
    return f"Baseline (`{BASELINE}`) accuracy with its 95% interval: " + "; ".join(parts) + "."


def render_markdown(lb: Leaderboard) -> str:
    """The leaderboard as a GitHub-flavoured markdown page: one labelled table per query setting."""
    lines = ["# kvbench leaderboard", "", *_header_lines(lb), ""]
    for setting in lb.settings:
        part = lb.table[lb.table["setting"] == setting]
        cols = display_columns(lb, part)
        title, _, explain = _setting_heading(setting).partition(": ")
        lines += [f"## {title[:1].upper()}{title[1:]}", "", f"{explain[:1].upper()}{explain[1:]}.", ""]
        if base := baseline_line(lb, setting):
            lines += [base, ""]
        lines.append("| " + " | ".join(h for h, _, _ in cols) + " |")
        lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|")
        for i in range(len(part)):
            lines.append("| " + " | ".join(_md_cell(c[2][i]) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def render_csv(lb: Leaderboard) -> str:
    """Raw values, one row per (setting, strategy), fixed float format."""
    return lb.table.to_csv(index=False, float_format=CSV_FLOAT_FORMAT, lineterminator="\n")


_INLINE_MD = (
    (re.compile(r"`([^`]+)`"), r"<code>\1</code>"),
    (re.compile(r"\*\*([^*]+)\*\*"), r"<strong>\1</strong>"),
    (re.compile(r"\*([^*]+)\*"), r"<em>\1</em>"),
)


def inline_markdown(text: str) -> str:
    """HTML for the inline markdown the page header uses (code, bold, emphasis); everything else escaped."""
    out = html.escape(text, quote=False)
    for pattern, repl in _INLINE_MD:
        out = pattern.sub(repl, out)
    return out


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;font-size:13px;margin-bottom:2em}
th,td{border:1px solid #ccc;padding:4px 8px;white-space:nowrap}
th{background:#f0f0f0;cursor:pointer;position:sticky;top:0}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}
p{max-width:70em}"""

# Click a header to sort by it, best first (data-best: "desc" where larger is better); click again to flip.
# Cells carry their raw value in data-v, so numbers sort numerically and missing values (empty data-v)
# stay last in both directions. Each table sorts on its own.
_JS = """document.querySelectorAll("table").forEach(function(table){
var heads=table.tHead.rows[0].cells;Array.prototype.forEach.call(heads,function(th,col){
th.addEventListener("click",function(){var tb=table.tBodies[0],best=th.getAttribute("data-best")||"asc";
var dir=th.classList.contains("asc")?"desc":(th.classList.contains("desc")?"asc":best),asc=dir==="asc";
Array.prototype.forEach.call(heads,function(h){h.classList.remove("asc","desc")});th.classList.add(dir);
var rows=Array.prototype.slice.call(tb.rows);rows.sort(function(a,b){
var x=a.cells[col].getAttribute("data-v"),y=b.cells[col].getAttribute("data-v");
if(x===""||y===""){return x===y?0:(x===""?1:-1)}
var nx=Number(x),ny=Number(y),c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
return asc?c:-c});rows.forEach(function(r){tb.appendChild(r)})})})});"""


def _best_direction(key: str) -> str:
    metric = key.rsplit(".", 1)[-1]
    return "desc" if HIGHER_IS_BETTER.get(metric, False) else "asc"


def _html_table(lb: Leaderboard, setting: str) -> str:
    part = lb.table[lb.table["setting"] == setting]
    cols = display_columns(lb, part)
    esc = html.escape
    heads = []
    for h, key, _ in cols:
        cls = ""
        if key == lb.sort:  # the order the rows are in now
            best = _best_direction(key)
            cls = f' class="{best if not lb.reverse else ("asc" if best == "desc" else "desc")}"'
        heads.append(f'<th data-best="{_best_direction(key)}" data-key="{esc(key)}"{cls}>{esc(h)}</th>')
    body = []
    for i in range(len(part)):
        cells = []
        for _, key, shown in cols:
            raw = part[key].iloc[i]
            numeric = isinstance(raw, (numbers.Number, np.number)) and not isinstance(raw, (bool, np.bool_))
            value = "" if _isnan(raw) else (format(float(raw), ".6g") if numeric else str(raw))
            cls = ' class="num"' if numeric else ""
            cells.append(f'<td{cls} data-v="{esc(value)}">{esc(shown[i])}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    title, _, explain = _setting_heading(setting).partition(": ")
    base = baseline_line(lb, setting)
    return (f'<h2 id="{esc(setting)}">{esc(title[:1].upper() + title[1:])}</h2>\n'
            f"<p>{inline_markdown(explain[:1].upper() + explain[1:])}.</p>\n"
            + (f"<p>{inline_markdown(base)}</p>\n" if base else "")
            + f'<table data-setting="{esc(setting)}">\n<thead><tr>{"".join(heads)}</tr></thead>\n<tbody>\n'
            + "\n".join(body) + "\n</tbody></table>\n")


def render_html(lb: Leaderboard) -> str:
    """A self-contained page: inline CSS, inline click-to-sort script, no external assets."""
    intro = "".join(f"<p>{inline_markdown(line)}</p>" for line in _header_lines(lb) if line)
    tables = "".join(_html_table(lb, s) for s in lb.settings)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>kvbench leaderboard</title>\n"
            f"<style>\n{_CSS}\n</style></head>\n<body>\n<h1>kvbench leaderboard</h1>\n{intro}\n"
            f"{tables}<script>\n{_JS}\n</script>\n</body></html>\n")


def render_claim_check(lb: Leaderboard) -> str:
    """``claim_check.md``: :mod:`kvbench.claims` on each query setting's rows apart (a claim holds or fails
    within one setting), one section per setting when there are two."""
    settings = lb.settings
    parts = []
    for setting in settings:
        summary = lb.summary[lb.summary["setting"] == setting]
        records = lb.records[lb.records["setting"] == setting]
        meta = {**lb.meta, "setting": setting}
        text = render_claims(check_claims(summary, meta, records))
        if len(settings) > 1:
            head, _, rest = text.partition("\n")
            title = _setting_heading(setting).split(":")[0]
            text = f"{head} — {title}\n\n*{_setting_heading(setting)}.*\n{rest}"
        parts.append(text.rstrip("\n") + "\n")
    return "\n".join(parts)


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
    p.add_argument("--out-dir", default=None, help="where to write (default: the results directory)")
    p.add_argument("--sort", default=DEFAULT_SORT,
                   help=f"column to rank by, best first (any leaderboard.csv column, default {DEFAULT_SORT})")
    p.add_argument("--reverse", action="store_true", help="reverse the --sort order")
    p.add_argument("--plots", action="store_true", help="also draw the comparison plots into <out-dir>/plots")
    p.add_argument("--plots-only", action="store_true", help="draw the plots only (no tables, no claim check)")
    p.add_argument("--needle-strategy", action="append", default=None,
                   help="strategy (short or full label) for the needle heatmaps, repeatable "
                        "(default: the most informative per task)")
    p.add_argument("--depth-key", default=None,
                   help=f"sample_meta key holding the needle depth (default: first of {', '.join(DEPTH_KEYS)})")
    return p


def _write_from_args(args: argparse.Namespace) -> list[Path]:
    out_dir = Path(args.out_dir or args.results_dir)
    lb = build(read_store(args.results_dir), filters_from_args(args), args.sort, args.reverse, args.depth_key)
    paths = [] if args.plots_only else write(lb, out_dir)
    if args.plots or args.plots_only:
        from kvbench.plots import write_all

        paths += write_all(lb.records, lb.summary, out_dir / "plots", needle_strategies=args.needle_strategy)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench leaderboard``; returns the exit status (0 ok, 2 bad input)."""
    return run_cli("leaderboard", build_parser(), argv, _write_from_args)


if __name__ == "__main__":
    sys.exit(main())
