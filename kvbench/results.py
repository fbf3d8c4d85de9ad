"""Result storage: one directory per run plus a queryable parquet store shared by all runs.

``results/runs/<run-id>/`` holds ``config.yaml`` (resolved), ``environment.json``, ``records.jsonl``
(one line per (sample, strategy), appended and fsynced as each finishes) and ``summary.csv``.
``results/store/<run-id>.parquet`` mirrors the run's records for reports; readers concatenate the
directory and drop duplicate (run config, sample, strategy) keys, so stores from many machines merge — but
refuse, naming both files, when two records of one key disagree on a measurement (:func:`read_store`).

The run id is ``<task slug>-<model slug>-<hash>``; the hash covers everything that determines the records
(:mod:`kvbench.identity`), so re-running an identical config finds its directory and skips finished samples; a
kill loses at most the sample in flight. Slugs keep only ``[A-Za-z0-9_-]``, so no config value can place a file
outside ``results_dir`` (the real names stay in the records).

Files are written with the user's umask (not ``mkstemp``'s 0600); temporary files left by a killed run
(``.<name>.*.tmp``) are removed by the next run; a directory that cannot be written (read-only, full disk) is
one :class:`UnwritableError` line, never a traceback, and never a half-written file. Readers skip what they
cannot parse (a non-UTF-8 or non-object line, an unreadable or non-kvbench parquet file) with one warning naming
the file and the count, and keep every good record; the values of what they keep are checked against the record
schema (:func:`check_values`: one line naming the file and field of the first bad one). Every record read names
the file it came from (``source_file``). Files kvbench reuses as caches carry a keyed seal (:func:`local_seal`).

Why one module of this length: the store's writer (:class:`RunStore`), its readers and the sample claims that
let several workers append to one store share one file layout and the atomic-write helpers; kept together, the
layout has one owner.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError

RECORD_KEY = ["config_hash", "sample_id", "strategy"]


class UnwritableError(KVBenchError, OSError):
    """A results file could not be written (read-only directory, full disk): one line, exit 2. An OSError
    too, so callers that tolerate a failed write (caches) still catch it."""


def stable_hash(obj: Any, length: int = 12) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


TMP_SUFFIX = ".tmp"
# A temporary file this old cannot belong to a live writer (writes take seconds), so the next run removes it.
STALE_TMP_SECONDS = 3600


# C0 and C1 control characters: ESC starts terminal sequences that retitle windows, recolour or move the cursor.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """``text`` without control characters, so a name from a config or a file can never drive the terminal."""
    return _CONTROL.sub("", str(text))


_QUIET = [0]


def warn(message: str) -> None:
    """One warning line on stderr (the run goes on); names in it are shown without control characters."""
    if not _QUIET[0]:
        print(f"kvbench: warning: {printable(message)}", file=sys.stderr)


@contextmanager
def quiet_warnings() -> Iterator[None]:
    """No :func:`warn` lines inside: for work repeated later in the same run (the up-front sample check of a
    job builds the samples the job builds again and warns about then)."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def slug(name: object, max_len: int = 40) -> str:
    """``name`` reduced to ``[A-Za-z0-9_-]`` (never empty, never ``.``/``..``): safe as one path component."""
    text = re.sub(r"[^A-Za-z0-9_-]+", "-", str(name)).strip("-_")[:max_len].strip("-_")
    return text or "x"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would: writers such as safetensors (0600) and
    ``mkdtemp`` (0700) ignore the umask, which would hide a shared cache from the user's group."""
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~_umask())


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _unwritable(path: Path, exc: OSError, what: str = "write") -> UnwritableError:
    err = UnwritableError(f"cannot {what} {path} ({_why(exc)}); make "
                          f"{path.parent} writable or choose another directory")
    err.errno = exc.errno  # a full disk (ENOSPC) is told apart from a read-only directory by callers
    return err


def _mkstemp(path: Path) -> tuple[int, str]:
    """``mkstemp`` beside ``path``, but with the permissions a plain ``open`` would give (mkstemp uses 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def clean_stale_tmp(directory: Path, older_than: float = STALE_TMP_SECONDS) -> list[Path]:
    """Remove ``.*.tmp`` files a killed writer left in ``directory`` (not recursive); returns what was removed."""
    removed = []
    if not directory.is_dir():
        return removed
    now = time.time()
    # ".<name>.<random>.tmp" from atomic writes; "tmp<random>.tmp" from baseline writes of older versions.
    for p in [*directory.glob(f".*{TMP_SUFFIX}"), *directory.glob(f"tmp*{TMP_SUFFIX}")]:
        try:
            if p.is_file() and now - p.stat().st_mtime > older_than:
                p.unlink()
                removed.append(p)
        except OSError:
            continue
    return removed


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """The one atomic write: ``write(tmp)`` fills a temporary file beside ``path``, which is then fsynced and
    renamed over ``path``, so a reader sees the old file or the whole new one, never a torn one. The file
    gets the user's umask; a failed write leaves no temporary file behind, and an OS refusal (read-only
    directory, full disk) is an :class:`UnwritableError` naming the path."""
    try:
        fd, tmp = _mkstemp(path)
    except OSError as exc:
        raise _unwritable(path, exc) from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # writers that recreate the file (safetensors) get mkstemp's 0600
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and not isinstance(exc, KVBenchError):
            raise _unwritable(path, exc) from None
        raise


def write_bytes(path: str | Path, data: bytes) -> None:
    """``data`` into ``path`` through ``os.write`` (which may write less than asked on a filling disk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)

    atomic_write(path, write)


