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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import claims, fmt, paired
from kvbench.claims import OVERALL, check_claims, render_claims
from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.record import HIGHER_IS_BETTER  # sort direction per metric: larger first where True
from kvbench.report import BASELINE, summarize
from kvbench.results import RECORD_KEY, atomic_write_text, read_store, read_unpublished
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
#: Summary columns copied into the CSV per task (the pages show a subset).
CSV_TASK_COLUMNS = ("n", "accuracy", "accuracy_ci_low", "accuracy_ci_high", "delta_pp", "delta_ci_low",
                    "delta_ci_high", "relative_loss",
                    "memory_reduction", "bytes_per_token", "kept_fraction", "prefill_s", "ttft_s",
                    "decode_ms_per_token")
OVERALL_COLUMNS = ("n", "delta_pp", "delta_ci_low", "delta_ci_high", "relative_loss", "memory_reduction")
#: Summary columns of the paired test, copied into the CSV (per task and pooled) when the summary has them.
TEST_COLUMNS = ("delta_method", "n_only_strategy", "n_only_baseline", "mcnemar_p")
ROW_COLUMNS = ("setting", "strategy", "label", "name", "family", "params", "model", "spec_version")

#: Where a row is shown: ranked strategies (bytes saved), the reference, offloading (device memory only).
RANKED, REFERENCE, OFFLOADING = "ranked", "reference", "offloading"
#: Columns ordering rows "best first" where *smaller* is better although the metric registry has no entry.
RANK_COLUMNS = ("rank", "verdict_order")

DEFAULT_SORT = "rank"
CSV_FLOAT_FORMAT = "%.6g"


# ------------------------------------------------------------------ verdicts: the one coupling to the claim check

#: Verdicts of a strategy's pooled Δ against the spec's accuracy margin, best first. They are the claim
#: check's three (kvbench.claims: holds / undetermined at this n / fails) with "undetermined" split by where
#: the point estimate lies, which is how the claim check picks among undetermined strategies.
WITHIN, UNDECIDED_IN, UNDECIDED_OUT, BEYOND, NOT_POOLED = (
    "within margin", "undetermined, Δ within", "undetermined, Δ beyond", "beyond margin", "not on every task")
VERDICT_ORDER = {WITHIN: 0, UNDECIDED_IN: 1, UNDECIDED_OUT: 2, BEYOND: 3, NOT_POOLED: 4}


def margin_pp() -> float:
    """The spec's accuracy margin in points (a loss under it counts as "within")."""
    return float(claims.LOSS_PP)


def claim_verdicts(summary: pd.DataFrame, setting: str, records: pd.DataFrame | None = None) -> dict[str, str]:
    """Each non-baseline strategy's verdict on the pooled scope of ``setting``, as the claim check judges it.

    The only place the leaderboard reads the claim check's judging (spec v1.2 §2.2–2.3): with ``records``, the
    clustered paired interval of :func:`kvbench.paired.compare` on the records the pooled row rests on (one
    context length, strategies measured on every task), and non-inferiority at the 1-point margin with Holm's
    correction over the strategies ranked in this setting (:func:`kvbench.paired.noninferiority`). Without
    records (a summary alone), the unadjusted pooled interval of the summary decides.
    """
    rows = summary[(summary["setting"] == setting) & (summary["task"] == OVERALL)
                   & (summary["strategy"] != BASELINE)]
    judged = {s: v.verdict for s, v in _judged(rows, setting, records).items()} \
        if records is not None and not records.empty else {}
    out = {}
    for row in rows.to_dict("records"):
        pick = claims.Pick.from_row(row)
        if math.isnan(pick.delta_pp) or math.isnan(pick.ci_low) or math.isnan(pick.ci_high):
            continue
        verdict = judged.get(pick.strategy)
        holds = verdict == paired.HOLDS if verdict else pick.ci_low > -margin_pp()
        fails = verdict == paired.FAILS if verdict else pick.ci_high <= -margin_pp()
        if holds:
            out[pick.strategy] = WITHIN
        elif fails:
            out[pick.strategy] = BEYOND
        else:
            out[pick.strategy] = UNDECIDED_IN if pick.within_pp(margin_pp()) else UNDECIDED_OUT
    return out


