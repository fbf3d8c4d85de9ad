"""Run summaries: per (task, setting, strategy) aggregates of the spec v1.2 metrics, and the end-of-run table."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbench import fmt
from kvbench.paired import FAILS, HOLDS, MARGIN_PP, UNDETERMINED
from kvbench.record import AGGREGATED, PAIRED, Metric
from kvbench.results import printable
from kvbench.spec import accuracy_delta, accuracy_interval, binary_metric
from kvbench.vocab import BASELINE, QUERY_AWARE, settings

#: ``delta_method`` of the baseline's own row: the reference, with no interval.
REFERENCE = "reference"

#: Columns of a summary row: what the row is about, the metrics registry's figures, then descriptive fields.
SUMMARY_COLUMNS = ["task", "setting", "strategy", "family", *PAIRED, *(m.name for m in AGGREGATED),
                   "memory_reduction_with_state", "context_tokens", "spec_version", "model", "hardware"]


def reduction_with_state(grp: pd.DataFrame) -> float:
    """A hybrid's saving on all it holds: ``1 - (kv_bytes + state) / (kv_bytes_dense + state)``, where ``state``
    is its recurrent layers' measured bytes (``stats.recurrent_state_bytes``: the same whatever the strategy),
    averaged over the records; NaN for a model without recurrent layers."""
    stats = grp["stats"] if "stats" in grp else pd.Series([None] * len(grp), index=grp.index)
    state = stats.map(lambda s: s.get("recurrent_state_bytes") if isinstance(s, dict) else None)
    if state.isna().all() or "kv_bytes_dense" not in grp:
        return float("nan")
    state = state.astype(float)
    return float((1 - (grp["kv_bytes"] + state) / (grp["kv_bytes_dense"] + state)).mean())


def summarize(records: pd.DataFrame, baseline: str = BASELINE, seed: int = 0) -> pd.DataFrame:
    """One row per (task, setting, strategy). Accuracy deltas pair each sample with the baseline's score
    on it in the same task and setting; ``baseline_accuracy`` is the baseline's mean on those samples."""
    if records.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    records = records.assign(setting=settings(records))
    rows = []
    for (task, setting, strategy), grp in records.groupby(["task", "setting", "strategy"], sort=False):
        base = records[(records["task"] == task) & (records["setting"] == setting)
                       & (records["strategy"] == baseline)]
        paired = grp.merge(base[["sample_id", "score"]], on="sample_id", suffixes=("", "_base"))
        binary = binary_metric(grp["metric"].dropna().unique()) if "metric" in grp else None
        delta = accuracy_delta(paired["score_base"].to_numpy(), paired["score"].to_numpy(), seed=seed,
                               binary=binary)
        acc, acc_lo, acc_hi = accuracy_interval(grp["score"].to_numpy(), binary=binary, seed=seed)
        if strategy == baseline:  # the reference itself: spec v1.2 gives it no interval against itself
            delta = replace(delta, ci_low=float("nan"), ci_high=float("nan"), method=REFERENCE,
                            mcnemar_p=float("nan"))
        paired_figures = {
            "n": len(grp),
            "accuracy": acc,
            "accuracy_ci_low": acc_lo,
            "accuracy_ci_high": acc_hi,
            "baseline_accuracy": delta.baseline,
            "delta_pp": delta.delta_pp,
            "delta_ci_low": delta.ci_low,
            "delta_ci_high": delta.ci_high,
            "delta_method": delta.method,
            "n_only_strategy": delta.n_only_strategy,
            "n_only_baseline": delta.n_only_baseline,
            "mcnemar_p": delta.mcnemar_p,
            "relative_loss": delta.relative_loss,
        }
        rows.append({
            "task": task,
            "setting": setting,
            "strategy": strategy,
            "family": grp["family"].iloc[0],
            **{name: paired_figures[name] for name in PAIRED},
            **{m.name: _aggregate(grp[m.field], m) for m in AGGREGATED},
            "memory_reduction_with_state": reduction_with_state(grp),
            "context_tokens": int(grp["context_tokens"].median()),
            "spec_version": grp["spec_version"].iloc[0],
            "model": grp["model"].iloc[0],
            "hardware": grp["hardware"].iloc[0],
        })
    out = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    first = {"strategy": {baseline: 0}, "setting": {QUERY_AWARE: 0}}  # the baseline and the default first
    return out.sort_values(["task", "setting", "strategy"],
                           key=lambda s: s.map(lambda v: (first[s.name].get(v, 1), v)) if s.name in first else s,
                           kind="mergesort").reset_index(drop=True)


