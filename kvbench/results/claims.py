"""The claims and workers protocol: concurrent workers split one run's samples and say when they competed.

A worker registers in ``results_dir/.workers`` while it measures (:class:`ActiveWorker`); it claims each sample
before computing it (``runs/<run-id>/.claims``, :class:`SampleClaims`). A claim or worker file names its owner
(host, pid and where that pid can be checked); one of a dead process is taken over. A live worker refreshes its
files every :data:`HEARTBEAT_SECONDS`, so a file whose pid cannot be checked from here (another host, another
container under the same host name) and that nobody refreshed for :data:`OWNER_EXPIRY_SECONDS` expires, with
one line naming its host: a container that was thrown away never holds a sample, nor marks every later timing
contended, for ever.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvbench.results.files import atomic_write_text, printable, slug, stable_hash, warn
from kvbench.results.store import RunStore


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


#: A live worker touches its worker file and every claim it holds this often (a background thread)...
HEARTBEAT_SECONDS = 30.0
#: ...so a file whose owner cannot be checked from here and that nobody touched for this long has nobody behind it.
OWNER_EXPIRY_SECONDS = 600.0
_EXPIRED_NOTED: set[tuple[str, str]] = set()


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_scope": _pid_scope(), "started": time.time(),
            "heartbeat_s": HEARTBEAT_SECONDS}


def _read_owner(path: Path) -> Any:
    """The JSON in a claim or worker file. Opened without blocking or following a link and read only when it is a
    regular file (OSError otherwise): a FIFO in its place would hang every worker that looks at it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return json.loads(os.read(fd, 1 << 16))
    finally:
        os.close(fd)


def owner_of(path: Path) -> str:
    """``host 'h' (pid p)`` of a claim or worker file, for messages; ``an unknown owner`` when unreadable."""
    try:
        owner = _read_owner(path)
        return f"host {printable(owner['host'])!r} (pid {int(owner['pid'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return "an unknown owner"


def _owner_alive(path: Path) -> bool | None:
    """True/False for a claim or worker file of a live/dead process; None when unreadable or missing. A process
    of this host and pid namespace is checked by its pid; one written elsewhere (another host, or another
    container under this host name, whose pid means nothing here) is alive while its owner refreshes the file,
    and expires once nobody has for :data:`OWNER_EXPIRY_SECONDS` — said once per file kind and owner, in one
    line naming the host."""
    try:
        owner = _read_owner(path)
        host, pid = owner["host"], int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname() and owner.get("pid_scope", _pid_scope()) == _pid_scope():
        return _pid_alive(pid)
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    if age <= OWNER_EXPIRY_SECONDS:
        return True
    kind = "claim" if path.suffix == ".claim" else "worker file"
    if (kind, owner_of(path)) not in _EXPIRED_NOTED:
        _EXPIRED_NOTED.add((kind, owner_of(path)))
        warn(f"took over the {kind}(s) of {owner_of(path)} in {path.parent}: not refreshed for {age / 60:.0f} min "
             f"(a live worker refreshes them every {HEARTBEAT_SECONDS:.0f} s; its pid cannot be checked from this "
             "host), so nobody is behind it")
    return False


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
        # The pid namespace in the name too: two containers under one host name may both run pid 57.
        self.path = self.dir / f"{slug(socket.gethostname())}-{os.getpid()}-{stable_hash(_pid_scope(), 8)}.json"
        #: Files this worker keeps fresh besides its own (the claims it holds: :class:`SampleClaims` adds them).
        self.fresh: set[Path] = set()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> ActiveWorker:
        atomic_write_text(self.path, json.dumps(_owner()))
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="kvbench-heartbeat", daemon=True)
        self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        self.path.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        """Touch this worker's file and its claims every :data:`HEARTBEAT_SECONDS` while it lives."""
        while not self._stop.wait(HEARTBEAT_SECONDS):
            self.touch()

    def touch(self) -> None:
        for p in [self.path, *list(self.fresh)]:
            with contextlib.suppress(OSError):  # a claim released meanwhile
                os.utime(p)

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
        #: Who holds each sample in :attr:`elsewhere` (``host 'h' (pid p)``), for the run's last line.
        self.held_by: dict[str, str] = {}
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
            self.held_by[sid] = owner_of(path)
            return True
        else:
            self.elsewhere.add(sid)
            self.held_by[sid] = owner_of(path)
            return True
        # Another worker may have finished the sample between our start and this claim.
        if sid in self._complete():
            path.unlink(missing_ok=True)
            return True
        self.held[sid] = path
        if self.worker:
            self.worker.fresh.add(path)
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
                self._drop(path)

    def store_view(self) -> Any:
        """The run's :class:`RunStore` with ``append`` going through :meth:`write`."""
        return _ClaimingStore(self)

    def release(self) -> None:
        """Drop claims this worker still holds (an interrupted run), so others need not wait for a pid check."""
        for path in self.held.values():
            self._drop(path)
        self.held.clear()

    def _drop(self, path: Path) -> None:
        if self.worker:
            self.worker.fresh.discard(path)
        path.unlink(missing_ok=True)


class _ClaimingStore:
    def __init__(self, claims: SampleClaims) -> None:
        self._claims = claims

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        self._claims.write(list(records))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._claims.store, name)
