"""The leaderboard's pages: ``leaderboard.md`` and ``leaderboard.html`` (the answer sentence and table per query
setting, then the offloading, per-task and latency tables), ``leaderboard.csv`` (every raw figure) and
``claim_check.md`` (:mod:`kvbench.claims` per setting). Every name is escaped for its format (:mod:`kvbench.fmt`);
every figure is formatted with a fixed format, so the pages are a pure function of the table.
"""

from __future__ import annotations

import html
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvbench import claims, fmt
from kvbench.claims import check_claims, render_claims
from kvbench.leaderboard.table import (
    BASELINE_FLOOR,
    BEYOND,
    OFFLOADING,
    RANKED,
    REFERENCE,
    STOPPED,
    UNDECIDED_IN,
    UNDECIDED_OUT,
    WITHIN,
    Leaderboard,
    baseline_accuracy,
    margin_pp,
    shown_interval,
    task_lengths,
)
from kvbench.record import HIGHER_IS_BETTER
from kvbench.vocab import BASELINE, OVERALL, SETTING_TEXT

#: Per-task figures of the detail tables, as (summary column, header, format). ``delta_pp`` is rendered
#: together with its CI columns.
TASK_METRICS: tuple[tuple[str, str, str], ...] = (
    ("delta_pp", "Δ pp [95% CI]", "delta"),
    ("memory_reduction", "mem. saved", "pct"),
    ("n", "n", "int"),
)
#: Latency detail per task (the shared prefill is one number per task, given above the table).
LATENCY_METRICS: tuple[tuple[str, str, str], ...] = (
    ("bytes_per_token", "KV B/tok", "bytes"),
    ("decode_ms_per_token", "decode ms/tok", "ms"),
)
#: Per-task columns that count memory saved or held: an offloading row shows none there (its figure is device
#: memory, in its own table), so no column mixes bytes saved with bytes moved off the device.
MEMORY_COLUMNS = ("memory_reduction", "bytes_per_token")
#: Number formats of :func:`fmt_value` per kind of figure.
_SPECS = {"bytes": ",.1f", "s": ".3f", "ms": ".2f", "acc": ".3f"}
CSV_FLOAT_FORMAT = "%.6g"


# ----------------------------------------------------------------------------------------- rendering


def _isnan(v: Any) -> bool:
    return fmt.is_missing(v)


def fmt_value(value: Any, kind: str) -> str:
    """Fixed formatting per kind of figure; missing values print as ``–``."""
    if _isnan(value):
        return fmt.MISSING
    if kind == "pct":
        return fmt.pct(value)
    if kind == "pp":
        return fmt.pp(value)
    if kind == "int":
        return f"{int(value)}"
    return fmt.number(value, _SPECS[kind]) if kind in _SPECS else str(value)


@dataclass(frozen=True)
class Column:
    """One displayed column: header, the CSV column its cells sort by in the browser, plain-text cells."""

    header: str
    key: str
    cells: list[str]
    numeric: bool = True


def _label_cell(row: Mapping[str, Any]) -> str:
    partial = row.get("partial")
    return f"{row['label']} (partial)" if isinstance(partial, (bool, np.bool_)) and partial else str(row["label"])


def _rank_cell(row: Mapping[str, Any]) -> str:
    if row["section"] == REFERENCE:
        return "ref."
    if _isnan(row["rank"]):
        return fmt.MISSING
    return f"{int(row['rank'])}{'=' if row['tie'] else ''}"


def _n_cell(row: Mapping[str, Any]) -> str:
    n, docs = row.get(f"{OVERALL}.n"), row.get(f"{OVERALL}.documents")
    if _isnan(n):
        return fmt.MISSING
    return f"{int(n)} / {int(docs)}" if not _isnan(docs) else f"{int(n)}"


def _delta_cell(row: Mapping[str, Any], scope: str) -> str:
    if row["section"] == REFERENCE:
        return "reference"
    return fmt.delta_interval(*shown_interval(row, scope))


