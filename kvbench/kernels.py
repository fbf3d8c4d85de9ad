"""Compiled kernels: one build per (source content, compiler flags, instruction sets), shared by every install.

A kernel compiled with ``-march=native`` runs only on CPUs with the instructions of the one that built it, so a
cache shared by machines with different CPUs (a cluster's home directory) must not hand one machine another's
build. Each build therefore lives in ``$KVBENCH_CACHE/kernels/<name>-<key>``, where the key hashes the sources'
bytes, the flags, what the compiler resolves those flags to on this machine (``-march=native`` expanded into the
``-m`` options of every instruction set it enables, read from ``c++ -###``), the compiler, torch and Python: a
wheel and a checkout with the same source share one build, and a CPU with other instruction sets gets its own.

A build cannot hang or crash later runs:

* it is built into a private directory and renamed into place only when complete, with the SHA-256 of the
  library beside it; a library whose hash does not match (truncated, corrupted) is rebuilt, never loaded (a
  truncated shared object can die with SIGBUS while being mapped);
* the build lock names its owner (pid, host, time); a lock whose process is gone, or older than
  :data:`LOCK_STALE_S`, or something other than a lock file in its place (a directory, link or FIFO, which a
  reader would wait on for ever), is taken over with one line.

Where no compiler is found, or the build or the load fails, :func:`load` says so in one line and returns
``None``; the caller falls back to its PyTorch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvbench.paths import cache_dir

log = logging.getLogger(__name__)

#: A lock older than this is taken over even when its owner cannot be checked (another host): a first build
#: took up to 7 minutes on a loaded 2-core machine.
LOCK_STALE_S = 30 * 60
#: How often a process waiting for another's build looks again.
POLL_S = 0.5


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would use (``$CXX`` or ``c++``), if it is on ``PATH``."""
    cxx = os.environ.get("CXX", "c++")
    return cxx if shutil.which(cxx) else None


def target(cxx: str, flags: Sequence[str]) -> str:
    """What ``flags`` mean to ``cxx`` on this machine: the compiler's own command line for them (``-###``), where
    ``-march=native`` appears expanded into the CPU's name and every ``-m`` instruction-set option."""
    out = subprocess.run([cxx, *flags, "-###", "-E", "-x", "c++", os.devnull], capture_output=True, text=True,
                         timeout=60)
    return out.stderr + out.stdout


def build_key(name: str, sources: Sequence[bytes], flags: Sequence[str], target_text: str) -> str:
    """The key of a build: the sources' bytes (not their paths: every install of one source shares a build),
    the flags and their meaning here, torch and the Python ABI."""
    import torch

    h = hashlib.sha256()
    for part in (name, *flags, target_text, torch.__version__, sys.version, sys.implementation.cache_tag or ""):
        h.update(part.encode() + b"\0")
    for src in sources:
        h.update(hashlib.sha256(src).digest())
    return h.hexdigest()[:20]


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verified(lib: Path) -> bool:
    """Whether ``lib`` is a complete build: a regular file whose SHA-256 is the one recorded when it was built."""
    record = lib.with_name(lib.name + ".sha256")
    try:
        if not (lib.is_file() and record.is_file()) or lib.is_symlink() or record.is_symlink():
            return False
        return record.read_text().strip() == _digest(lib)
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _owner(lock: Path) -> list[str]:
    """The words of ``lock`` (pid, host, time), ``[]`` when they cannot be read. Opened without blocking or
    following a link, and read only when it is a regular file: nothing in its place can hang the reader."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        return os.read(fd, 256).decode(errors="replace").split() if stat.S_ISREG(os.fstat(fd).st_mode) else []
    except OSError:
        return []
    finally:
        os.close(fd)


def _stale(lock: Path) -> str | None:
    """Why ``lock`` is stale (its owner is dead, it is too old, or it is no lock file at all), or ``None`` while
    its owner may be building."""
    try:
        st = lock.lstat()
    except FileNotFoundError:
        return None  # gone meanwhile: look again
    if not stat.S_ISREG(st.st_mode):  # no build makes one, and waiting on it would never end
        return "it is not a lock file: a directory, link or FIFO in its place"
    owner, age = _owner(lock), time.time() - st.st_mtime
    if len(owner) >= 2 and owner[1] == socket.gethostname() and owner[0].isdigit() and not _alive(int(owner[0])):
        return f"its owner, pid {owner[0]} on {owner[1]}, is gone"
    if age > LOCK_STALE_S:
        who = f"pid {owner[0]} on {owner[1]}" if len(owner) >= 2 else "an unknown owner"
        return f"held by {who} for {age / 60:.0f} min"
    if len(owner) < 2 and age > 10:  # killed between creating and writing it, or unreadable
        return "it names no owner"
    return None


def _remove(lock: Path) -> None:
    """Remove a stale lock, whatever is in its place (a directory too); already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        if lock.is_dir() and not lock.is_symlink():
            shutil.rmtree(lock)
        else:
            lock.unlink()


