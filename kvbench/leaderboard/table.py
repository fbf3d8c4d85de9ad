"""The leaderboard's table: the store's records selected, paired and summarised per query setting, one row per
(setting, strategy) with every raw figure under its CSV column name, each row's verdict against the accuracy
margin (the claim check's judging, :mod:`kvbench.claims`), its rank, and the sort.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import bands, claims, fmt, paired, sequential
from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.record import HIGHER_IS_BETTER  # sort direction per metric: larger first where True
from kvbench.report import summarize
from kvbench.results import RECORD_KEY, read_store, read_unpublished
from kvbench.selection import Filters, check_comparable, json_text, paired_records, select_records
from kvbench.vocab import BASELINE, OFFLOADING_FAMILIES, OVERALL, SETTINGS, ordered_settings

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


# ------------------------------------------------------------------ verdicts: the one coupling to the claim check

#: Verdicts of a strategy's pooled Δ against the spec's accuracy margin, best first: the spec's (§2.3) and the
#: claim check's three words (holds / undetermined / fails), with "undetermined" split by where the point estimate
#: lies, which is how the claim check picks among undetermined strategies; under a design with a futility boundary
#: (spec v1.3 §2.7) a fourth, the claim check's "stopped for futility": not shown to hold, sampling stopped, not
#: shown to fail either.
WITHIN, UNDECIDED_IN, UNDECIDED_OUT, STOPPED, BEYOND, NOT_POOLED = (
    paired.HOLDS, f"undetermined, Δ above −{claims.LOSS_PP:g}", f"undetermined, Δ at or below −{claims.LOSS_PP:g}",
    paired.FUTILE, paired.FAILS, "not on every task")
VERDICT_ORDER = {WITHIN: 0, UNDECIDED_IN: 1, UNDECIDED_OUT: 2, STOPPED: 3, BEYOND: 4, NOT_POOLED: 5}
#: The page names an answer only where ``full``'s accuracy on the pooled tasks is at least this at the lower end of
#: its 95% interval — ten times the 1-point margin: a strategy cannot lose what the baseline never had, so below it
#: "within 1 point of full" says nothing about what compression keeps (a model scoring 0/2; 1/2 cannot state it).
BASELINE_FLOOR = 0.1


def margin_pp() -> float:
    """The spec's accuracy margin in points (a loss under it counts as "within")."""
    return float(claims.LOSS_PP)


def claim_verdicts(summary: pd.DataFrame, setting: str, records: pd.DataFrame | None = None,
                   design: sequential.Design | None = None,
                   judged: Mapping[str, paired.NonInferiority] | None = None) -> dict[str, str]:
    """Each non-baseline strategy's verdict on the pooled scope of ``setting``, as the claim check judges it.

    The only place the leaderboard reads the claim check's judging (spec v1.2 §2.2–2.3): with ``records``, the
    clustered paired interval of :func:`kvbench.paired.compare` on the records the pooled row rests on (one
    context length, strategies measured on every task), and non-inferiority at the 1-point margin with Holm's
    correction over the strategies ranked in this setting (:func:`kvbench.paired.noninferiority`). Without
    records (a summary alone), the unadjusted pooled interval of the summary decides. A sequential ``design``
    runs Holm through its looks (spec v1.2 §2.5). ``judged``: :func:`_judged`'s result when the caller has it.
    """
    rows = summary[(summary["setting"] == setting) & (summary["task"] == OVERALL)
                   & (summary["strategy"] != BASELINE)]
    if judged is None and records is not None and not records.empty:
        judged = _judged(rows, setting, records, design)
    verdicts = {s: v.verdict for s, v in (judged or {}).items()}
    out = {}
    for row in rows.to_dict("records"):
        pick = claims.Pick.from_row(row)
        if math.isnan(pick.delta_pp) or math.isnan(pick.ci_low) or math.isnan(pick.ci_high):
            continue
        out[pick.strategy] = _words(verdicts.get(pick.strategy), pick)
    return out


def _words(verdict: str | None, pick: claims.Pick) -> str:
    """A non-inferiority verdict in the leaderboard's words (:data:`VERDICT_ORDER`); with none, the pick's
    unadjusted interval against the margin decides."""
    holds = verdict == paired.HOLDS if verdict else pick.ci_low > -margin_pp()
    fails = verdict == paired.FAILS if verdict else pick.ci_high <= -margin_pp()
    if holds:
        return WITHIN
    if fails:
        return BEYOND
    if verdict == paired.FUTILE:
        return STOPPED
    return UNDECIDED_IN if pick.within_pp(margin_pp()) else UNDECIDED_OUT


