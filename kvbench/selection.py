"""Which records of the result store are compared, and the command-line flags that choose them.

The one owner of store filters for every reader of the store (``kvbench leaderboard``, its plots, the
notebook): :class:`Filters` and :func:`add_filter_arguments` define the flags once; :func:`select_records`
applies them; :func:`check_comparable` refuses to rank records of different models, specs, hardware or
dtypes together; :func:`paired_records` keys every record by what its sample *is* so strategies pair with
``full`` on identical samples, and adds the derived columns figures read (``setting``, ``depth``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results import safe_message, stable_hash
from kvbench.vocab import SETTINGS, sample_depth, setting_of

#: Fields that must hold a single value among the records ranked together, with the flag selecting one.
HOMOGENEOUS: dict[str, str] = {
    "spec_version": "--spec-version",
    "model": "--model",
    "hardware": "--hardware",
    "dtype": "--dtype",
}


@dataclass(frozen=True)
class Filters:
    """Which records to compare; ``None`` keeps everything for that field."""

    model: str | None = None
    tasks: tuple[str, ...] | None = None
    hardware: str | None = None
    spec_version: str | None = None
    dtype: str | None = None
    setting: str | None = None

    def describe(self) -> str:
        """The filter flags as they would be typed, for page headers."""
        parts = [f"--{k.replace('_', '-')} {v}" for k, v in
                 (("model", self.model), ("hardware", self.hardware), ("spec_version", self.spec_version),
                  ("dtype", self.dtype), ("setting", self.setting)) if v is not None]
        if self.tasks:
            parts.append("--task " + ",".join(self.tasks))
        return " ".join(parts) or "(none)"


def add_filter_arguments(parser: argparse.ArgumentParser) -> None:
    """The store and filter flags, shared by every command that reads the store."""
    parser.add_argument("--results-dir", default="results", help="directory holding store/ (default results)")
    parser.add_argument("--model", default=None, help="only this model's records")
    parser.add_argument("--task", action="append", default=None,
                        help="only these tasks (repeat the flag or separate with commas)")
    parser.add_argument("--hardware", default=None, help="only records of this hardware profile")
    parser.add_argument("--spec-version", default=None, help="only records of this measurement spec version")
    parser.add_argument("--dtype", default=None, help="only records run in this dtype")
    parser.add_argument("--setting", default=None,
                        help=f"only one query setting: {' or '.join(SETTINGS)} (default: both, reported apart)")


def add_design_argument(parser: argparse.ArgumentParser) -> None:
    """``--design``: judge the store by a sweep file's pre-registered looks (spec v1.2 §2.5)."""
    parser.add_argument("--design", default=None, metavar="SWEEP",
                        help="judge the headline group-sequentially by this design: a design file (a path or a name in "
                             "conf/design, checked against the store's first record) or a sweep file's design "
                             "block (conf/sweep); figures of its last complete look")


def design_from_args(args: argparse.Namespace):  # -> kvbench.sequential.Design | None
    """A design file (``conf/design/<name>.yaml``: pre-registered, checked against the store's first record,
    spec v1.2 §2.6) when there is one by that name, else a sweep file's ``design`` block."""
    if not getattr(args, "design", None):
        return None
    from kvbench import registration

    if registration.design_path(args.design) is not None:
        return registration.check(registration.load(args.design), getattr(args, "results_dir", "results"))
    from kvbench.sweep import load_design

    return load_design(args.design)


def filters_from_args(args: argparse.Namespace) -> Filters:
    setting = getattr(args, "setting", None)
    if setting is not None and setting not in SETTINGS:
        raise KVBenchError(f"unknown setting {setting!r}; valid: {', '.join(SETTINGS)}")
    tasks = tuple(t for arg in args.task or [] for t in arg.split(",") if t) or None
    return Filters(model=args.model, tasks=tasks, hardware=args.hardware, spec_version=args.spec_version,
                   dtype=args.dtype, setting=setting)


def _distinct(values: pd.Series) -> list[str]:
    return sorted({str(v) for v in values.dropna()})


def with_setting(records: pd.DataFrame) -> pd.DataFrame:
    """``records`` with a ``setting`` column derived from ``query_aware`` (kept when already there)."""
    if "setting" in records.columns:
        return records
    qa = records["query_aware"] if "query_aware" in records.columns else pd.Series(None, index=records.index)
    return records.assign(setting=[setting_of(v) for v in qa])


def select_records(records: pd.DataFrame, filters: Filters) -> pd.DataFrame:
    """Apply ``filters``; an empty selection raises an error naming the values that do exist."""
    if records.empty:
        raise KVBenchError("the result store is empty; run a benchmark first, e.g. "
                           "`python -m kvbench strategies=[full,int8] task=legal`")
    out = with_setting(records)
    for col, wanted in (("model", filters.model), ("hardware", filters.hardware),
                        ("spec_version", filters.spec_version), ("dtype", filters.dtype),
                        ("setting", filters.setting)):
        if wanted is None:
            continue
        if col not in out.columns:
            raise KVBenchError(f"records carry no {col!r} field, so --{col.replace('_', '-')} cannot select")
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
    if {"model", "model_digest"} <= set(records.columns):  # one name, two checkpoints: never pooled
        digests = records.dropna(subset=["model_digest"]).groupby("model")["model_digest"].nunique()
        twice = sorted(str(m) for m in digests[digests > 1].index)
        if twice:
            raise KVBenchError(f"model {', '.join(twice)} names checkpoints with different model_digest values; "
                               "rerun one of them with model.name=<another name> so the two are ranked apart")
    if mixed:
        what = "; ".join(f"{col.replace('_', ' ')}s {', '.join(found)}" for col, _, found in mixed)
        flags = " and ".join(f"{flag} {found[0]}" for _, flag, found in mixed)
        raise KVBenchError(f"the selected records mix {what}; only one of each is ranked together — "
                           f"select with e.g. {flags}")