def atomic_write_parquet(df: pd.DataFrame, path: Path) -> None:
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


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


SEAL_KEY = "seal.key"


def _seal_key() -> bytes | None:
    """This machine's secret for :func:`local_seal`: 32 random bytes in ``cache_dir()/seal.key`` (mode 0600),
    made on first use; None when the cache cannot hold it (nothing is then trusted from a cache file)."""
    from kvbench.paths import cache_dir

    path = cache_dir() / SEAL_KEY
    for _ in range(2):
        try:
            key = path.read_bytes()
            if len(key) == 32:
                return key
        except OSError:
            pass
        try:  # written aside and linked in: a concurrent first use reads one whole key, never half of one
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{SEAL_KEY}.", suffix=TMP_SUFFIX)
            try:
                os.write(fd, os.urandom(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        except OSError:
            return None
    return None


def local_seal(*parts: bytes) -> str | None:
    """HMAC-SHA256 of ``parts`` under this machine's key (:func:`_seal_key`), or None without a key.

    A file kvbench reuses as a cache (a stored baseline, a model's digest cache) carries the seal of its
    content; one whose seal does not verify was edited, forged consistently throughout, or written on another
    machine, and is recomputed: a hash written beside the data could be rewritten with it, a keyed one
    cannot without the key."""
    import hmac

    key = _seal_key()
    if key is None:
        return None
    mac = hmac.new(key, digestmod="sha256")
    for part in parts:
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def seal_matches(seal: object, *parts: bytes) -> bool:
    import hmac

    expected = local_seal(*parts)
    return expected is not None and isinstance(seal, str) and hmac.compare_digest(seal, expected)


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
        """All complete records, one per (config, sample, strategy).

        A torn last line from a killed run is ignored silently; any other unreadable line (not UTF-8, not JSON,
        not an object) is skipped with one warning naming the file and the count. A (config, sample, strategy)
        written twice is refused (:class:`DuplicateRecordError`, one line naming the file, the record and both
        line numbers): :meth:`append` never writes one, so the file was written by something else, and nothing
        tells which of the two measurements is the run's.
        """
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
        return list(out.values())

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


def _check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and prove a file can be made in it, else one :class:`UnwritableError`."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvbench-write-probe.", suffix=TMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UnwritableError(f"{directory} is not writable ({_why(exc)}); make it writable or choose another "
                              "results_dir=<dir>") from None


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
    files = sorted(store.glob("*.parquet")) if store.is_dir() else []
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


# ------------------------------------------------------------------------------------- values checked on read

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
        raise KVBenchError(
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


def _missing(v: Any) -> bool:
    try:
        return v is None or bool(pd.isna(v))
    except (TypeError, ValueError):  # arrays and other non-scalars
        return False


def read_unpublished(results_dir: str | Path) -> pd.DataFrame:
    """Records of runs whose finished samples are not (all) in the store yet — a run stopped or still going
    before it published its parquet — from their ``records.jsonl``, with ``partial=True``.

    A run is published when ``store/<run id>.parquet`` holds as many records as its ``records.jsonl``; the
    store is only written when a run ends, so without this an interrupted run's finished samples would be
    invisible to the leaderboard. Empty when every run is published.
    """
    root = Path(results_dir)
    frames = []
    for path in sorted((root / "runs").glob("*/records.jsonl")) if (root / "runs").is_dir() else []:
        run_id = path.parent.name
        try:
            records = RunStore(root, run_id).load_records(quiet=True)
        except DuplicateRecordError:
            raise  # a file holding a record twice is refused, never skipped: it could be what ranks first
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


# ------------------------------------------------------------------------------------------ concurrent workers


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.lru_cache(maxsize=1)
def _pid_scope() -> str:
    """Where this process's pid means something: the kernel's boot and the pid namespace. Containers (and
    sandboxes) on one machine often share a host name but not their pids: a pid checked outside its namespace
    looks dead, which let a second worker take over a live worker's claim and store its sample twice."""
    parts = []
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("")
    return "/".join(parts)


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_scope": _pid_scope(), "started": time.time()}


def _owner_alive(path: Path) -> bool | None:
    """True/False for a claim or worker file of a live/dead process this process can check; None when unreadable
    or missing. A file written by another host, or in another pid namespace of this one, counts as alive (its
    process cannot be checked from here)."""
    try:
        owner = json.loads(path.read_text())
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname() or owner.get("pid_scope", _pid_scope()) != _pid_scope():
        return True
    return _pid_alive(pid)


def _unreadable_and_stale(path: Path, seconds: float = 60.0) -> bool:
    """A claim with no readable owner (left by an older kvbench, interrupted between creating and writing it)
    that has not changed for ``seconds``: nobody is writing it."""
    if _owner_alive(path) is not None:
        return False
    try:
        return time.time() - path.stat().st_mtime > seconds
    except FileNotFoundError:
        return False


class ActiveWorker:
    """Registers this process in ``results_dir/.workers`` while it measures, so every worker can tell whether
    another kvbench worker was competing for the machine when it timed a sample."""

    def __init__(self, results_dir: str | Path) -> None:
        self.dir = Path(results_dir) / ".workers"
        self.path = self.dir / f"{slug(socket.gethostname())}-{os.getpid()}.json"

    def __enter__(self) -> ActiveWorker:
        atomic_write_text(self.path, json.dumps(_owner()))
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)

    def others(self) -> int:
        """Live kvbench workers other than this one (files of dead ones are removed)."""
        n = 0
        for p in self.dir.glob("*.json") if self.dir.is_dir() else []:
            if p == self.path:
                continue
            alive = _owner_alive(p)
            if alive is False:
                p.unlink(missing_ok=True)
            n += bool(alive)
        return n


class SampleClaims:
    """The samples still to compute in one run, claimed one at a time so concurrent workers split them.

    ``sample_id in claims`` is what the engine asks before computing a sample: True (skip it) when the sample's
    records are complete or another live worker holds its claim; otherwise this worker takes the claim
    (a file created with ``O_EXCL``; a claim of a dead process on this host is taken over) and gets False.
    :meth:`write` appends a sample's records, flags their timings ``timing_contended`` when another worker ran
    meanwhile, and releases the claim.
    """

    def __init__(self, store: RunStore, labels: set[str], worker: ActiveWorker | None = None) -> None:
        self.store, self.labels, self.worker = store, labels, worker
        self.dir = store.dir / ".claims"
        self.held: dict[str, Path] = {}
        self.contended_at_claim: dict[str, int] = {}
        self.elsewhere: set[str] = set()
        self.contended = 0
        self._done_at_start = self._complete()

    def _complete(self) -> set[str]:
        """Samples whose records cover every strategy of the run (re-read only when the file changed)."""
        try:
            st = self.store.records_path.stat()
            stamp: tuple[int, int] | None = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp is not None and stamp == getattr(self, "_stamp", None):
            return self._complete_cache
        have: dict[str, set[str]] = {}
        for r in self.store.load_records(quiet=True):
            have.setdefault(str(r.get("sample_id")), set()).add(str(r.get("strategy")))
        self._stamp, self._complete_cache = stamp, {sid for sid, got in have.items() if self.labels <= got}
        return self._complete_cache

    def __len__(self) -> int:
        return len(self._done_at_start)

    def __iter__(self) -> Iterator[str]:
        return iter(self._done_at_start)

    def _path(self, sample_id: str) -> Path:
        return self.dir / f"{slug(sample_id)}-{stable_hash(sample_id, 10)}.claim"

    def __contains__(self, sample_id: object) -> bool:
        sid = str(sample_id)
        if sid in self.held:
            return False
        if sid in self._done_at_start:
            return True
        path = self._path(sid)
        self.dir.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            if self._take(path):
                break
            if _owner_alive(path) is False or _unreadable_and_stale(path):
                path.unlink(missing_ok=True)  # a dead worker's claim: take it over
                continue
            self.elsewhere.add(sid)
            return True
        else:
            self.elsewhere.add(sid)
            return True
        # Another worker may have finished the sample between our start and this claim.
        if sid in self._complete():
            path.unlink(missing_ok=True)
            return True
        self.held[sid] = path
        self.contended_at_claim[sid] = self.worker.others() if self.worker else 0
        return False

    @staticmethod
    def _take(path: Path) -> bool:
        """Create the claim with its owner already in it, or return False when it exists. The content is written
        to a private file first and hard-linked into place (the link fails when the claim exists), so a claim is
        never seen empty: an interrupt between creating and writing would otherwise leave one no worker could
        tell from a live one."""
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(_owner()))
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: create exclusively, then write
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(_owner()))
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def write(self, records: list[dict[str, Any]]) -> None:
        ids = {str(r.get("sample_id")) for r in records}
        now = self.worker.others() if self.worker else 0
        for r in records:
            others = max(now, self.contended_at_claim.get(str(r.get("sample_id")), 0))
            r["timing_contended"] = others > 0
            r["concurrent_workers"] = others
        self.contended += sum(max(now, self.contended_at_claim.get(s, 0)) > 0 for s in ids)
        self.store.append(records)
        for sid in ids:
            self.elsewhere.discard(sid)
            path = self.held.pop(sid, None)
            if path is not None:
                path.unlink(missing_ok=True)

    def store_view(self) -> Any:
        """The run's :class:`RunStore` with ``append`` going through :meth:`write`."""
        return _ClaimingStore(self)

    def release(self) -> None:
        """Drop claims this worker still holds (an interrupted run), so others need not wait for a pid check."""
        for path in self.held.values():
            path.unlink(missing_ok=True)
        self.held.clear()


class _ClaimingStore:
    def __init__(self, claims: SampleClaims) -> None:
        self._claims = claims

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        self._claims.write(list(records))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._claims.store, name)