def task_verdicts(summary: pd.DataFrame, setting: str, records: pd.DataFrame,
                  design: sequential.Design) -> dict[tuple[str, str], str]:
    """Under a registered ``design``, every strategy's verdict on each task of ``setting``, keyed by (task,
    strategy), in the leaderboard's words: a member's as the claim check judges that task's hypothesis
    (:func:`kvbench.claims.headline`: through the design's looks, gated on the pooled hypotheses), any other
    strategy's "undetermined" — at an interim look a task's unadjusted 95% interval is no verdict of the design,
    so nothing reading the table (``kvbench advise``) may take one from it."""
    rows = summary[(summary["setting"] == setting) & (summary["task"] != OVERALL) & (summary["strategy"] != BASELINE)]
    out = {}
    for task, part in rows.groupby("task"):
        h = claims.headline(summary, str(task), setting, records, design)
        judged = {p.strategy: m.verdict for p, m in zip(h.member_picks, h.members, strict=True)}
        for row in part.to_dict("records"):
            pick = claims.Pick.from_row(row)
            if not math.isnan(pick.delta_pp):
                out[str(task), pick.strategy] = _words(judged.get(pick.strategy, paired.UNDETERMINED), pick)
    return out


def _judged(rows: pd.DataFrame, setting: str, records: pd.DataFrame,
            design: sequential.Design | None = None) -> dict[str, paired.NonInferiority]:
    """paired.noninferiority verdicts (with the clustered comparison each rests on) of ``rows``' strategies
    against ``full`` on the pooled records."""
    part = at_pooled_length(records[records["setting"] == setting] if "setting" in records else records)
    ranked = [s for s, f in zip(rows["strategy"], rows["family"], strict=True) if not _offloading(f)]
    if design is not None:
        return {v.comparison.a: v for v in paired.noninferiority_through_looks(part, ranked, BASELINE, design)}
    comparisons = [c for c in (paired.compare(part, s, BASELINE) for s in ranked) if c is not None]
    return {v.comparison.a: v for v in paired.noninferiority(comparisons)}


def at_pooled_length(records: pd.DataFrame) -> pd.DataFrame:
    """``records`` in the one length band pooled columns use (spec v1.2 §2.3; :mod:`kvbench.bands`): the band
    most tasks were measured in, the longest on a tie — every question of a task in it counts once, whatever its
    natural length; all of them when no length is recorded."""
    band = bands.pooled_band(records)
    if band is None:
        return records
    return records[bands.with_bands(records)[bands.BAND] == band]


@dataclass(frozen=True)
class PooledScope:
    """What a setting's pooled (``all``) columns pool: the tasks measured in one length band, and the tasks (or
    a task's questions) left out because they ran in another (spec v1.2 §2.3 never pools across lengths)."""

    tokens: int | None  # the band in tokens; None: no context length recorded
    tasks: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()  # (task, its band(s) as text)
    band: str = ""  # the band as text (``4,096 tokens``); empty: no length recorded

    def included(self) -> str:
        """``legal, papers pooled at 4,096 tokens``."""
        at = f" at {self.band}" if self.band else ""
        return f"{', '.join(self.tasks)} pooled{at}"

    def text(self) -> str:
        """``legal, papers pooled at 4,096 tokens; not pooled: fiction at 2,048 tokens``."""
        if not self.left_out:
            return self.included()
        return f"{self.included()}; not pooled: " + ", ".join(f"{t} at {n}" for t, n in self.left_out)


def _lengths_text(lengths: Any) -> str:
    uniq = sorted({int(v) for v in lengths if not fmt.is_missing(v)})
    if not uniq:
        return "?"
    return f"{uniq[0]:,}" if len(uniq) == 1 else f"{uniq[0]:,}–{uniq[-1]:,}"


def pooled_scope(records: pd.DataFrame) -> PooledScope:
    """The scope of the pooled columns over ``records`` (one setting's): :func:`at_pooled_length`'s tasks, and
    every task's questions outside its band (a task measured in two bands is named with the one left out, so the
    table never pools fewer questions than the tasks hold without saying so)."""
    tasks = sorted(records["task"].astype(str).unique()) if not records.empty else []
    band = bands.pooled_band(records)
    if band is None:
        return PooledScope(None, tuple(tasks))
    recs = bands.with_bands(records)
    inside = sorted(recs.loc[recs[bands.BAND] == band, "task"].astype(str).unique())
    outside = recs[recs[bands.BAND] != band]
    left = tuple((t, bands.bands_text(part))
                 for t, part in ((t, outside[outside["task"].astype(str) == t]) for t in tasks) if not part.empty)
    return PooledScope(int(band), tuple(inside), left, bands.band_text(recs, band))