def json_text(value: Any) -> str:
    """Nested fields are JSON strings in the store but dicts in records.jsonl; compare them as text."""
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    return json.dumps(value, sort_keys=True, default=str)


def paired_records(records: pd.DataFrame, depth_key: str | None = None) -> pd.DataFrame:
    """Records ready for :func:`kvbench.report.summarize`: one per (task, strategy, sample), keyed by what
    the sample *is*, with ``setting`` and ``depth`` (the needle depth, NaN when none) columns added.

    Different runs reuse sample ids (a task at two context lengths, two runs that both include
    ``full``), and ``summarize`` pairs on ``sample_id`` alone. So ``sample_id`` is replaced by a key
    that also covers the sample's exact length, metadata (depth, seed, template, variant) and the
    run conditions that change its tokens; of identical measurements from several runs the one from the
    last store file (sorted run ids) is kept. Rows are sorted by that key so the bootstrap CIs do not
    depend on which store file was read first.
    """
    df = with_setting(records).copy()
    parts = df.apply(lambda r: [r.get("sample_id"), r.get("context_tokens"), json_text(r.get("sample_meta")),
                                r.get("seed"), r.get("query_aware"), r.get("dtype")], axis=1)
    df["sample_id"] = [f"{p[0]}#{stable_hash(p, 10)}" for p in parts]
    refuse_disagreeing_runs(df)
    df = df.drop_duplicates(subset=["task", "strategy", "sample_id"], keep="last")
    meta = df["sample_meta"] if "sample_meta" in df.columns else pd.Series(None, index=df.index)
    df["depth"] = [round(d, 3) for d in (sample_depth(m, depth_key) for m in meta)]
    return df.sort_values(["task", "strategy", "sample_id"], kind="mergesort").reset_index(drop=True)


#: Record fields that say how a run was set up (not what it measured, nor when or by which worker): named
#: when two runs of one strategy disagree, so the message says which setting separates them.
_RUN_FIELDS_IGNORED = ("run_id", "config_hash", "timing_contended", "concurrent_workers", "baseline_reused",
                       "baseline_sha256", "partial", "model_path")


def refuse_disagreeing_runs(df: pd.DataFrame) -> None:
    """One measurement per (model, task, sample, strategy label, spec) in a table: when records of one key from
    different runs (or files) disagree on a measurement, no table can pick one, so this raises one
    :class:`KVBenchError` naming both files and what separates the runs (an engine setting, or nothing
    recorded: a copied or edited file). Agreeing copies (``full`` in every run) pass; the caller keeps one."""
    from kvbench.record import MEASURED_FIELDS
    from kvbench.results import SOURCE_COLUMN, disagreement

    keys = [c for c in ("model", "spec_version", "task", "strategy", "sample_id") if c in df.columns]
    dup = df[df.duplicated(subset=keys, keep=False)]
    if dup.empty:
        return
    skip = {*MEASURED_FIELDS, "score", "prediction", "stats", SOURCE_COLUMN, *_RUN_FIELDS_IGNORED,
            *(c for c in df.columns if c.endswith("_s") or c.startswith("peak_"))}
    for _, group in dup.groupby(keys, sort=False, dropna=False):
        rows = group.to_dict("records")
        first = rows[0]
        for other in rows[1:]:
            name = disagreement(first, other)
            if name is None:
                continue
            settings = [f"{c} {first.get(c)!r} vs {other.get(c)!r}" for c in sorted(set(first) & set(other))
                        if c not in skip and json_text(first.get(c)) != json_text(other.get(c))]
            why = (f"the runs differ in {'; '.join(settings)}" if settings else
                   "nothing recorded tells the runs apart (a copied or edited file, or an engine setting only "
                   f"runs/{first.get('run_id')}/config.yaml and runs/{other.get('run_id')}/config.yaml hold)")
            files = sorted({str(first.get(SOURCE_COLUMN, first.get("run_id"))),
                            str(other.get(SOURCE_COLUMN, other.get("run_id")))})
            raise KVBenchError(
                f"two runs measured strategy {first.get('strategy')!r} on sample "
                f"{str(first.get('sample_id')).split('#')[0]!r} of task {first.get('task')!r} differently ({name} "
                f"{first.get(name)!r} vs {other.get(name)!r}): {' and '.join(files)}; {why}. A table holds one "
                "measurement per sample: remove the file that is wrong, or keep the runs in separate results "
                "directories")


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
        print(f"kvbench {command}: error: {safe_message(exc)}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


__all__ = ["Filters", "HOMOGENEOUS", "add_design_argument", "add_filter_arguments", "check_comparable",
           "design_from_args", "filters_from_args", "json_text",
           "paired_records", "run_cli", "select_records", "with_setting"]