def main_columns(part: pd.DataFrame, memory: str = "memory saved") -> list[Column]:
    """The answer table: rank, strategy, family, memory saved, pooled Δ [95% CI], verdict, n."""
    rows = part.to_dict("records")
    return [
        Column("#", "rank", [_rank_cell(r) for r in rows]),
        Column("strategy", "label", [_label_cell(r) for r in rows], numeric=False),
        Column("family", "family", [str(r["family"]) for r in rows], numeric=False),
        Column(memory, f"{OVERALL}.memory_reduction", [fmt.pct(r[f"{OVERALL}.memory_reduction"]) for r in rows]),
        Column("Δ acc. pp [95% CI]", f"{OVERALL}.delta_pp", [_delta_cell(r, OVERALL) for r in rows]),
        Column(f"verdict (margin −{margin_pp():g} pt)", "verdict_order",
               [str(r[f"{OVERALL}.verdict"]) or fmt.MISSING for r in rows], numeric=False),
        Column("n (questions / docs)", f"{OVERALL}.n", [_n_cell(r) for r in rows]),
    ]


def task_columns(lb: Leaderboard, part: pd.DataFrame,
                 metrics: tuple[tuple[str, str, str], ...] = TASK_METRICS) -> list[Column]:
    """A detail table: the strategy, then ``metrics`` per task."""
    rows = part.to_dict("records")
    cols = [Column("strategy", "label", [_label_cell(r) for r in rows], numeric=False)]
    for task in lb.tasks:
        for col, header, kind in metrics:
            key = f"{task}.{col}"
            if key not in part.columns:
                continue
            cells = ([_delta_cell(r, task) for r in rows] if kind == "delta"
                     else [fmt.MISSING if col in MEMORY_COLUMNS and r["section"] == OFFLOADING
                           else fmt_value(r[key], kind) for r in rows])
            cols.append(Column(f"{task}: {header}", key, cells))
    return cols


def display_columns(lb: Leaderboard, table: pd.DataFrame | None = None) -> list[tuple[str, str, list[str]]]:
    """(header, sort-key column, cells) of the answer table, in order (kept for notebooks and scripts)."""
    return [(c.header, c.key, c.cells) for c in main_columns(lb.table if table is None else table)]


def _standing(lb: Leaderboard, style: type = fmt.Markdown) -> list[str]:
    """What kind of evidence the page is, first: a design declared after the data makes it exploratory, one
    registered before the store's first record confirmatory (spec v1.3 §2.7)."""
    d = lb.design
    if d is None or not d.registered:
        return []
    # d.registered is Markdown already (the file name as code); other styles get it as plain, escaped text
    reg = d.registered if style is fmt.Markdown else style.text(d.registered.replace("`", ""))
    if d.post_hoc:
        return [f"{style.bold('Exploratory (post hoc design)')}: the design judging this store, "
                f"{reg}, was registered after its records were in; its verdicts describe "
                "these data and are not a confirmatory test (the reason is in the claim check)."]
    return [f"{style.bold('Confirmatory')}: judged by the design {reg}, registered before "
            "the store's first record; verdicts only at its pre-registered looks."]


def _header_lines(lb: Leaderboard, style: type = fmt.Markdown) -> list[str]:
    m, t, c = lb.meta, style.text, style.code
    method = ""
    if any(col.endswith(".delta_method") for col in lb.table.columns):
        method = f" (method per row in the CSV's {c('delta_method')})"
    return _standing(lb, style) + [
        f"Model {style.bold(t(m['model']))}, measurement spec v{t(m['spec_version'])}, hardware profile "
        f"{t(m['hardware'])}, dtype {t(m['dtype'])}; {t(m['records'])} records; tasks: {t(', '.join(lb.tasks))}; "
        f"filters: {t(m['filters'])}.",
        f"Memory saved: 1 − KV bytes held / dense 16-bit bytes (spec §1). Δ acc.: strategy − {c(BASELINE)} "
        f"accuracy in percentage points on identical samples, pooled over the tasks measured at one context length "
        f"(each table's heading names them, and the tasks left out), with the paired 95% interval clustered by "
        f"source work (connected components of shared works, spec v1.2 §2.2; per-task columns clustered the same "
        f"way{method}, exploratory). "
        f"Verdict (spec §2.3, the claim check's words): non-inferiority at that interval against the "
        f"{margin_pp():g}-point margin, Holm-adjusted over the strategies ranked in the setting — {t(WITHIN)} (the "
        f"whole interval above −{margin_pp():g}), {t(UNDECIDED_IN)} / {t(UNDECIDED_OUT)} (the interval holds both; "
        f"split by where Δ lies), {t(BEYOND)} (the whole interval at or below −{margin_pp():g})"
        + (f", and under the design's futility boundary {t(STOPPED)} (not shown to hold, sampling stopped; not "
           "shown to fail)" if lb.design is not None and lb.design.futility > 0 else "") + ". Rows are sorted "
        f"by the verdict, then memory saved (rows that fail by Δ, the smallest loss first); rows equal in all of "
        f"these are ties (=). n: questions / clusters of shared works behind the pooled Δ. No answer is named where "
        f"{c(BASELINE)}'s own accuracy on the pooled tasks has a 95% interval reaching below {BASELINE_FLOOR:g}.",
    ] + ([f"{style.bold('Group-sequential')} (spec v1.2 §2.5): every figure is {style.bold('look ' + t(m['look']))} "
          f"of {t(m['n_looks'])} ({t(m['look_contexts'])} contexts of every task); verdicts are taken at the "
          f"design's looks against their nominal levels, not at 0.025 ({t(m['design'])})"
          + (f"; {t(m['after_look'])} record(s) measured after this look wait for the next one" if
             m.get("after_look", "0") != "0" else "")
          + (f"; not sampled after the look named, each once its verdict was final there, so its row is that "
             f"look's: {t(m['stopped'])}" if m.get("stopped") else "") + "."]
         if m.get("look", "0") != "0" else
         [f"{style.bold('Group-sequential')} (spec v1.2 §2.5): no look of the design is complete yet "
          f"({t(m['design'])}): every figure is interim, over every record measured so far, and no verdict below "
          "is the design's."] if "design" in m else []) \
        + ([f"{style.bold('Partial')}: {t(m['partial'])} record(s) come from runs that have not finished (their "
          "records.jsonl, not yet in the store); the rows they enter are marked (partial) and will change when "
          "the runs complete."] if m.get("partial", "0") != "0" else [])