def task_lengths(records: pd.DataFrame, task: str) -> str:
    """The context length(s) ``task`` was measured at, as text (``2,048`` or ``1,990–2,048``)."""
    if "context_tokens" not in records:
        return "?"
    return _lengths_text(records.loc[records["task"].astype(str) == task, "context_tokens"])


def baseline_accuracy(summary: pd.DataFrame, setting: str) -> tuple[float, float, float, int]:
    """``full``'s pooled accuracy, its 95% interval and n in ``setting`` (NaNs and 0 when nothing is pooled)."""
    rows = summary[(summary["setting"] == setting) & (summary["task"] == OVERALL) & (summary["strategy"] == BASELINE)]
    cols = ("accuracy", "accuracy_ci_low", "accuracy_ci_high")
    if rows.empty or any(c not in rows for c in cols):
        return float("nan"), float("nan"), float("nan"), 0
    return (*(float(rows[c].iloc[0]) for c in cols), int(rows["n"].iloc[0]))


def _offloading(family: Any) -> bool:
    return str(family) in OFFLOADING_FAMILIES


def _section(strategy: str, family: Any) -> str:
    if strategy == BASELINE:
        return REFERENCE
    return OFFLOADING if _offloading(family) else RANKED


def _document_ids(records: pd.DataFrame) -> pd.Series:
    """The cluster each record's context belongs to: the connected component of shared source works
    (:func:`kvbench.paired.document_ids`, the clusters every interval uses), task-qualified."""
    if records.empty:
        return pd.Series([], dtype=str)
    return paired.document_ids(records)


#: The reader's loss columns (spec v1.2 §2.6), per task and pooled: each endpoint with its clustered interval.
READER_COLUMNS = tuple(f"{e.replace(' ', '_')}{x}" for e in paired.READER for x in ("", "_ci_low", "_ci_high")) \
    + ("reader_n",)


def _clustered(summary: pd.DataFrame, records: pd.DataFrame) -> pd.DataFrame:
    """One number everywhere (spec v1.2 §2.6): every row's Δ and interval replaced by the clustered paired
    comparison the verdicts use (:func:`kvbench.paired.compare`: Δ from the exact counts, clusters of shared
    works, the zero-flip widening for every strategy), and the reader's loss added with its intervals and n."""
    out = summary.copy()
    for col in READER_COLUMNS:
        out[col] = float("nan")
    for i, row in summary.iterrows():
        if row["strategy"] == BASELINE:
            continue
        recs = records[records["setting"] == row["setting"]] if "setting" in records else records
        recs = at_pooled_length(recs) if row["task"] == OVERALL else recs[recs["task"] == row["task"]]
        c = paired.compare(recs, row["strategy"], BASELINE)
        if c is None:
            continue
        out.loc[i, ["delta_pp", "delta_ci_low", "delta_ci_high"]] = [c.estimate, c.low, c.high]
        if "delta_method" in out:
            out.loc[i, "delta_method"] = c.method
        for e in paired.reader_loss(recs, row["strategy"], BASELINE):
            name = e.endpoint.replace(" ", "_")
            out.loc[i, [name, f"{name}_ci_low", f"{name}_ci_high", "reader_n"]] = [e.estimate, e.low, e.high,
                                                                                  e.n_questions]
    return out