@contextlib.contextmanager
def build_lock(lock: Path, ready: Callable[[], bool]) -> Iterator[bool]:
    """Hold ``lock`` (yields True), or wait until ``ready()`` says another process finished the build (yields
    False). A stale lock is taken over with one line."""
    me = f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n"
    while True:
        if ready():
            yield False
            return
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            why = _stale(lock)
            if why:
                log.warning("kvbench: taking over the kernel build lock %s (%s)", lock, why)
                _remove(lock)  # one that cannot be removed ends the build in load()'s one line, never a loop
                continue
            time.sleep(POLL_S)
            continue
        try:
            os.write(fd, me.encode())
        finally:
            os.close(fd)
        try:
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        return


def _import(name: str, lib: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def library(module: Any) -> Path:
    """The file a kernel module returned by :func:`load` lives in now: one built in this process was imported from
    its build folder, which :func:`load` then moved up into the cache (and removed)."""
    lib = Path(module.__file__)
    return lib if lib.exists() else lib.parent.parent / lib.name


def _build(name: str, sources: Sequence[Path], flags: list[str], ldflags: list[str], work: Path) -> tuple[Path, Any]:
    """Compile into ``work`` with torch's extension builder; returns the library it wrote and the module (torch
    imports what it builds)."""
    from torch.utils.cpp_extension import load

    with warnings.catch_warnings():  # torch's compiler banners: a failure below is reported in one line
        warnings.simplefilter("ignore")
        module = load(name=name, sources=[str(s) for s in sources], build_directory=str(work), extra_cflags=flags,
                      extra_ldflags=ldflags, verbose=False)
    return work / f"{name}.so", module


def load(name: str, sources: Sequence[Path], flags: list[str], ldflags: list[str], *,
         includes: Sequence[Path] = (),
         builder: Callable[[str, Sequence[Path], list[str], list[str], Path], tuple[Path, Any]] = _build,
         ) -> Any | None:
    """The compiled module ``name`` of ``sources`` (the first defines the module; ``includes``: files they include,
    keyed but not compiled on their own), built on first use into the shared cache; ``None``, with one logged
    line, where it cannot be built or loaded. ``builder`` compiles into a given directory and returns the library
    and the module if it imported it (torch's extension builder unless a test gives another)."""
    try:
        cxx = compiler()
        if cxx is None:
            raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
        texts = [Path(s).read_bytes() for s in (*sources, *includes)]
        key = build_key(name, texts, flags + ldflags, target(cxx, flags))
        home = cache_dir() / "kernels" / f"{name}-{key}"
        home.mkdir(parents=True, exist_ok=True)
        lib = home / f"{name}.so"
        if verified(lib):
            return _import(name, lib)
        module = None
        with build_lock(home / "lock", lambda: verified(lib)) as mine:
            if mine:
                for old in home.glob("build-*"):  # left by killed builds
                    shutil.rmtree(old, ignore_errors=True)
                work = home / f"build-{os.getpid()}"
                work.mkdir()
                try:
                    built, module = builder(name, sources, flags, ldflags, work)
                    digest = _digest(built)
                    if lib.exists():
                        log.warning("kvbench: rebuilding the kernel %s (the file did not match its recorded hash)",
                                    lib)
                    os.replace(built, lib)  # complete before it appears under its name
                    record = home / f"{lib.name}.sha256.{os.getpid()}"
                    record.write_text(digest + "\n")
                    os.replace(record, lib.with_name(lib.name + ".sha256"))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        if not verified(lib):
            raise RuntimeError(f"{lib} does not match its recorded hash after the build")
        return module if module is not None else _import(name, lib)  # imported once: its file was renamed
    except Exception as exc:  # no compiler, no headers, a failed build or load: the caller's PyTorch path serves
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        log.warning("kvbench: the %s kernel could not be built or loaded (%s); attention reads blocks", name, first)
        return None


#: The instruction sets that decide which of a kernel's paths a build takes (as /proc/cpuinfo names them).
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_description() -> str:
    """The CPU as benchmarks name it: its model name, its family and model numbers where /proc/cpuinfo gives them
    (a VM's model name can be as bare as "AMD EPYC", which covers Zen 4 and Zen 5 alike), and which of
    :data:`ISA_FLAGS` it has (Linux; elsewhere the platform's processor string)."""
    import platform

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    return describe_cpu(info, platform.machine())


def describe_cpu(info: str, machine: str = "") -> str:
    """:func:`cpu_description` of a /proc/cpuinfo text (its first processor's fields)."""
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's
            fields[key.strip()] = value.strip()
    name = fields.get("model name", machine)
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return f"{name} ({', '.join(f for f in ISA_FLAGS if f in flags) or 'no vector extensions listed'})"