def _setting_heading(setting: str) -> str:
    return SETTING_TEXT.get(setting, setting)


def baseline_line(lb: Leaderboard, setting: str, style: type = fmt.Markdown) -> str:
    """The baseline's own accuracy per task in one setting, with its 95% interval (Wilson for binary scores,
    BCa bootstrap for continuous ones, spec §2): what every Δ in the table is measured against."""
    rows = lb.summary[(lb.summary["setting"] == setting) & (lb.summary["strategy"] == BASELINE)]
    parts = []
    for task in lb.tasks:
        hit = rows[rows["task"] == task]
        if hit.empty or "accuracy_ci_low" not in hit.columns:
            continue
        r = hit.iloc[0]
        parts.append(f"{style.text(task)} {fmt_value(r['accuracy'], 'acc')} [{fmt_value(r['accuracy_ci_low'], 'acc')}, "
                     f"{fmt_value(r['accuracy_ci_high'], 'acc')}] (n = {int(r['n'])})")
    if not parts:
        return ""
    return f"Baseline ({style.code(BASELINE)}) accuracy with its 95% interval: " + "; ".join(parts) + "."


def _setting_rows(lb: Leaderboard, setting: str, section: str | tuple[str, ...]) -> pd.DataFrame:
    sections = (section,) if isinstance(section, str) else section
    part = lb.table[(lb.table["setting"] == setting) & lb.table["section"].isin(sections)]
    if REFERENCE in sections:  # the reference row closes the table: it is what the others are measured against
        part = pd.concat([part[part["section"] != REFERENCE], part[part["section"] == REFERENCE]])
    return part


def answer_shown(lb: Leaderboard, setting: str) -> bool:
    """Whether ``setting`` gets an answer: ``full``'s accuracy on the pooled tasks is at least
    :data:`BASELINE_FLOOR` at the lower end of its 95% interval (unknown counts as shown: there is no pooled
    baseline to judge, and no row is ranked)."""
    _, low, _, _ = baseline_accuracy(lb.summary, setting)
    return fmt.is_missing(low) or low >= BASELINE_FLOOR