def _add_verdicts(table: pd.DataFrame, summary: pd.DataFrame, records: pd.DataFrame,
                  design: sequential.Design | None = None) -> pd.DataFrame:
    """Section, verdict, documents and rank columns: rank 1 is the most memory saved among the best verdict.

    Within a verdict that may still answer the question (holds, undetermined) rows rank by memory saved; among
    those that fail, which answer it for none, by Δ (the smallest loss first), then memory saved. Rows equal on
    everything the order looks at (verdict, memory saved as shown, Δ and its interval — e.g. identical score
    vectors at one memory level) share a rank, shown as a tie, instead of being ranked by name.
    """
    table = table.copy()
    table["section"] = [_section(s, f) for s, f in zip(table["strategy"], table["family"], strict=True)]
    # Documents behind the pooled column: the records it pools (one context length per setting), so the count
    # stands beside that column's n, not beside every task's.
    pooled = pd.concat([at_pooled_length(g) for _, g in records.groupby("setting")]) if not records.empty else records
    ndocs = (pooled.assign(_doc=_document_ids(pooled)).groupby(["setting", "strategy"])["_doc"].nunique()
             if not pooled.empty else pd.Series(dtype=int))
    table[f"{OVERALL}.documents"] = [ndocs.get((st, s), float("nan")) for st, s in
                                     zip(table["setting"], table["strategy"], strict=True)]
    # The interval each verdict rests on (clustered, spec v1.2 §2.2) is the one the answer table shows; judged
    # once per setting (under a design that is a comparison per look) for both.
    judged = {st: _judged(summary[(summary["setting"] == st) & (summary["task"] == OVERALL)
                                  & (summary["strategy"] != BASELINE)], st, records, design)
              for st in set(table["setting"])} if not records.empty else {}
    verdicts = {st: claim_verdicts(summary, st, records, design, judged.get(st)) for st in set(table["setting"])}
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
    if design is not None and not records.empty:
        per_task = {st: task_verdicts(summary, st, records, design) for st in set(table["setting"])}
        for task in sorted({t for v in per_task.values() for t, _ in v}):
            table[f"{task}.verdict"] = [per_task[st].get((task, s), "")
                                        for st, s in zip(table["setting"], table["strategy"], strict=True)]
    table["rank"] = float("nan")
    table["tie"] = False
    for setting in set(table["setting"]):
        part = table[(table["setting"] == setting) & (table["section"] == RANKED)
                     & (table[f"{OVERALL}.verdict"] != NOT_POOLED)]
        keys = {i: _rank_key(row) for i, row in part.iterrows()}
        order = sorted(keys, key=lambda i: (keys[i], table.at[i, "strategy"]))
        for i in order:
            first = next(j for j in order if keys[j] == keys[i])  # competition ranking: ties share a rank
            table.at[i, "rank"] = order.index(first) + 1
            table.at[i, "tie"] = sum(keys[j] == keys[i] for j in order) > 1
    return table


def _rank_key(row: Mapping[str, Any]) -> tuple[float, ...]:
    memory = -round(float(row[f"{OVERALL}.memory_reduction"]), 3)
    delta, low, high = (-v for v in shown_interval(row, OVERALL))
    if row[f"{OVERALL}.verdict"] == BEYOND:
        return row["verdict_order"], delta, memory, low, high
    return row["verdict_order"], memory, delta, low, high


