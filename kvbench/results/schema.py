"""The record schema every reader checks: one rule for the leaderboard, verify and a resumed run.

:func:`check_values` holds a frame of records against :class:`kvbench.record.Record`'s annotations: numbers are
numbers (finite; NaN only where a field was not measured), never negative, fractions in [0, 1],
``memory_reduction`` below 1; text is text, nested fields are JSON of their declared kind. A resumed run checks
the records it keeps by the same rule before using or publishing them (:meth:`kvbench.results.store.RunStore.
load_records`), so a NaN score or ``kv_bytes: -5`` in ``records.jsonl`` is one line, never a traceback or a
published number.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.files import _CONTROL, printable, warn

#: Fields whose values are fractions: closed [0, 1] ranges.
UNIT_FIELDS = ("score", "top1_agreement", "gold_token_accuracy", "kept_fraction")


#: Reductions (``memory_reduction``, ``memory_reduction_fp16``, any field named ``memory_reduction*``) are below 1
#: (a cache of no bytes saves nothing to measure) but may be negative: a float32 cache is twice its 16-bit
#: reference (-1).
BELOW_ONE_PREFIX = "memory_reduction"


#: Text that is the model's or the task's own (a prediction may hold a newline): kept as read; every other text
#: value is a name or an identifier and loses its control characters.
FREE_TEXT_FIELDS = ("prediction", "answers", "sample_meta", "params", "stats")


#: Fields that must be present and finite in every record (the others may be NaN: not measured).
REQUIRED_NUMBERS = ("score",)


class BadValueError(KVBenchError):
    """A record holds a value the schema refuses: the file is refused by every reader, never skipped (a skipped
    file's good records would vanish from a table without an error, and a run would publish around it)."""


@functools.lru_cache(maxsize=1)
def _schema() -> dict[str, str]:
    """Each record field's kind from :class:`kvbench.record.Record`'s annotations: ``number`` (int, float),
    ``text`` (str, str | None), ``object`` (dict) or ``array`` (list)."""
    import typing

    from kvbench.record import Record

    kinds = {}
    for name, hint in typing.get_type_hints(Record).items():
        base = typing.get_origin(hint) or hint
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if base in (typing.Union, types.UnionType) and len(args) == 1:
            base = typing.get_origin(args[0]) or args[0]
        kinds[name] = {int: "number", float: "number", str: "text", dict: "object", list: "array"}.get(base, "")
    kinds.pop("run", None)
    return kinds


def _json_kind(value: Any, kind: str) -> bool:
    """A nested field as stored (a JSON string) or as written (the object): of the declared ``kind``."""
    if _missing(value):
        return True
    if isinstance(value, str):  # the opening bracket decides the kind; parsing every row would cost seconds
        text = value.lstrip()
        return text == "null" or text[:1] == ("{" if kind == "object" else "[")
    return isinstance(value, dict if kind == "object" else list)


def check_values(df: pd.DataFrame, source: str) -> pd.DataFrame:
    """``df`` (records read from ``source``) with its values checked against the record schema: numbers are
    numbers (finite; NaN only where a field was not measured), never negative, fractions in [0, 1],
    ``memory_reduction`` below 1; text is text, nested fields are JSON of their declared kind. The first bad
    value is one :class:`KVBenchError` line naming the file, the field and the record, so a forged or broken
    row can never be ranked. Control characters in text (an ESC sequence in a name would drive the terminal
    of whoever reads a report) are removed, with one warning."""
    import numpy as np
    from pandas.api import types as ptypes

    def bad(name: str, mask: Any, expected: str) -> None:
        rows = df[mask]
        if rows.empty:
            return
        row = rows.iloc[0]
        raise BadValueError(
            f"{source}: field {name!r} is {row[name]!r} in the record of sample {printable(row.get('sample_id'))!r}, "
            f"strategy {printable(row.get('strategy'))!r} ({len(rows)} record(s) in all); expected {expected}: a "
            "damaged or edited results file — remove it or rerun the run that wrote it")

    for name, kind in _schema().items():
        if name not in df.columns:
            continue
        col = df[name]
        if kind == "number":
            if ptypes.is_bool_dtype(col) or not (ptypes.is_numeric_dtype(col) or col.isna().all()):
                bad(name, col.map(lambda v: not (_missing(v) or (isinstance(v, (int, float, np.number))
                                                                 and not isinstance(v, (bool, np.bool_))))),
                    "a number")
            values = pd.to_numeric(col, errors="coerce").astype(float)
            bad(name, np.isinf(values), "a finite number")
            if name in REQUIRED_NUMBERS:
                bad(name, values.isna(), "a number (every record has one)")
            if name in UNIT_FIELDS:
                bad(name, (values < 0) | (values > 1), "a fraction in [0, 1]")
            elif name.startswith(BELOW_ONE_PREFIX):
                bad(name, values >= 1, "a fraction below 1")
            else:
                bad(name, values < 0, "a non-negative number")
        elif kind == "text" and not ptypes.is_string_dtype(col):
            bad(name, col.map(lambda v: not (_missing(v) or isinstance(v, str))), "text")
        elif kind in ("object", "array"):
            bad(name, ~col.map(lambda v, k=kind: _json_kind(v, k)).astype(bool),
                "a JSON object" if kind == "object" else "a JSON array")
    stripped = 0
    for name in df.columns:
        if name in FREE_TEXT_FIELDS:
            continue
        col = df[name]
        if col.dtype == object or ptypes.is_string_dtype(col):
            hit = col.map(lambda v: isinstance(v, str) and _CONTROL.search(v) is not None).astype(bool)
            if hit.any():
                df = df.assign(**{name: col.map(lambda v: printable(v) if isinstance(v, str) else v)})
                stripped += int(hit.sum())
    if stripped:
        warn(f"{source}: removed control characters from {stripped} value(s) (names are shown as plain text)")
    return df


def _missing(v: Any) -> bool:
    try:
        return v is None or bool(pd.isna(v))
    except (TypeError, ValueError):  # arrays and other non-scalars
        return False
