"""Reading a results tree's records, with every value checked: what verify, the leaderboard and every table read.

The files come from :mod:`kvbench.results.tree` (exactly the files the manifest covers; a link or a hidden file
is refused, named). ``store/*.parquet`` files are concatenated and duplicate (run config, sample, strategy) keys
across files dropped, so stores from many machines merge — but refused, naming both files, when two records of
one key disagree on a measurement (:func:`read_store`), and one file holding a key twice is refused. Readers skip
what they cannot parse (an unreadable or non-kvbench parquet file) with one warning naming the file, and keep
every good record; the values they keep are checked against the record schema (:func:`check_values`: one line
naming the file and field of the first bad one). Every record read names the file it came from
(``source_file``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.files import warn
from kvbench.results.schema import BadValueError, _missing, check_values
from kvbench.results.store import RECORD_KEY, DuplicateRecordError, RunStore, duplicate_message, flatten_for_store
from kvbench.results.tree import run_records, store_files

#: Column naming the file (relative to the results directory) a record was read from.
SOURCE_COLUMN = "source_file"


#: Columns every store file has, and their kind; a parquet file without them is not kvbench's.
STORE_TEXT_COLUMNS = ("config_hash", "strategy", "task", "model")


STORE_NUMBER_COLUMNS = ("score",)


def _agreed_fields() -> tuple[str, ...]:
    """What two records of one key must agree on: the score and prediction, and every measured field but the
    timings and peak memory (those vary between identical runs)."""
    from dataclasses import fields

    from kvbench.record import Record

    return ("score", "prediction", *(f.name for f in fields(Record) if f.metadata["measured"]
                                     and f.metadata["group"] != "latency" and not f.name.startswith("peak_")))


#: Floats of one key may differ this much (relative) between stores before they count as a conflict.
AGREE_RTOL = 1e-5


def read_store(results_dir: str | Path) -> pd.DataFrame:
    """Every record in ``results_dir/store``, de-duplicated by (config, sample, strategy).

    Files that cannot be read, or that lack the record key and the columns every record has, are skipped
    with one warning naming them. Two records of one key are the same measurement (copies from merged
    stores; the later file's is kept) unless they disagree on a field in :func:`_agreed_fields`: then
    nothing can tell which file is right, so this refuses with one line naming both files (measurement
    spec §5.3) rather than let a copied or forged file decide the numbers."""
    store = Path(results_dir) / "store"
    files = store_files(results_dir)
    frames, bad, foreign = [], [], []
    for f in files:
        try:
            df = pd.read_parquet(f)
        except Exception:  # pyarrow raises several types for truncated or foreign bytes
            bad.append(f.name)
            continue
        problem = _schema_problem(df)
        if problem:
            foreign.append(f"{f.name} ({problem})")
        elif not df.empty:
            refuse_duplicates(df, f)
            # A file's own source column (a frame read back and written again) is replaced by where it was read.
            df = df.drop(columns=SOURCE_COLUMN, errors="ignore")
            frames.append(check_values(df, str(f)).assign(_store_file=f.name))
    if bad:
        warn(f"skipped {len(bad)} unreadable parquet file(s) in {store}: {', '.join(bad)}")
    if foreign:
        warn(f"skipped {len(foreign)} parquet file(s) in {store} that hold no kvbench records: {', '.join(foreign)}")
    if not frames:
        return pd.DataFrame()
    columns = {str(df["_store_file"].iloc[0]): set(df.columns) for df in frames}
    df = pd.concat(frames, ignore_index=True)
    _refuse_conflicts(df, columns, store)
    df = df.drop_duplicates(subset=RECORD_KEY, keep="last").reset_index(drop=True)
    # Which file each record was read from: a later check that pairs records of different runs names it.
    return df.rename(columns={"_store_file": SOURCE_COLUMN}).assign(
        **{SOURCE_COLUMN: lambda d: "store/" + d[SOURCE_COLUMN].astype(str)})
















def _schema_problem(df: pd.DataFrame) -> str | None:
    from pandas.api import types

    for col in (*RECORD_KEY, *STORE_TEXT_COLUMNS, *STORE_NUMBER_COLUMNS):
        if col not in df.columns:
            return f"no {col!r} column"
    if df.empty:
        return None
    for col in STORE_TEXT_COLUMNS:
        if not types.is_string_dtype(df[col]):
            return f"{col!r} is not text"
    if types.is_bool_dtype(df["score"]) or not types.is_numeric_dtype(df["score"]):
        return "'score' is not numeric"
    return None


def refuse_duplicates(df: pd.DataFrame, path: object) -> None:
    """One :class:`DuplicateRecordError` when the records of one store file hold a (config, sample, strategy)
    twice: a run's file is written from its de-duplicated records, so no kvbench writer made it."""
    dup = df.duplicated(subset=RECORD_KEY, keep=False)
    if not dup.any():
        return
    keys = df[RECORD_KEY].astype(str).agg("\x1f".join, axis=1).to_numpy()
    at = [i for i, k in enumerate(keys) if k == keys[dup.to_numpy().argmax()]]
    key = tuple(df.iloc[at[0]][k] for k in RECORD_KEY)
    n = int(df.duplicated(subset=RECORD_KEY).sum())
    raise DuplicateRecordError(duplicate_message(path, key, at[0] + 1, at[1] + 1, n, "rows"))


def records_duplicates(path: Path) -> None:
    """:class:`DuplicateRecordError` when the results file ``path`` (a run's ``records.jsonl`` or a store's
    parquet file) holds a (config, sample, strategy) twice; other files, and unreadable ones (their readers say
    so), pass."""
    if path.name == "records.jsonl" and path.parent.parent.name == "runs":
        RunStore(path.parent.parent.parent, path.parent.name).load_records(quiet=True)
    elif path.suffix == ".parquet" and path.parent.name == "store":
        try:
            df = pd.read_parquet(path, columns=RECORD_KEY)
        except Exception:  # unreadable or without the key: read_store names it
            return
        refuse_duplicates(df, path)


def _refuse_conflicts(df: pd.DataFrame, columns: dict[str, set[str]], store: Path) -> None:
    """One :class:`KVBenchError` naming the files when two records of one key disagree on a measurement."""
    dup = df[df.duplicated(subset=RECORD_KEY, keep=False)]
    if dup.empty:
        return
    conflicts: list[tuple[tuple, str, Any, str, Any, str]] = []
    for key, grp in dup.groupby(RECORD_KEY, sort=False, dropna=False):
        rows = grp.to_dict("records")
        for name in _agreed_fields():
            having = [r for r in rows if name in columns[r["_store_file"]]]
            first = next(iter(having), None)
            other = next((r for r in having[1:] if not _same(first[name], r[name])), None) if first else None
            if other is not None:
                conflicts.append((key, name, first[name], first["_store_file"], other[name], other["_store_file"]))
                break
    if not conflicts:
        return
    (cfg, sample, strategy), name, a, fa, b, fb = conflicts[0]
    pairs = sorted({" vs ".join(sorted((c[3], c[5]))) for c in conflicts})
    raise KVBenchError(
        f"{len(conflicts)} record(s) in {store} are stored twice with different measurements, so no table can "
        f"pick one: e.g. {name} of sample {sample!r}, strategy {strategy!r}, config {cfg}: {a!r} in {fa} vs "
        f"{b!r} in {fb} (files: {'; '.join(pairs[:5])}{' ...' if len(pairs) > 5 else ''}); remove the file "
        "that is wrong (each run's runs/<run-id>/records.jsonl is its source) and rerun")


def disagreement(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first measured field (:func:`_agreed_fields`) two records of one sample disagree on, or None when
    they are the same measurement (timings aside)."""
    for name in _agreed_fields():
        if name in a and name in b and not _same(a[name], b[name]):
            return name
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN, floats to :data:`AGREE_RTOL`."""
    import math

    na, nb = _missing(a), _missing(b)
    if na or nb:
        return na and nb
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=AGREE_RTOL, abs_tol=1e-12)
    return a == b




def read_unpublished(results_dir: str | Path) -> pd.DataFrame:
    """Records of runs whose finished samples are not (all) in the store yet — a run stopped or still going
    before it published its parquet — from their ``records.jsonl``, with ``partial=True``.

    A run is published when ``store/<run id>.parquet`` holds as many records as its ``records.jsonl``; the
    store is only written when a run ends, so without this an interrupted run's finished samples would be
    invisible to the leaderboard. Empty when every run is published.
    """
    root = Path(results_dir)
    frames = []
    for run in sorted((root / "runs").iterdir()) if (root / "runs").is_dir() else []:
        odd = run / "records.jsonl"
        if not run.name.startswith(".") and run.is_dir() and odd.exists() and not odd.is_file():
            warn(f"skipped {odd} ({odd} is not a file: a directory or device in its place)")
    for path in run_records(root):
        run_id = path.parent.name
        try:
            records = RunStore(root, run_id).load_records(quiet=True)
        except (DuplicateRecordError, BadValueError):
            raise  # a record held twice or a bad value is refused, never skipped: it could be what ranks first
        except (OSError, ValueError, KVBenchError) as exc:
            warn(f"skipped {path} ({exc})")
            continue
        parquet = root / "store" / f"{run_id}.parquet"
        try:
            published = len(pd.read_parquet(parquet, columns=[RECORD_KEY[0]])) if parquet.is_file() else 0
        except Exception:  # unreadable: read_store reports it; the run's records count as unpublished
            published = 0
        if records and len(records) > published:
            frame = check_values(flatten_for_store(pd.DataFrame(records)), str(path))
            frames.append(frame.assign(partial=True, **{SOURCE_COLUMN: f"runs/{run_id}/records.jsonl"}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
