"""Where kvbench's files live: the config tree it ships and its on-disk cache.

A leaf module (it imports nothing of kvbench but its error type), so any layer may ask for a path without
importing the layers above it: ``hardware`` reads profiles from :func:`conf_dir` without importing ``config``
(which imports the strategies), and the tiered stores spill under :func:`cache_dir` without importing models.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kvbench.errors import KVBenchError


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read a megabyte at a time (archives, checkpoints, results manifests)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def conf_dir() -> Path:
    """The config root: packaged inside the wheel, or the checkout's top-level ``conf/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise KVBenchError("kvbench's configuration directory is missing; reinstall kvbench")


#: Directories of the operating system: never a results directory (as root, ``results_dir=/etc`` would write
#: ``/etc/runs``), nor anything inside them. ``/`` itself is refused too.
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
               "/sys", "/usr")


def check_output_dir(value: object, what: str = "results_dir") -> Path:
    """``value`` as a directory kvbench may write under, taken literally: never empty, never ``/`` or a system
    directory (:data:`SYSTEM_DIRS`, symlinks resolved), and creatable (its nearest existing ancestor is a
    writable directory). Checked before anything is written; the path, else one :class:`KVBenchError` line."""
    text = "" if value is None else str(value)
    if not text.strip():
        raise KVBenchError(f"{what} is empty; give a directory ({what}=results)")
    path = Path(text).expanduser()
    resolved = path.resolve()
    system = [d for d in SYSTEM_DIRS if resolved.is_relative_to(d)]
    if system or resolved == Path("/"):
        where = f"inside the system directory {system[0]}" if system else "the root directory"
        raise KVBenchError(f"{what}={text!r} is {where}; kvbench writes its files under it — choose a directory of "
                           f"your own ({what}=results)")
    ancestor = resolved
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        why = "is not a directory" if not ancestor.is_dir() else "is not writable"
        head = f"{what}={text!r} {why}" if ancestor == resolved else \
            f"{what}={text!r} cannot be created: {ancestor} {why}"
        raise KVBenchError(f"{head}; choose a writable directory")
    return path


def os_error(exc: OSError) -> KVBenchError:
    """An operating-system error met while preparing or running a job, as one line naming the path; a path inside
    kvbench's cache names ``KVBENCH_CACHE``, the setting that moves it."""
    where = exc.filename if exc.filename is not None else ""
    why = exc.strerror or type(exc).__name__
    hint = ""
    try:
        if where and Path(os.fsdecode(where)).resolve().is_relative_to(cache_dir().resolve()):
            hint = f"; kvbench's cache is {cache_dir()}: set KVBENCH_CACHE to a writable directory"
    except (OSError, ValueError):
        pass
    return KVBenchError(f"cannot use {where} ({why}){hint}" if where else f"{why}: {exc}")


def cache_dir() -> Path:
    """Root of kvbench's on-disk cache (converted weights, corpora): ``$KVBENCH_CACHE`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench")).expanduser()