def answer_sentence(lb: Leaderboard, setting: str, style: type = fmt.Markdown) -> str:
    """One sentence answering "which strategy saves the most memory within the margin?" in ``setting``,
    generated from the verdicts (:func:`claim_verdicts`) of the ranked rows; the answer is the first row.
    Where ``full`` itself is below :data:`BASELINE_FLOOR`, a plain sentence says so instead of an answer."""
    ranked = _setting_rows(lb, setting, RANKED)
    ranked = ranked[ranked["rank"].notna()].sort_values(["rank", "strategy"], kind="mergesort")
    c, margin = style.code, f"{margin_pp():g} point"
    if ranked.empty:
        return "No strategy that saves bytes was measured on every task in this setting, so none is ranked."
    if not answer_shown(lb, setting):
        accuracy, low, high, n = baseline_accuracy(lb.summary, setting)
        return (f"No answer: {c(BASELINE)} itself scores {fmt_value(accuracy, 'acc')} [{fmt_value(low, 'acc')}, "
                f"{fmt_value(high, 'acc')}] (n = {n}) on the pooled tasks "
                f"({style.text(lb.pooled_scope(setting).text())}); below a lower end of {BASELINE_FLOOR:g}, ten "
                "times the margin, this page names none — a strategy cannot lose what the baseline never had, so Δ "
                "against it says nothing about what compression keeps. The rows below are ordered as usual.")
    top = ranked.iloc[0]
    tied = ranked[ranked["rank"] == top["rank"]]
    names = " and ".join(c(label) for label in tied["label"])
    figures = (f"{fmt.pct(top[f'{OVERALL}.memory_reduction'])} less KV memory, Δ "
               f"{_delta_cell(top, OVERALL)} pp, n = {_n_cell(top)}, {style.text(lb.pooled_scope(setting).included())}")
    who = f"{names} ({'tied, ' if len(tied) > 1 else ''}{figures})"
    verdict = top[f"{OVERALL}.verdict"]
    if verdict == WITHIN:
        text = (f"Answer: {who} saves the most memory while staying within {margin} of {c(BASELINE)} "
                "— the whole interval is inside the margin.")
    elif verdict == UNDECIDED_IN:
        why = f"its interval holds losses both under and over {margin}"
        if top.get(f"{OVERALL}.verdict_ci_low", float("nan")) > -margin_pp():
            # The 95% interval clears the margin, yet the verdict's test (Holm within the ranked strategies,
            # and under a sequential design the look's stricter level) has not: say which.
            look = lb.meta.get("look", "0")
            why = ("its 95% interval lies above the margin, but the test the verdict rests on is stricter: Holm "
                   "over the ranked strategies" + (f" at look {look} of {lb.meta.get('n_looks', '?')} of the "
                                                   "sequential design" if look != "0" else ""))
        text = (f"Answer: no strategy is shown to stay within {margin} of {c(BASELINE)} at this n; the largest "
                f"saving whose Δ is within the margin is {who}, {claims.UNDETERMINED} — {why}.")
    elif verdict == STOPPED:
        text = (f"Answer: no strategy is shown to stay within {margin} of {c(BASELINE)}; the first not shown to fail, "
                f"{who}, was stopped for futility at the design's boundary.")
    elif verdict == UNDECIDED_OUT:
        text = (f"Answer: no strategy is shown to stay within {margin} of {c(BASELINE)}, and every point "
                f"estimate loses more; the largest saving still {claims.UNDETERMINED} is {who}.")
    else:
        text = (f"Answer: every strategy loses more than {margin} against {c(BASELINE)} (whole interval beyond "
                f"the margin); the first is {who}.")
    return style.bold(text)


def _md_table(cols: list[Column]) -> list[str]:
    """Headers and text columns (names) are escaped; number columns are ours and only need their pipes escaped."""
    lines = ["| " + " | ".join(fmt.md_text(c.header) for c in cols) + " |",
             "|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|"]
    n = len(cols[0].cells) if cols else 0
    for i in range(n):
        lines.append("| " + " | ".join((fmt.md_cell if c.numeric else fmt.md_text)(c.cells[i]) for c in cols)
                     + " |")
    return lines


def _prefill_line(lb: Leaderboard, setting: str, style: type = fmt.Markdown) -> str:
    base = lb.table[(lb.table["setting"] == setting) & (lb.table["strategy"] == BASELINE)]
    if base.empty:
        return ""
    parts = [f"{style.text(t)} {fmt_value(base[f'{t}.prefill_s'].iloc[0], 's')} s" for t in lb.tasks
             if f"{t}.prefill_s" in base.columns]
    return ("The full-attention prefill is shared by every strategy of a sample (median): " + "; ".join(parts)
            + f". Decode: median time per output token after the first (spec §3). More latency figures "
            f"({style.code('ttft_s')}, per sample) are in leaderboard.csv and the latency plot.")


