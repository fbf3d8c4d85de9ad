"""Length bands: the declared bins pooled figures pool over, so every question of a task counts once.

The measurement spec never pools across context lengths (spec v1.2 §2.3): accuracy falls with length (Hsieh et al.
2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?"), so a pool mixing 2K and 8K
questions answers for neither. A *band* is the length a question was declared at, not the length it happened to
have: the built-in tasks build every context at exactly ``task.context_tokens`` (the grid point is the length), but
one's own documents keep their natural lengths under that budget (LongBench-style middle truncation), so keying on
the exact length would split one task into as many pools as it has distinct lengths and pool a handful of its
questions (one band for data whose lengths vary, as LongBench reports one score per dataset; Bai et al. 2024).

A record's band, first that applies:

1. ``sample_meta["context_budget"]`` — the ``task.context_tokens`` a natural-length task (``hf``, ``jsonl``) was
   built under, recorded since bands exist;
2. a natural-length record without it (``sample_meta`` has ``original_context_tokens``): one band for its task,
   named by the task's longest such context;
3. otherwise ``context_tokens`` itself: the grid point of a fixed-length task.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pandas as pd

from kvbench.fmt import as_float

#: The column :func:`with_bands` adds.
BAND = "length_band"


def _meta(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            out = json.loads(value)
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}
    return {}


def bands(records: pd.DataFrame) -> pd.Series:
    """Each record's band in tokens (NaN where no length is recorded); see the module docstring for the rule."""
    if records.empty or "context_tokens" not in records:
        return pd.Series(math.nan, index=records.index, dtype=float)
    lengths = pd.to_numeric(records["context_tokens"], errors="coerce")
    metas = [_meta(m) for m in (records["sample_meta"] if "sample_meta" in records
                                else pd.Series(None, index=records.index))]
    budget = pd.Series([as_float(m.get("context_budget")) for m in metas], index=records.index)
    natural = pd.Series(["original_context_tokens" in m for m in metas], index=records.index)
    loose = natural & budget.isna()
    # Rule 2: one band per task for natural-length records that predate the recorded budget.
    longest = lengths[loose].groupby(records.loc[loose, "task"].astype(str)).max()
    fallback = records["task"].astype(str).map(longest)
    return budget.where(budget.notna(), fallback.where(loose, lengths)).astype(float)


def with_bands(records: pd.DataFrame) -> pd.DataFrame:
    """``records`` with the :data:`BAND` column (computed once; kept when already there)."""
    if BAND in records:
        return records
    return records.assign(**{BAND: bands(records)})


def band_text(records: pd.DataFrame, band: float) -> str:
    """``4,096 tokens`` for a band whose contexts all have its length; ``908–1,687 tokens (one band, up to
    2,048)`` where natural lengths vary inside it."""
    recs = with_bands(records)
    lengths = sorted({int(v) for v in pd.to_numeric(recs.loc[recs[BAND] == band, "context_tokens"],
                                                     errors="coerce").dropna()})
    if not lengths or lengths == [int(band)]:
        return f"{int(band):,} tokens"
    span = f"{lengths[0]:,}" if len(lengths) == 1 else f"{lengths[0]:,}–{lengths[-1]:,}"
    return f"{span} tokens (one band, up to {int(band):,})"


def pooled_band(records: pd.DataFrame) -> float | None:
    """The band pooled columns use: the one most tasks were measured in, the longest on a tie (None: no length
    recorded)."""
    recs = with_bands(records)
    known = recs[recs[BAND].notna()]
    if known.empty:
        return None
    per_band = known.groupby(BAND)["task"].nunique()
    return float(max(per_band.index, key=lambda b: (per_band[b], b)))


def bands_text(records: pd.DataFrame) -> str:
    """Every band of ``records`` as :func:`band_text`, shortest first, joined by "and"."""
    recs = with_bands(records)
    return " and ".join(band_text(recs, b) for b in sorted(recs[BAND].dropna().unique()))