def _aggregate(values: pd.Series, metric: Metric) -> float:
    if metric.agg == "mean":
        v = values.mean()
    elif metric.agg == "median":
        v = values.median()
    elif metric.agg == "nanmedian":
        v = _nanmedian(values)
    else:
        raise ValueError(f"metric {metric.name} has no per-record aggregation ({metric.agg})")
    return v * metric.scale if metric.scale != 1.0 else v


def _nanmedian(s: pd.Series) -> float:
    v = s.dropna().to_numpy(dtype=float)
    return float(np.median(v)) if v.size else float("nan")


def _fmt(v: float, spec: str) -> str:
    return fmt.number(v, spec, fmt.MISSING_ASCII)


def shown(value: object) -> str:
    """``value`` as console text: control characters removed and rich markup escaped, so a task or model
    name is printed as written and can neither style the table nor reach the terminal as a sequence."""
    return escape(printable(value))


def row_verdict(row: Any) -> str:
    """A summary row's reading of its own interval against the 1-point margin (spec v1.2 §2.2), unadjusted:
    one run's table, not the claim check (``kvbench leaderboard`` applies Holm and the clustered interval)."""
    if getattr(row, "delta_method", None) == REFERENCE:
        return "reference"
    low, high = float(row.delta_ci_low), float(row.delta_ci_high)
    if np.isnan(low) or np.isnan(high):
        return fmt.MISSING_ASCII
    return HOLDS if low > -MARGIN_PP else FAILS if high < -MARGIN_PP else UNDETERMINED


def print_table(summary: pd.DataFrame, console: Console | None = None) -> None:
    """The end-of-run table: strategy, task, n, accuracy, delta (CI), KV MiB, reduction, latency.

    Strategies are named by their short label (parameters that differ from the defaults); the full
    parameters are in the run's summary.csv and records.
    """
    from kvbench.labels import shorten

    labels = [shorten(s) for s in summary["strategy"]] if not summary.empty else []
    # The other columns take about 145 characters; room for the longest label keeps every row on one line.
    width = max([175, *(145 + len(label) for label in labels)])
    if console is None:
        console = Console()
        if not console.is_terminal or console.width < width:
            console = Console(width=width)  # pipes and CI logs default to 80 columns, which folds every cell
    table = Table(title="kvbench results (spec v" + shown(summary["spec_version"].iloc[0]) + ")"
                  if not summary.empty else "kvbench results")
    # A hybrid's table also shows the saving on everything it holds, its recurrent state included (the state is
    # not the strategy's to compress, so the KV reduction alone overstates what the model saves).
    state = "memory_reduction_with_state" in summary and bool(summary["memory_reduction_with_state"].notna().any())
    for col in ("strategy", "task", "n", "accuracy", "delta pp (95% CI)", f"verdict ({MARGIN_PP:g} pp)", "KV MiB",
                "reduction", *(["with state"] if state else []), "KL", "prefill s", "decode ms/tok"):
        table.add_column(col, justify="left" if col in ("strategy", "task") else "right",
                         overflow="fold")
    for label, r in zip(labels, summary.itertuples(), strict=True):
        ci = fmt.interval(r.delta_pp, r.delta_ci_low, r.delta_ci_high, missing=fmt.MISSING_ASCII)
        with_state = [fmt.MISSING_ASCII if pd.isna(r.memory_reduction_with_state)
                      else _fmt(100 * r.memory_reduction_with_state, ".1f") + "%"] if state else []
        table.add_row(shown(label), shown(r.task), str(r.n), _fmt(r.accuracy, ".3f"), ci, row_verdict(r),
                      _fmt(r.kv_mib, ".2f"), _fmt(100 * r.memory_reduction, ".1f") + "%", *with_state,
                      _fmt(r.kl, ".4f"), _fmt(r.prefill_s, ".2f"), _fmt(r.decode_ms_per_token, ".1f"))
    console.print(table)