def _judged(rows: pd.DataFrame, setting: str, records: pd.DataFrame) -> dict[str, paired.NonInferiority]:
    """paired.noninferiority verdicts (with the clustered comparison each rests on) of ``rows``' strategies
    against ``full`` on the pooled records."""
    part = records[records["setting"] == setting] if "setting" in records else records
    if "context_tokens" in part and part["context_tokens"].notna().any():
        per_length = part.groupby("context_tokens")["task"].nunique()
        part = part[part["context_tokens"] == max(per_length.index, key=lambda t: (per_length[t], t))]
    ranked = [s for s, f in zip(rows["strategy"], rows["family"], strict=True) if not _offloading(f)]
    comparisons = [c for c in (paired.compare(part, s, BASELINE) for s in ranked) if c is not None]
    return {v.comparison.a: v for v in paired.noninferiority(comparisons)}


def _offloading(family: Any) -> bool:
    return str(family) in claims.OFFLOADING_FAMILIES


def _section(strategy: str, family: Any) -> str:
    if strategy == BASELINE:
        return REFERENCE
    return OFFLOADING if _offloading(family) else RANKED


def _document_ids(records: pd.DataFrame) -> pd.Series:
    """The document each record's context is drawn from, task-qualified: ``document_id`` when recorded,
    else the first of ``sample_meta["source_docs"]``, else the sample id (one document per sample)."""
    def one(row: Mapping[str, Any]) -> str:
        doc = row.get("document_id")
        if fmt.is_missing(doc) or doc == "":
            meta = row.get("sample_meta")
            if isinstance(meta, str):
                try:
                    meta = json.loads(meta)
                except ValueError:
                    meta = None
            docs = meta.get("source_docs") if isinstance(meta, dict) else None
            doc = docs[0] if isinstance(docs, list) and docs else str(row.get("sample_id")).split("#", 1)[0]
        return f"{row.get('task')}/{doc}"

    if records.empty:
        return pd.Series([], dtype=str)
    return pd.Series([one(r) for r in records.to_dict("records")], index=records.index)


def _add_verdicts(table: pd.DataFrame, summary: pd.DataFrame, records: pd.DataFrame) -> pd.DataFrame:
    """Section, verdict, documents and rank columns: rank 1 is the most memory saved among the best verdict.

    Rows equal on everything the order looks at (verdict, memory saved as shown, Δ and its interval —
    e.g. identical score vectors at one memory level) share a rank, shown as a tie, instead of being
    ranked by name.
    """
    table = table.copy()
    table["section"] = [_section(s, f) for s, f in zip(table["strategy"], table["family"], strict=True)]
    docs = _document_ids(records)
    ndocs = (records.assign(_doc=docs).groupby(["setting", "strategy"])["_doc"].nunique()
             if not records.empty else pd.Series(dtype=int))
    table[f"{OVERALL}.documents"] = [ndocs.get((st, s), float("nan")) for st, s in
                                     zip(table["setting"], table["strategy"], strict=True)]
    verdicts = {st: claim_verdicts(summary, st, records) for st in set(table["setting"])}
    # The interval each verdict rests on (clustered, spec v1.2 §2.2) is the one the answer table shows.
    judged = {st: _judged(summary[(summary["setting"] == st) & (summary["task"] == OVERALL)
                                  & (summary["strategy"] != BASELINE)], st, records)
              for st in set(table["setting"])} if not records.empty else {}
    for col, get in (("verdict_delta_pp", lambda c: c.estimate), ("verdict_ci_low", lambda c: c.low),
                     ("verdict_ci_high", lambda c: c.high), ("verdict_method", lambda c: c.method),
                     ("contexts", lambda c: c.n_contexts), ("clusters", lambda c: c.n_documents)):
        table[f"{OVERALL}.{col}"] = [
            get(judged[st][s].comparison) if s in judged.get(st, {}) else float("nan")
            for st, s in zip(table["setting"], table["strategy"], strict=True)]
    table[f"{OVERALL}.verdict"] = [
        "" if sec == REFERENCE else verdicts[st].get(s, NOT_POOLED)
        for st, s, sec in zip(table["setting"], table["strategy"], table["section"], strict=True)]
    table["verdict_order"] = [VERDICT_ORDER.get(v, float("nan")) for v in table[f"{OVERALL}.verdict"]]
    table["rank"] = float("nan")
    table["tie"] = False
    for setting in set(table["setting"]):
        part = table[(table["setting"] == setting) & (table["section"] == RANKED)
                     & (table[f"{OVERALL}.verdict"] != NOT_POOLED)]
        keys = {i: (row["verdict_order"], -round(float(row[f"{OVERALL}.memory_reduction"]), 3),
                    *(-_shown(row, OVERALL)[k] for k in range(3))) for i, row in part.iterrows()}
        order = sorted(keys, key=lambda i: (keys[i], table.at[i, "strategy"]))
        for i in order:
            first = next(j for j in order if keys[j] == keys[i])  # competition ranking: ties share a rank
            table.at[i, "rank"] = order.index(first) + 1
            table.at[i, "tie"] = sum(keys[j] == keys[i] for j in order) > 1
    return table


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