def _sections(lb: Leaderboard, setting: str) -> list[tuple[str, str, str, list[Column], str]]:
    """(anchor, title, context lengths, columns, note) of every table in one setting, in page order."""
    out = []
    pooled = lb.pooled_scope(setting).text()
    main = _setting_rows(lb, setting, (RANKED, REFERENCE))
    out.append((f"{setting}", "Ranked", pooled, main_columns(main), ""))
    moved = _setting_rows(lb, setting, OFFLOADING)
    if not moved.empty:
        out.append((f"{setting}-offloading", "Offloading: device memory, not bytes saved", pooled,
                    main_columns(moved, memory="device memory saved"),
                    "These strategies move cold KV entries to host RAM or disk instead of dropping or shrinking them: "
                    "their figure is the share of the cache kept off the device, not bytes saved, so they are "
                    "never ranked with the strategies above, and never shown in a memory column (their verdicts "
                    "read the same way)."))
    recs = lb.records[lb.records["setting"] == setting]
    lengths = "context tokens: " + "; ".join(f"{t} {task_lengths(recs, t)}" for t in lb.tasks)
    everything = _setting_rows(lb, setting, (RANKED, OFFLOADING, REFERENCE))
    left_out = "offloading" if not moved.empty else ""
    out.append((f"{setting}-tasks", "Per task", lengths, task_columns(lb, everything), left_out))
    out.append((f"{setting}-latency", "Memory and latency per task", lengths,
                task_columns(lb, everything, LATENCY_METRICS), f"prefill {left_out}".strip()))
    return out


def _heading(title: str, sub: str, lengths: str) -> str:
    """``Query-aware: per task (context tokens: fiction 2,048; legal 4,096)`` — plain text, escaped by the caller."""
    return f"{title}: {sub[:1].lower()}{sub[1:]} ({lengths})"


def _note(lb: Leaderboard, setting: str, note: str, style: type = fmt.Markdown) -> str:
    """A table's note: the markers ``prefill`` (the shared prefill line) and ``offloading`` (why its memory cells
    are empty) expand here; any other note is plain text, escaped."""
    words = note.split()
    if not words or not set(words) <= {"prefill", "offloading"}:
        return style.text(note) if note else ""
    parts = []
    if "prefill" in words:
        parts.append(_prefill_line(lb, setting, style))
    if "offloading" in words:
        names = ", ".join(style.code(x) for x in _setting_rows(lb, setting, OFFLOADING)["label"])
        parts.append(f"Offloading ({names}) is left out of the memory columns (–): what it keeps off the device is "
                     "not bytes saved; its device figure is in its own table above and in leaderboard.csv.")
    return " ".join(p for p in parts if p)


def _title(setting: str) -> tuple[str, str]:
    title, _, explain = _setting_heading(setting).partition(": ")
    return title[:1].upper() + title[1:], explain[:1].upper() + explain[1:]


def render_markdown(lb: Leaderboard) -> str:
    """The leaderboard as a GitHub-flavoured Markdown page: per query setting, the answer sentence and the
    answer table, then the offloading, per-task and latency tables. Names are escaped (fmt.md_text)."""
    lines = ["# kvbench leaderboard", "", *(x for line in _header_lines(lb) for x in (line, "")),
             "Per-task and latency detail follow each setting's table; every raw figure is in leaderboard.csv.",
             ""]
    for setting in lb.settings:
        title, explain = _title(setting)
        lines += [f"## {title}", "", f"{fmt.md_text(explain)}.", "", answer_sentence(lb, setting), ""]
        if base := baseline_line(lb, setting):
            lines += [base, ""]
        for _, sub, lengths, cols, note in _sections(lb, setting):
            lines += [f"### {fmt.md_text(_heading(title, sub, lengths))}", ""]
            if note := _note(lb, setting, note):
                lines += [note, ""]
            lines += [*_md_table(cols), ""]
        lines += _hardware_lines(lb, setting)
    return "\n".join(lines)


HARDWARE_NOTE = ("As many sequences as fit, weights in bf16, 0.1 of memory in reserve; speeds are roofline upper "
                 "bounds over each profile's figures (`kvbench advise`, docs/advise.md).")


