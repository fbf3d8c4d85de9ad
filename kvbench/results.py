"""Result storage: one directory per run plus a queryable parquet store shared by all runs.

``results/runs/<run-id>/`` holds ``config.yaml`` (resolved), ``environment.json``, ``records.jsonl``
(one line per (sample, strategy), appended and fsynced as each finishes) and ``summary.csv``.
``results/store/<run-id>.parquet`` mirrors the run's records for reports; readers concatenate the
directory and drop duplicate (run config, sample, strategy) keys, so stores from many machines merge.

The run id is a hash of everything that determines the records, so re-running an identical config
finds its directory and skips finished samples; a kill loses at most the sample in flight.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

RECORD_KEY = ["config_hash", "sample_id", "strategy"]


def stable_hash(obj: Any, length: int = 12) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def environment() -> dict[str, Any]:
    """Package versions, git commit, host and thread facts for the run directory."""
    import torch

    pkgs = {}
    for name in ("torch", "transformers", "hydra-core", "pandas", "datasets", "gguf", "kvbench"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "packages": pkgs,
        "git_commit": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class RunStore:
    """The files of one run; append-only records with crash-safe reads."""

    def __init__(self, results_dir: str | Path, run_id: str) -> None:
        self.root = Path(results_dir)
        self.run_id = run_id
        self.dir = self.root / "runs" / run_id
        self.records_path = self.dir / "records.jsonl"

    def init(self, config_yaml: str, env: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.dir / "config.yaml", config_yaml)
        atomic_write_text(self.dir / "environment.json", json.dumps(env, indent=2, sort_keys=True))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive lock on the run dir (flock on ``.lock``): appends and publishing never interleave."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load_records(self) -> list[dict[str, Any]]:
        """All complete records, one per (config, sample, strategy) (the last written wins); a torn last
        line from a killed run is ignored."""
        if not self.records_path.exists():
            return []
        out: dict[tuple, dict[str, Any]] = {}
        with self.records_path.open() as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                out[tuple(rec.get(k) for k in RECORD_KEY)] = rec
        return list(out.values())

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Append records with one write and an fsync, so a sample's records land together or not at all."""
        blob = "".join(json.dumps(r, sort_keys=True, default=_json_default) + "\n" for r in records)
        with self._locked():
            fd = os.open(self.records_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                _truncate_torn_tail(fd)
                os.write(fd, blob.encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    def write_outputs(self, summary: pd.DataFrame) -> None:
        with self._locked():  # the snapshot published is never older than one already published
            records = pd.DataFrame(self.load_records())
            atomic_write_text(self.dir / "summary.csv", summary.to_csv(index=False))
            if not records.empty:
                atomic_write_parquet(flatten_for_store(records), self.root / "store" / f"{self.run_id}.parquet")


def _truncate_torn_tail(fd: int) -> None:
    """Drop a torn final line left by a kill, in place (ftruncate keeps the inode other appenders hold)."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    end = size
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return
        end = start
    os.ftruncate(fd, 0)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def flatten_for_store(df: pd.DataFrame) -> pd.DataFrame:
    """Nested dicts/lists become JSON strings so every column has one parquet type."""
    out = df.copy()
    for col in out.columns:
        if out[col].map(lambda v: isinstance(v, (dict, list))).any():
            out[col] = out[col].map(lambda v: json.dumps(v, sort_keys=True, default=str))
    return out


def read_store(results_dir: str | Path) -> pd.DataFrame:
    """Every record in ``results_dir/store``, de-duplicated by (config, sample, strategy)."""
    store = Path(results_dir) / "store"
    files = sorted(store.glob("*.parquet")) if store.is_dir() else []
    if not files:
        return pd.DataFrame()
    df = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    return df.drop_duplicates(subset=RECORD_KEY, keep="last").reset_index(drop=True)