def read_records(results_dir: str | Path) -> pd.DataFrame:
    """The store plus the finished samples of runs not published to it yet (stopped or still running), those
    marked ``partial``: an interrupted run is visible without a separate publishing step."""
    store = read_store(results_dir)
    unpublished = read_unpublished(results_dir)
    if unpublished.empty:
        return store
    both = pd.concat([store.assign(partial=False), unpublished], ignore_index=True) if not store.empty \
        else unpublished
    return both.drop_duplicates(subset=RECORD_KEY, keep="last").reset_index(drop=True)


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
    table = _add_verdicts(pd.DataFrame(rows), summary, paired)
    if "partial" in paired.columns:  # rows resting on records of an unfinished run say so
        partial = paired[paired["partial"].fillna(False).astype(bool)].groupby(["setting", "strategy"]).size()
        table["partial"] = [(st, s) in partial.index for st, s in zip(table["setting"], table["strategy"],
                                                                       strict=True)]
    meta = {
        "model": ", ".join(_distinct(chosen["model"])),
        "spec_version": ", ".join(_distinct(chosen["spec_version"])),
        "hardware": ", ".join(_distinct(chosen["hardware"])) if "hardware" in chosen else "",
        "dtype": ", ".join(_distinct(chosen["dtype"])) if "dtype" in chosen else "",
        "records": str(len(paired)),
        "partial": str(int(paired["partial"].fillna(False).astype(bool).sum())) if "partial" in paired else "0",
        "filters": filters.describe(),
    }
    lb = Leaderboard(table=table, summary=summary, records=paired, tasks=tasks, meta=meta)
    return sort_leaderboard(lb, sort or DEFAULT_SORT, reverse)


def _distinct(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna()})


def sort_leaderboard(lb: Leaderboard, column: str, reverse: bool = False) -> Leaderboard:
    """Order rows best-first by ``column`` (any CSV column) within each setting; ``reverse`` flips it.
    Missing values go last.

    "Best" is larger for accuracy, deltas and memory reduction, smaller for the rank, bytes, loss and
    latency; text columns sort alphabetically. The default, ``rank``, is the verdict order of
    :func:`_add_verdicts` (unranked rows — the reference, offloading — last). Ties fall back to the
    pooled memory reduction (more first) and
    then the strategy label: successive stable sorts, so the order never depends on input order.
    """
    table = lb.table
    if column not in table.columns:
        raise KVBenchError(f"cannot sort by {column!r}; valid columns: {', '.join(table.columns)}")
    metric = column.rsplit(".", 1)[-1]
    numeric = metric in HIGHER_IS_BETTER or column in RANK_COLUMNS
    ascending = not HIGHER_IS_BETTER.get(metric, False) if numeric else True
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
    return fmt.is_missing(v)