def _hardware(lb: Leaderboard, setting: str) -> tuple[str, list[dict[str, str]]]:
    """"By hardware profile": its heading and what `kvbench advise` recommends for this model at the pooled length
    on each shipped profile, from this table (kvbench.advise.hardware_rows: the command's own code)."""
    from kvbench.advise import hardware_rows

    tokens = lb.pooled_scope(setting).tokens
    if not tokens or "," in lb.meta.get("model", ""):
        return "", []
    rows = hardware_rows(lb.table, lb.records[lb.records["setting"] == setting], lb.tasks, setting,
                         lb.meta["model"], tokens)
    return f"By hardware profile ({lb.meta['model']}, {tokens:,} tokens, pooled evidence)", rows


def _hardware_lines(lb: Leaderboard, setting: str) -> list[str]:
    from kvbench.advise import HARDWARE_COLUMNS

    heading, rows = _hardware(lb, setting)
    if not rows:
        return []
    return [f"### {fmt.md_text(heading)}", "", HARDWARE_NOTE, "", "| " + " | ".join(HARDWARE_COLUMNS) + " |",
            "|---|---|---:|---:|---|", *("| " + " | ".join(map(fmt.md_text, r.values())) + " |" for r in rows), ""]


def _html_hardware(lb: Leaderboard, setting: str) -> list[str]:
    from kvbench.advise import HARDWARE_COLUMNS

    heading, rows = _hardware(lb, setting)
    if not rows:
        return []
    esc = html.escape
    numeric = {"fits (recommended)", "tokens/s (bound)"}

    def cell(key: str, value: str) -> str:
        raw = value.split(" ")[0].replace(",", "") if key in numeric else value
        cls = ' class="num"' if key in numeric else ""
        return f'<td{cls} data-v="{esc("" if raw == "–" else raw)}">{esc(value)}</td>'

    heads = "".join(f"<th>{esc(c)}</th>" for c in HARDWARE_COLUMNS)
    body = "\n".join("<tr>" + "".join(cell(k, v) for k, v in r.items()) + "</tr>" for r in rows)
    return [f'<h3 id="{esc(setting)}-hardware">{esc(heading)}</h3>', f"<p>{inline_markdown(HARDWARE_NOTE)}</p>",
            f'<div class="scroll"><table id="table-{esc(setting)}-hardware" data-setting="{esc(setting)}">\n'
            f"<thead><tr>{heads}</tr></thead>\n<tbody>\n{body}\n</tbody></table></div>"]


def render_csv(lb: Leaderboard) -> str:
    """Raw values, one row per (setting, strategy), fixed float format; pandas quotes every field that needs
    it (RFC 4180), so a name holding commas, quotes or newlines stays in its column."""
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


