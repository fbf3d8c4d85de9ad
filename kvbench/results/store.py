"""The run store: one directory per run, its records appended as each sample finishes, and its parquet mirror.

``results/runs/<run-id>/`` holds ``config.yaml`` (resolved), ``environment.json``, ``records.jsonl`` (one line per
(sample, strategy), appended and fsynced as each finishes, each once: :meth:`RunStore.append` refuses a record the
file already holds) and ``summary.csv``; ``results/store/<run-id>.parquet`` mirrors the run's records for reports.

The run id is ``<task slug>-<model slug>-<hash>``; the hash covers everything that determines the records
(:mod:`kvbench.identity`), so re-running an identical config finds its directory and skips finished samples; a
kill loses at most the sample in flight. Slugs keep only ``[A-Za-z0-9_-]``, so no config value can place a file
outside ``results_dir`` (the real names stay in the records).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import socket
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError
from kvbench.results.files import (
    UnwritableError,
    _check_writable,
    _unwritable,
    _why,
    atomic_write_parquet,
    atomic_write_text,
    clean_stale_tmp,
    printable,
    quiet_warnings,
    slug,
    warn,
)
from kvbench.results.schema import check_values

RECORD_KEY = ["config_hash", "sample_id", "strategy"]


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
    # The whole resolved set as well: two installs of one lock file are the same environment, and a reader can
    # check that (the seven above stay first for the readers that use them).
    installed = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed[str(name).lower()] = dist.version
    return {
        "packages": pkgs,
        "installed": dict(sorted(installed.items())),
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
        if slug(run_id, max_len=len(run_id)) != run_id:
            raise ValueError(f"run id {run_id!r} is not path-safe (use kvbench.results.slug)")
        self.root = Path(results_dir)
        self.run_id = run_id
        self.dir = self.root / "runs" / run_id
        self.records_path = self.dir / "records.jsonl"

    def init(self, config_yaml: str, env: dict[str, Any], identity: dict[str, Any] | None = None) -> None:
        # The store is where a run's records are published at its end: proven writable before anything is
        # measured, so a read-only store/ costs one line, not a run's worth of work.
        _check_writable(self.root / "store")
        self.dir.mkdir(parents=True, exist_ok=True)
        for d in (self.dir, self.root / "store", self.root / "baselines"):
            clean_stale_tmp(d)
        atomic_write_text(self.dir / "config.yaml", config_yaml)
        atomic_write_text(self.dir / "environment.json", json.dumps(env, indent=2, sort_keys=True))
        if identity is not None:
            atomic_write_text(self.dir / "identity.json", json.dumps(identity, indent=2, sort_keys=True))

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

    def load_records(self, quiet: bool = False) -> list[dict[str, Any]]:
        """All complete records, one per (config, sample, strategy), their values checked by the one rule every
        reader applies (:func:`kvbench.results.schema.check_values`: a NaN score, a negative byte count, a list
        where an object belongs is one :class:`KVBenchError` line naming the file, field and record).

        A torn last line from a killed run is ignored silently; any other unreadable line (not UTF-8, not JSON,
        not an object) is skipped with one warning naming the file and the count. A (config, sample, strategy)
        written twice is refused (:class:`DuplicateRecordError`, one line naming the file, the record and both
        line numbers): :meth:`append` never writes one, so the file was written by something else, and nothing
        tells which of the two measurements is the run's.
        """
        if self.records_path.is_symlink():
            raise KVBenchError(f"{self.records_path} is a symbolic link (kvbench never makes one, and no manifest "
                               "vouches for what it points to); put the run's own records file in its place")
        if not self.records_path.exists():
            return []
        if not self.records_path.is_file():
            raise KVBenchError(f"{self.records_path} is not a file (a directory or device in its place); move it "
                               "away and rerun (the run's records are read from it)")
        out: dict[tuple, dict[str, Any]] = {}
        first_line: dict[tuple, int] = {}
        dups: list[tuple[tuple, int, int]] = []
        bad = 0
        data = self.records_path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline; else a torn write in progress or killed
        # A torn last line (a killed writer) is ignored silently; one that parses is a good record.
        tail = _parse_record(torn) if torn.strip() else None
        for n, raw in enumerate(lines + ([torn] if tail is not None else []), 1):
            rec = _parse_record(raw)
            if rec is None:
                bad += raw.strip() != b""
                continue
            key = record_key(rec)
            if key in out:
                dups.append((key, first_line[key], n))
                continue
            out[key], first_line[key] = rec, n
        if dups:
            key, first, again = dups[0]
            raise DuplicateRecordError(duplicate_message(self.records_path, key, first, again, len(dups)))
        if not quiet and bad:
            warn(f"skipped {bad} unreadable line(s) in {self.records_path} (not UTF-8 JSON objects); "
                 f"kept {len(out)} record(s)")
        records = list(out.values())
        if records:  # the leaderboard's rule, before a resumed run uses or publishes them (one line, not a traceback)
            with quiet_warnings():  # names with control characters are cleaned, and said, where they are shown
                check_values(flatten_for_store(pd.DataFrame(records)), str(self.records_path))
        return records

    def _stored_keys(self, fd: int) -> set[tuple]:
        """The keys of the records in the open records file, re-read only when it changed since the last call
        (another worker appended, or a torn line was cut)."""
        st = os.fstat(fd)
        stamp = (st.st_ino, st.st_size)
        if getattr(self, "_keys_stamp", None) != stamp:
            keys = set()
            for raw in os.pread(fd, st.st_size, 0).split(b"\n") if st.st_size else []:
                rec = _parse_record(raw)
                if rec is not None:
                    keys.add(record_key(rec))
            self._keys, self._keys_stamp = keys, stamp
        return self._keys

    def append(self, records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append a sample's records together or not at all: written and fsynced as one unit, and on any
        failure (a full disk) the file is cut back to where it was, so no torn sample is left behind. A
        complete last record that lacks its newline is kept (sealed with one), a torn one dropped.

        A record whose (config, sample, strategy) the file already holds is refused, under the run's lock, with
        one warning: a resume or a second worker that computed a stored sample again never writes it twice
        (the first measurement stands; readers refuse a file that holds one twice). Returns what was written."""
        records = list(records)
        keys = {(r.get("config_hash"), r.get("sample_id")) for r in records}
        with self._locked():
            try:
                fd = os.open(self.records_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            except OSError as exc:
                raise _unwritable(self.records_path, exc, "append to") from None
            start = None
            try:
                if _seal_tail(fd):  # a torn unit: what it left of the samples written now is stale
                    _drop_tail_records(fd, keys)
                stored = self._stored_keys(fd)
                fresh, refused, seen = [], [], set()
                for r in records:
                    key = record_key(r)
                    (refused if key in stored or key in seen else fresh).append(r)
                    seen.add(key)
                if refused:
                    r = refused[0]
                    warn(f"{self.records_path}: not written again: {len(refused)} record(s) already stored, e.g. "
                         f"sample {printable(r.get('sample_id'))!r}, strategy {printable(r.get('strategy'))!r} (a "
                         "resume or another worker computed it again; the stored measurement stands)")
                blob = "".join(json.dumps(r, sort_keys=True, default=_json_default) + "\n" for r in fresh).encode()
                start = os.fstat(fd).st_size
                done = 0
                while done < len(blob):  # os.write may write less than asked (a filling disk)
                    done += os.write(fd, blob[done:])
                os.fsync(fd)
                st = os.fstat(fd)
                self._keys, self._keys_stamp = stored | seen, (st.st_ino, st.st_size)
            except BaseException as exc:  # a full disk, or an interrupt between two partial writes
                if start is not None:
                    os.ftruncate(fd, start)
                if isinstance(exc, OSError):
                    raise UnwritableError(
                        f"cannot append to {self.records_path} ({_why(exc)}); the sample's records were not "
                        "written (the file is as before): free space and rerun to resume") from None
                raise
            finally:
                os.close(fd)
        return fresh

    def write_outputs(self, summary: pd.DataFrame) -> None:
        with self._locked():  # the snapshot published is never older than one already published
            records = pd.DataFrame(self.load_records())
            atomic_write_text(self.dir / "summary.csv", summary.to_csv(index=False))
            if not records.empty:
                atomic_write_parquet(flatten_for_store(records), self.root / "store" / f"{self.run_id}.parquet")


def _seal_tail(fd: int) -> bool:
    """Make the file end at a line boundary before an append: a last line without its newline is sealed with
    one when it is a complete record (it counted as done, so dropping it would lose it), and cut off in place
    when it is torn by a kill (ftruncate keeps the inode other appenders hold). True when a torn line was cut."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return False
    end, cut_at = size, 0
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            cut_at = start + cut + 1
            break
        end = start
    if _parse_record(os.pread(fd, size - cut_at, cut_at)) is not None:
        os.write(fd, b"\n")
        return False
    os.ftruncate(fd, cut_at)
    return True


def _drop_tail_records(fd: int, keys: set[tuple[Any, Any]]) -> None:
    """After a torn unit was cut: cut the whole records before it that belong to the samples about to be
    appended again (same config and sample id). A sample's records are appended as one unit, so these are the
    torn unit's first records; left in place they would be stale duplicates of the records written now."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, min(size, 1 << 22), max(0, size - (1 << 22)))  # a unit is far smaller than 4 MiB
    base = size - len(data)
    lines = data.split(b"\n")[:-1]  # the file ends with a newline here
    cut = size
    for raw in reversed(lines[1:] if base else lines):  # the first line of a partial read may be cut
        rec = _parse_record(raw)
        if rec is None or (rec.get("config_hash"), rec.get("sample_id")) not in keys:
            break
        cut -= len(raw) + 1
    if cut < size:
        os.ftruncate(fd, cut)


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) else None


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value


def record_key(rec: dict[str, Any]) -> tuple:
    """A record's (config, sample, strategy): what one run holds once."""
    return tuple(_hashable(rec.get(k)) for k in RECORD_KEY)


class DuplicateRecordError(KVBenchError):
    """A results file holds one (config, sample, strategy) twice: refused, never resolved by picking one."""


def duplicate_message(path: object, key: tuple, first: int, again: int, count: int, unit: str = "lines") -> str:
    """One line: ``path`` holds ``key`` at ``first`` and ``again`` (``unit`` 1-based), ``count`` duplicates in all."""
    cfg, sample, strategy = key
    return (f"{printable(path)} holds sample {printable(sample)!r}, strategy {printable(strategy)!r} (config "
            f"{printable(cfg)}) twice ({unit} {first} and {again}; {count} duplicated record(s) in all): one run "
            "stores each (sample, strategy) once, so nothing tells which measurement is the run's; regenerate "
            "the run (move its directory away and rerun it) rather than edit the file")


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