def overall_summary(records: pd.DataFrame, tasks: Sequence[str]) -> pd.DataFrame:
    """Per-strategy figures pooled over ``tasks`` (task column :data:`OVERALL`), paired per sample.

    Only strategies measured on every task are pooled: a strategy seen on the easy task alone would
    otherwise look better than one measured everywhere. Only one length band is pooled (spec v1.2 §2.3;
    :func:`at_pooled_length`); tasks in other bands keep their own columns.
    """
    if bands.pooled_band(records) is not None:
        records = at_pooled_length(records)
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
    design: sequential.Design | None = None  # a sequential sweep's looks (spec v1.2 §2.5); None: fixed-sample

    @property
    def settings(self) -> list[str]:
        """The query settings present, query-aware first."""
        return ordered_settings(self.table["setting"]) if "setting" in self.table else []

    def pooled_scope(self, setting: str) -> PooledScope:
        """What the pooled columns of ``setting`` pool (and leave out)."""
        return pooled_scope(self.records[self.records["setting"] == setting])


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
          reverse: bool = False, depth_key: str | None = None,
          design: sequential.Design | None = None) -> Leaderboard:
    """Select, check, pair and summarise ``records`` (as :func:`kvbench.results.read_store` returns them).

    With a sequential ``design`` every figure is the last complete look's (the records of its contexts),
    and the verdicts run through the looks; later records wait for the next look (counted in ``meta``)."""
    filters = filters or Filters()
    chosen = select_records(records, filters)
    check_comparable(chosen)
    look_meta = {}
    if design is not None and not chosen.empty:
        _refuse_counted_twice(chosen)
        index = sequential.context_index(chosen, design.first_context)
        members = sorted(set(chosen["strategy"]) - {BASELINE})
        ended = sequential.stopped(chosen, design, members, BASELINE, index)
        look = sequential.complete_looks(chosen, design, [BASELINE, *(s for s in members if s not in ended)], index)
        at = sequential.at_look(chosen, design, look, index)
        for s, k in ended.items():  # a dropped member's figures are its own last look's
            at = at[(at["strategy"] != s) | (index[at.index] < design.contexts(k))]
        # records waiting for the next look (a dropped member's past its own look wait for none)
        waiting = int((~chosen["strategy"].isin(ended)).sum() - (~at["strategy"].isin(ended)).sum()) if look else 0
        look_meta = {"design": design.describe(), "look": str(look), "n_looks": str(design.n_looks),
                     "look_contexts": str(design.contexts(look) if look else 0), "after_look": str(waiting),
                     # members dropped from the sweep once decided, each with the last look it was sampled to
                     "stopped": "; ".join(f"{s} (look {k})" for s, k in sorted(ended.items()))}
        if look:
            chosen = at
    if BASELINE not in set(chosen["strategy"]):
        raise KVBenchError(f"no {BASELINE!r} baseline records in the selection; every run records it, so the "
                           "store is incomplete — rerun a benchmark")
    paired = bands.with_bands(paired_records(chosen, depth_key))  # every record's length band, computed once
    tasks = sorted(paired["task"].astype(str).unique())
    if OVERALL in tasks:
        raise KVBenchError(f"a task named {OVERALL!r} clashes with the pooled columns; filter it out with --task")
    summary = _clustered(_summaries(paired, tasks), paired)
    tests = [c for c in TEST_COLUMNS + READER_COLUMNS if c in summary.columns]

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
    table = _add_verdicts(pd.DataFrame(rows), summary, paired, design)
    if "partial" in paired.columns:  # rows resting on records of an unfinished run say so
        partial = paired[paired["partial"].fillna(False).astype(bool)].groupby(["setting", "strategy"]).size()
        table["partial"] = [(st, s) in partial.index for st, s in zip(table["setting"], table["strategy"],
                                                                       strict=True)]
    if look_meta and look_meta["look"] == "0":
        # A registered design before its first look: every row is interim, never evidence (kvbench advise and
        # anything reading the CSV skip such a table); judged tables carry no such column, so theirs are unchanged.
        table["interim"] = True
    meta = {
        "model": ", ".join(_distinct(chosen["model"])),
        "spec_version": ", ".join(_distinct(chosen["spec_version"])),
        "hardware": ", ".join(_distinct(chosen["hardware"])) if "hardware" in chosen else "",
        "dtype": ", ".join(_distinct(chosen["dtype"])) if "dtype" in chosen else "",
        "records": str(len(paired)),
        "partial": str(int(paired["partial"].fillna(False).astype(bool).sum())) if "partial" in paired else "0",
        "filters": filters.describe(),
        **look_meta,
    }
    lb = Leaderboard(table=table, summary=summary, records=paired, tasks=tasks, meta=meta, design=design)
    return sort_leaderboard(lb, sort or DEFAULT_SORT, reverse)


def _refuse_counted_twice(records: pd.DataFrame) -> None:
    """One :class:`KVBenchError` when two runs under a design hold the same question for one strategy under
    different sample metadata (a run continuing the design from a later context numbers its samples from 0): the
    pairing key would count that question twice."""
    dup = records[records.duplicated(["task", "strategy", "sample_id"], keep=False)]
    if dup.empty:
        return
    keyed = dup.assign(_meta=[json_text(m) for m in dup.get("sample_meta", pd.Series(None, index=dup.index))])
    twice = keyed.groupby(["task", "strategy", "sample_id"])["_meta"].nunique()
    twice = twice[twice > 1]
    if not twice.empty:
        task, strategy, sample = twice.index[0]
        raise KVBenchError(f"{len(twice)} question(s) are held by two runs under different sample metadata, e.g. "
                           f"{strategy!r} on {sample!r} ({task}): a design counts each question once — remove the "
                           "later run's records of the contexts the earlier run holds")


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


def shown_interval(row: Mapping[str, Any], scope: str) -> tuple[float, float, float]:
    """Δ and interval shown for ``scope``: the pooled verdict's clustered interval where one was computed
    (spec v1.2 §2.2), else the summary's per-question one (per-task columns: exploratory)."""
    if scope == OVERALL and not fmt.is_missing(row.get(f"{scope}.verdict_ci_low", float("nan"))):
        return row[f"{scope}.verdict_delta_pp"], row[f"{scope}.verdict_ci_low"], row[f"{scope}.verdict_ci_high"]
    return row[f"{scope}.delta_pp"], row[f"{scope}.delta_ci_low"], row[f"{scope}.delta_ci_high"]
