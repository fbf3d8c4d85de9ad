"""The words every reader of the result store shares: the baseline, the pooled scope, the query settings and a
sample's needle depth. One definition each, read by the summary (:mod:`kvbench.report`), the store selection
(:mod:`kvbench.selection`), the claim check (:mod:`kvbench.claims`), the leaderboard and the plots.

**Query settings** (measurement spec, "Query setting"): where the question sits relative to the compressed
prefix. ``query-aware`` — the question is part of the prefix the strategy compresses (kvbench's task default,
``task.query_aware=true``); ``query-agnostic`` — the context is compressed first and the question asked
afterwards (``task.query_aware=false``: kvpress's setting, the field's standard one). The two never pair:
every figure is computed per setting.

**Needle depth**: the relative position (0 = start of the context, 1 = end) of the fact a question needs, as
the task wrote it into ``sample_meta``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd

from kvbench.fmt import is_missing

#: The reference every strategy is paired with (``strategies/full.py``; every run records it).
BASELINE = "full"
#: Pseudo-task of a summary holding figures pooled over every task (built by :mod:`kvbench.leaderboard`).
OVERALL = "all"
#: Families whose ``memory_reduction`` is device memory only: the bytes move to host RAM or disk rather than
#: disappear, so they cannot support a claim about KV memory saved and are never ranked with the others (the
#: tiered cache's own figures are in its records' ``stats``).
OFFLOADING_FAMILIES = ("tiered",)

QUERY_AWARE = "query-aware"
QUERY_AGNOSTIC = "query-agnostic"
#: The two settings, in report order (kvbench's default first).
SETTINGS = (QUERY_AWARE, QUERY_AGNOSTIC)
#: What each setting means, and the config flag that selects it.
SETTING_MEANING = {
    QUERY_AWARE: "the question is part of the compressed prefix",
    QUERY_AGNOSTIC: "the context is compressed before the question is asked",
}
SETTING_FLAG = {QUERY_AWARE: "task.query_aware=true", QUERY_AGNOSTIC: "task.query_aware=false"}
#: A setting as a heading line (leaderboard sections, the claim check's per-setting title).
SETTING_TEXT = {
    QUERY_AWARE: f"{QUERY_AWARE}: {SETTING_MEANING[QUERY_AWARE]} ({SETTING_FLAG[QUERY_AWARE]})",
    QUERY_AGNOSTIC: f"{QUERY_AGNOSTIC}: {SETTING_MEANING[QUERY_AGNOSTIC]} ({SETTING_FLAG[QUERY_AGNOSTIC]}, "
                    "kvpress's setting)",
}
#: A setting as the sentence that opens its section of the claim check.
SETTING_SENTENCE = {
    QUERY_AWARE: f"{SETTING_MEANING[QUERY_AWARE]} (kvbench's default, `{SETTING_FLAG[QUERY_AWARE]}`)",
    QUERY_AGNOSTIC: f"{SETTING_MEANING[QUERY_AGNOSTIC]} (the field's standard setting, kvpress's; "
                    f"`{SETTING_FLAG[QUERY_AGNOSTIC]}`)",
}

#: sample_meta keys that may hold the relative depth of the fact a question needs, in order of preference; a
#: list value (several needles) is averaged.
DEPTH_KEYS = ("depth", "needle_depth", "depths", "needle_depths")


def setting_of(query_aware: Any) -> str:
    """The setting of a record's ``query_aware`` flag: query-agnostic when it is false (``False``, ``0``, or
    the text ``"false"``/``"0"``/``"no"`` of a CSV or JSON store), else query-aware — records without one
    (missing, NaN) count as query-aware, the tasks' default."""
    if is_missing(query_aware):
        return QUERY_AWARE
    if isinstance(query_aware, str):
        return QUERY_AGNOSTIC if query_aware.strip().lower() in ("false", "0", "no") else QUERY_AWARE
    return QUERY_AWARE if bool(query_aware) else QUERY_AGNOSTIC


def settings(records: pd.DataFrame) -> pd.Series:
    """Each record's setting, from its ``query_aware`` flag (:func:`setting_of`)."""
    if "query_aware" not in records:
        return pd.Series(QUERY_AWARE, index=records.index, dtype=object)
    return pd.Series([setting_of(v) for v in records["query_aware"]], index=records.index, dtype=object)


def ordered_settings(values: Iterable[Any]) -> list[str]:
    """The distinct settings among ``values`` in report order: the two known ones first, others sorted."""
    have = {str(v) for v in values if not is_missing(v)}
    return [s for s in SETTINGS if s in have] + sorted(have - set(SETTINGS))


def in_setting(frame: pd.DataFrame, setting: str | None) -> pd.DataFrame:
    """The rows of ``frame`` in ``setting``; all of them when ``setting`` is None or the frame has no
    ``setting`` column (a frame of one setting)."""
    if setting is None or "setting" not in frame:
        return frame
    return frame[frame["setting"] == setting]


def sample_depth(meta: Any, key: str | None = None) -> float:
    """A sample's needle depth from its ``sample_meta`` (JSON text or dict), read from ``key`` or else the first
    of :data:`DEPTH_KEYS` present; NaN when it has none."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            return float("nan")
    if not isinstance(meta, dict):
        return float("nan")
    for k in ([key] if key else DEPTH_KEYS):
        v = meta.get(k)
        if isinstance(v, (list, tuple)) and v and all(isinstance(d, (int, float)) for d in v):
            return float(np.mean(v))
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return float("nan")