def fmt_value(value: Any, kind: str) -> str:
    """Fixed formatting per kind of figure; missing values print as ``–``."""
    if _isnan(value):
        return fmt.MISSING
    if kind == "pct":
        return fmt.pct(value)
    if kind == "pp":
        return fmt.pp(value)
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


def _shown(row: Mapping[str, Any], scope: str) -> tuple[float, float, float]:
    """Δ and interval shown for ``scope``: the pooled verdict's clustered interval where one was computed
    (spec v1.2 §2.2), else the summary's per-question one (per-task columns: exploratory)."""
    if scope == OVERALL and not fmt.is_missing(row.get(f"{scope}.verdict_ci_low", float("nan"))):
        return row[f"{scope}.verdict_delta_pp"], row[f"{scope}.verdict_ci_low"], row[f"{scope}.verdict_ci_high"]
    return row[f"{scope}.delta_pp"], row[f"{scope}.delta_ci_low"], row[f"{scope}.delta_ci_high"]


def _delta_cell(row: Mapping[str, Any], scope: str) -> str:
    if row["section"] == REFERENCE:
        return "reference"
    return fmt.delta_interval(*_shown(row, scope))


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
                     else [fmt_value(r[key], kind) for r in rows])
            cols.append(Column(f"{task}: {header}", key, cells))
    return cols


def display_columns(lb: Leaderboard, table: pd.DataFrame | None = None) -> list[tuple[str, str, list[str]]]:
    """(header, sort-key column, cells) of the answer table, in order (kept for notebooks and scripts)."""
    return [(c.header, c.key, c.cells) for c in main_columns(lb.table if table is None else table)]


