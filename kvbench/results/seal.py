"""This machine's keyed seal for files kvbench reuses as caches (a stored baseline, a model's digest cache).

A hash written beside the data could be rewritten with it; an HMAC under a key that never leaves this machine
cannot. The key is ``cache_dir()/seal.key``.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from kvbench.results.files import TMP_SUFFIX, warn

SEAL_KEY = "seal.key"


_NOTED: set[str] = set()


def _read_key(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (None when it does not exist). Opened without blocking and
    checked before reading: a FIFO in its place would hang every run on its first read, a device feed it
    anything. Anything but a regular file is one warning (once) and no key."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        # No key there (a cache directory that is a file holds none): making one fails in silence, and the run's
        # own use of the cache says in one line what is wrong with it.
        return None
    except OSError as exc:
        raise _NotAKey(f"cannot be opened ({exc.strerror or type(exc).__name__})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotAKey("is not a regular file (a FIFO, device or directory in its place)")
        return os.read(fd, 64)
    finally:
        os.close(fd)


class _NotAKey(Exception):
    pass


def _seal_key() -> bytes | None:
    """This machine's secret for :func:`local_seal`: 32 random bytes in ``cache_dir()/seal.key`` (mode 0600),
    made on first use; None when the cache cannot hold it, or something else than a regular file is in its place
    (said once): nothing is then trusted from a cache file, and every cache is recomputed."""
    from kvbench.paths import cache_dir

    path = cache_dir() / SEAL_KEY
    for _ in range(2):
        try:
            key = _read_key(path)
        except _NotAKey as exc:
            if str(path) not in _NOTED:
                _NOTED.add(str(path))
                warn(f"{path} {exc}: no cache file is trusted (stored baselines and digests are recomputed) until "
                     "it is removed")
            return None
        if key is not None and len(key) == 32:
            return key
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
