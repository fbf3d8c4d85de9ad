"""Writing results files safely, and the text helpers every results module shares.

One atomic write (:func:`atomic_write`: a temporary file beside the target, fsynced and renamed over it), so a
reader sees the old file or the whole new one. Files get the user's umask (not ``mkstemp``'s 0600); temporary
files a killed writer left (``.<name>.*.tmp``) are removed by the next run; a directory that cannot be written
(read-only, full disk) is one :class:`UnwritableError` line, never a traceback, and never a half-written file.
Names from configs and files are printed without control characters (:func:`printable`, :func:`warn`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.errors import KVBenchError


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


_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def safe_message(text: object) -> str:
    """An error message as printed: its lines kept, every other control character (ESC, BEL) removed, so a
    message quoting an override or a file name can never drive the terminal."""
    return _CONTROL_BUT_NEWLINE.sub("", str(text))


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