def _header_lines(lb: Leaderboard, style: type = fmt.Markdown) -> list[str]:
    m, t, c = lb.meta, style.text, style.code
    method = ""
    if any(col.endswith(".delta_method") for col in lb.table.columns):
        method = f" (method per row in the CSV's {c('delta_method')})"
    return [
        f"Model {style.bold(t(m['model']))}, measurement spec v{t(m['spec_version'])}, hardware profile "
        f"{t(m['hardware'])}, dtype {t(m['dtype'])}; {t(m['records'])} records; tasks: {t(', '.join(lb.tasks))}; "
        f"filters: {t(m['filters'])}.",
        f"Memory saved: 1 − KV bytes held / dense 16-bit bytes (spec §1). Δ acc.: strategy − {c(BASELINE)} "
        f"accuracy in percentage points on identical samples, pooled over every task at one context length, with "
        f"the paired 95% interval clustered by source document (spec v1.2 §2.2; per-task columns: per-question "
        f"intervals{method}, exploratory). Verdict: non-inferiority at that interval against the "
        f"{margin_pp():g}-point margin — {t(WITHIN)} (the whole interval above −{margin_pp():g}), "
        f"undetermined (the interval holds both; split by where Δ lies), {t(BEYOND)} (the whole interval at or "
        f"below −{margin_pp():g}), Holm-adjusted over the strategies ranked in the setting (spec §2.3). Rows are "
        "sorted by the verdict, then memory saved; rows equal in all of these are ties (=). n: questions / "
        "distinct documents behind the pooled Δ.",
    ] + ([f"{style.bold('Partial')}: {t(m['partial'])} record(s) come from runs that have not finished (their "
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


def answer_sentence(lb: Leaderboard, setting: str, style: type = fmt.Markdown) -> str:
    """One sentence answering "which strategy saves the most memory within the margin?" in ``setting``,
    generated from the verdicts (:func:`claim_verdicts`) of the ranked rows; the answer is the first row."""
    ranked = _setting_rows(lb, setting, RANKED)
    ranked = ranked[ranked["rank"].notna()].sort_values(["rank", "strategy"], kind="mergesort")
    c, margin = style.code, f"{margin_pp():g} point"
    if ranked.empty:
        return "No strategy that saves bytes was measured on every task in this setting, so none is ranked."
    top = ranked.iloc[0]
    tied = ranked[ranked["rank"] == top["rank"]]
    names = " and ".join(c(label) for label in tied["label"])
    figures = (f"{fmt.pct(top[f'{OVERALL}.memory_reduction'])} less KV memory, Δ "
               f"{_delta_cell(top, OVERALL)} pp, n = {_n_cell(top)}")
    who = f"{names} ({'tied, ' if len(tied) > 1 else ''}{figures})"
    verdict = top[f"{OVERALL}.verdict"]
    if verdict == WITHIN:
        text = (f"Answer: {who} saves the most memory while staying within {margin} of {c(BASELINE)} "
                "— the whole interval is inside the margin.")
    elif verdict == UNDECIDED_IN:
        text = (f"Answer: no strategy is shown to stay within {margin} of {c(BASELINE)} at this n; the largest "
                f"saving whose Δ is within the margin is {who}, {claims.UNDETERMINED} — its interval holds "
                f"losses both under and over {margin}.")
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


def _sections(lb: Leaderboard, setting: str) -> list[tuple[str, str, list[Column], str]]:
    """(anchor, title, columns, note) of every table in one setting, in page order."""
    out = []
    main = _setting_rows(lb, setting, (RANKED, REFERENCE))
    out.append((f"{setting}", "", main_columns(main), ""))
    moved = _setting_rows(lb, setting, OFFLOADING)
    if not moved.empty:
        out.append((f"{setting}-offloading", "Offloading: device memory, not bytes saved",
                    main_columns(moved, memory="device memory saved"),
                    "These strategies move cold KV entries to host RAM or disk instead of dropping or shrinking them: "
                    "their figure is the share of the cache kept off the device, not bytes saved, so they are "
                    "never ranked with the strategies above (their verdicts read the same way)."))
    everything = _setting_rows(lb, setting, (RANKED, OFFLOADING, REFERENCE))
    out.append((f"{setting}-tasks", "Per task", task_columns(lb, everything), ""))
    out.append((f"{setting}-latency", "Memory and latency per task",
                task_columns(lb, everything, LATENCY_METRICS), "prefill"))
    return out


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
        for _, sub, cols, note in _sections(lb, setting):
            if sub:
                lines += [f"### {title}: {sub.lower()}", ""]
            if note == "prefill":
                note = _prefill_line(lb, setting)
            if note:
                lines += [note, ""]
            lines += [*_md_table(cols), ""]
    return "\n".join(lines)


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
    for i, row in enumerate(rows):
        cells = []
        for c in cols:
            raw = row.get(c.key)
            numeric = isinstance(raw, (numbers.Number, np.number)) and not isinstance(raw, (bool, np.bool_))
            value = "" if _isnan(raw) else (format(float(raw), ".6g") if numeric else str(raw))
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
    links = " · ".join(f'<a href="#{esc(a)}">{esc(sub.lower())}</a>' for a, sub, _, _ in sections if sub)
    out = [f'<h2 id="{esc(setting)}">{esc(title)}</h2>', f"<p>{esc(explain)}.</p>",
           f'<p class="answer">{answer_sentence(lb, setting, h)}</p>']
    if base := baseline_line(lb, setting, h):
        out.append(f"<p>{base}</p>")
    out.append(f"<nav>Detail: {links}; every figure: leaderboard.csv</nav>")
    sections_with = {RANKED: (RANKED, REFERENCE)}
    for anchor, sub, cols, note in sections:
        if sub:
            out.append(f'<h3 id="{esc(anchor)}">{esc(title)}: {esc(sub.lower())}</h3>')
        if note == "prefill":
            note = _prefill_line(lb, setting, h)
        elif note:
            note = esc(note)
        if note:
            out.append(f"<p>{note}</p>")
        which = {f"{setting}": sections_with[RANKED], f"{setting}-offloading": (OFFLOADING,)}.get(
            anchor, (RANKED, OFFLOADING, REFERENCE))
        out.append(_html_table(lb, _setting_rows(lb, setting, which), cols, anchor, main=anchor == setting))
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
    lb = build(read_records(args.results_dir), filters_from_args(args), args.sort, args.reverse, args.depth_key)
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