# The answer table is narrow by construction (seven short columns); detail tables may scroll inside their
# own box, never the page.
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1320px}
table{border-collapse:collapse;font-size:13px;margin-bottom:1.5em}
div.scroll{overflow-x:auto;max-width:100%}
div.scroll th{white-space:normal;vertical-align:bottom}
th,td{border:1px solid #ccc;padding:4px 8px;white-space:nowrap}
th{background:#f0f0f0;cursor:pointer;position:sticky;top:0}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}
tr.answer td{background:#fff6d5;font-weight:600}
tr.reference td{color:#555;font-style:italic}
p.answer{font-size:15px;background:#fff6d5;padding:8px 12px;border-left:4px solid #e0b000}
code{background:#f3f3f3;padding:0 3px;border-radius:3px}
p{max-width:70em}
nav{margin-bottom:.5em}"""

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


def _html_table(lb: Leaderboard, part: pd.DataFrame, cols: list[Column], table_id: str, main: bool) -> str:
    esc = html.escape
    heads = []
    for c in cols:
        cls = ""
        if main and c.key == lb.sort:  # the order the rows are in now
            best = _best_direction(c.key)
            cls = f' class="{best if not lb.reverse else ("asc" if best == "desc" else "desc")}"'
        heads.append(f'<th data-best="{_best_direction(c.key)}" data-key="{esc(c.key)}"{cls}>{esc(c.header)}</th>')
    body = []
    rows = part.to_dict("records")
    answer = next((i for i, r in enumerate(rows) if r["section"] == RANKED and r["rank"] == 1), None)
    if rows and not answer_shown(lb, str(rows[0]["setting"])):
        answer = None  # full below the floor: no row is the answer
    for i, row in enumerate(rows):
        cells = []
        for c in cols:
            raw = row.get(c.key)
            numeric = isinstance(raw, (numbers.Number, np.number)) and not isinstance(raw, (bool, np.bool_))
            shown = c.cells[i] != fmt.MISSING  # a cell left blank on purpose sorts as missing too
            value = "" if _isnan(raw) or not shown else (format(float(raw), ".6g") if numeric else str(raw))
            cls = ' class="num"' if c.numeric else ""
            cells.append(f'<td{cls} data-v="{esc(value)}">{esc(c.cells[i])}</td>')
        kind = ' class="reference"' if row["section"] == REFERENCE else (
            ' class="answer"' if main and answer is not None and rows[answer]["rank"] == row["rank"]
            and row["section"] == RANKED else "")
        body.append(f'<tr{kind} data-strategy="{esc(str(row["strategy"]))}">' + "".join(cells) + "</tr>")
    setting = str(part["setting"].iloc[0]) if len(part) else ""
    table = (f'<table id="table-{esc(table_id)}" data-setting="{esc(setting)}">'
             f'\n<thead><tr>{"".join(heads)}</tr></thead>\n<tbody>\n' + "\n".join(body) + "\n</tbody></table>\n")
    return table if main else f'<div class="scroll">{table}</div>\n'


def _html_setting(lb: Leaderboard, setting: str) -> str:
    esc, h = html.escape, fmt.Html
    title, explain = _title(setting)
    sections = _sections(lb, setting)
    links = " · ".join(f'<a href="#{esc(a)}">{esc(sub.lower())}</a>' for a, sub, _, _, _ in sections if a != setting)
    answer = ' class="answer"' if answer_shown(lb, setting) else ""
    out = [f'<h2 id="{esc(setting)}">{esc(title)}</h2>', f"<p>{esc(explain)}.</p>",
           f'<p{answer}>{answer_sentence(lb, setting, h)}</p>']
    if base := baseline_line(lb, setting, h):
        out.append(f"<p>{base}</p>")
    out.append(f"<nav>Detail: {links}; every figure: leaderboard.csv</nav>")
    sections_with = {RANKED: (RANKED, REFERENCE)}
    for anchor, sub, lengths, cols, note in sections:
        ident = f' id="{esc(anchor)}"' if anchor != setting else ""  # the h2 holds the setting's own anchor
        out.append(f"<h3{ident}>{esc(_heading(title, sub, lengths))}</h3>")
        if note := _note(lb, setting, note, h):
            out.append(f"<p>{note}</p>")
        which = {f"{setting}": sections_with[RANKED], f"{setting}-offloading": (OFFLOADING,)}.get(
            anchor, (RANKED, OFFLOADING, REFERENCE))
        out.append(_html_table(lb, _setting_rows(lb, setting, which), cols, anchor, main=anchor == setting))
    out += _html_hardware(lb, setting)
    return "\n".join(out) + "\n"


def render_html(lb: Leaderboard) -> str:
    """A self-contained page (inline CSS and click-to-sort script, no external assets), laid out like the
    Markdown page; every name is HTML-escaped."""
    intro = "".join(f"<p>{line}</p>" for line in _header_lines(lb, fmt.Html))
    tables = "".join(_html_setting(lb, s) for s in lb.settings)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>kvbench leaderboard</title>\n"
            f"<style>\n{_CSS}\n</style></head>\n<body>\n<h1>kvbench leaderboard</h1>\n{intro}\n"
            f"{tables}<script>\n{_JS}\n</script>\n</body></html>\n")


def render_claim_check(lb: Leaderboard) -> str:
    """``claim_check.md``: :mod:`kvbench.claims` on each query setting's rows apart (a claim holds or fails
    within one setting), one section per setting when there are two.

    :func:`kvbench.claims.render_claims` writes names into Markdown as they come, so they are made
    Markdown-safe on the way in (:func:`kvbench.fmt.escape_names`: the same mapping for the summary and the
    records, so every pairing holds)."""
    settings = lb.settings
    parts = []
    for setting in settings:
        summary = fmt.escape_names(lb.summary[lb.summary["setting"] == setting])
        records = fmt.escape_names(lb.records[lb.records["setting"] == setting])
        meta = {k: fmt.md_name(str(v)) for k, v in {**lb.meta, "setting": setting}.items()}
        text = render_claims(check_claims(summary, meta, records, design=lb.design))
        if len(settings) > 1:
            head, _, rest = text.partition("\n")
            title = _setting_heading(setting).split(":")[0]
            text = f"{head} — {title}\n\n*{_setting_heading(setting)}.*\n{rest}"
        parts.append(text.rstrip("\n") + "\n")
    return "\n".join(parts)
