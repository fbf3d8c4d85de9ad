"""Integrity, fourth pass (issue 53): the kernel cache can neither hang nor crash a run.

A kill -9 during the first compile left ``kernels/.../lock``, and every later run slept on it for ever (14 min
at 0% CPU); a truncated ``.so`` with an intact header died with SIGBUS (exit 135, no message) on every run; a
corrupt ``.so`` was never rebuilt (the machine silently used the slower reader, its runs under another run id);
with ninja but no C++ compiler torch printed its banner. Now a build lock names its owner and is taken over
with one line when the owner is gone, too old, or not a lock file at all; a library is loaded only when its
SHA-256 is the one recorded when it was built, and rebuilt otherwise; every failure is one line and the caller's
PyTorch path serves. A tiny CPython extension (``test_kernels.Builder``, a second to compile) stands in for the
attention kernel, so no test here pays the real kernel's multi-minute compile.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_integrity_cache import _within
from test_kernels import Builder, _name, _source

from kvbench import kernels

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def _home(cache: Path, name: str, src: Path) -> Path:
    """The build directory ``kernels.load(name, [src], [], [])`` uses."""
    key = kernels.build_key(name, [src.read_bytes()], [], kernels.target(kernels.compiler(), []))
    return cache / f"{name}-{key}"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvbench.kernels"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------------ the lock


def _lock_of_a_fresh_build(tmp_path, cache):
    """A builder, a kernel name and source nobody has built, and where that build's lock goes (its folder made)."""
    b, name = Builder(), _name(tmp_path)
    src = _source(tmp_path / "a")
    home = _home(cache, name, src)
    home.mkdir(parents=True)
    return b, name, src, home / "lock"


@pytest.mark.parametrize("owner", ["dead", "old-other-host", "empty"])
def test_stale_lock_is_taken_over(tmp_path, cache, caplog, owner):
    """A lock left by a killed build (its pid gone, or another host's, too old to be alive) is taken over with
    one line, not waited on for ever."""
    b, name, src, lock = _lock_of_a_fresh_build(tmp_path, cache)
    home = lock.parent
    if owner == "dead":
        lock.write_text(f"{_dead_pid()} {socket.gethostname()} {time.time():.0f}\n")
    elif owner == "old-other-host":
        lock.write_text(f"1 another-host {time.time():.0f}\n")
        old = time.time() - kernels.LOCK_STALE_S - 60
        os.utime(lock, (old, old))
    else:
        lock.write_text("")
        os.utime(lock, (time.time() - 60,) * 2)
    (home / "build-999999").mkdir()  # a killed build's leftovers
    caplog.set_level(logging.WARNING, logger="kvbench.kernels")
    assert _within(60, lambda: kernels.load(name, [src], [], [], builder=b)) is not None  # today: sleeps for ever
    assert b.calls == 1
    lines = _warnings(caplog)
    assert len(lines) == 1 and "taking over the kernel build lock" in lines[0], lines
    assert not lock.exists() and not (home / "build-999999").exists()


def test_live_lock_elsewhere_is_not_stale(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text(f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n")
    assert kernels._stale(lock) is None
    lock.write_text(f"1 another-host {time.time():.0f}\n")
    assert kernels._stale(lock) is None  # another host's recent build: wait for it


@pytest.mark.parametrize("kind", ["fifo", "directory", "link"])
def test_a_lock_that_is_no_lock_file_is_taken_over(tmp_path, cache, caplog, kind):
    """A FIFO in the lock's place hung its reader; a directory could never be removed as a file, so the waiter
    looped for ever; a link is followed to whatever it names. Each is taken over, in one line."""
    b, name, src, lock = _lock_of_a_fresh_build(tmp_path, cache)
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
        (lock / "x").write_text("x")
    else:
        lock.symlink_to("/dev/zero")
    caplog.set_level(logging.WARNING, logger="kvbench.kernels")
    assert _within(60, lambda: kernels.load(name, [src], [], [], builder=b)) is not None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "taking over the kernel build lock" in lines[0] and "not a lock file" in lines[0]
    assert not os.path.lexists(lock) and b.calls == 1


def test_a_failed_build_is_one_line_and_leaves_no_lock(tmp_path, cache, caplog):
    """A build that fails (a compiler killed for memory) says so in one line and leaves nothing a later run
    would wait on or load; the next run builds."""
    name = _name(tmp_path)
    src = _source(tmp_path / "a")

    def failing(name, sources, flags, ldflags, work):
        (work / f"{name}.so").write_bytes(b"\x7fELF half")  # what a killed linker leaves
        raise RuntimeError("g++: fatal error: Killed signal terminated program cc1plus\ncompilation terminated.")

    caplog.set_level(logging.WARNING, logger="kvbench.kernels")
    assert kernels.load(name, [src], [], [], builder=failing) is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "could not be built or loaded (g++: fatal error: Killed" in lines[0], lines
    home = _home(cache, name, src)
    assert sorted(p.name for p in home.iterdir()) == []  # no lock, no work directory, no library
    caplog.clear()
    b = Builder()
    assert kernels.load(name, [src], [], [], builder=b) is not None and b.calls == 1
    assert _warnings(caplog) == []


# --------------------------------------------------------------------------------------------- the library


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no-record"])
def test_damaged_library_is_rebuilt_not_loaded(tmp_path, cache, damage):
    """A library that is not the one built (truncated with its header intact, overwritten, or without its
    recorded hash) is rebuilt before anything maps it, in one line: a run never dies of SIGBUS on it, nor
    falls back to the slower reader for good."""
    b, name = Builder(), _name(tmp_path)
    src = _source(tmp_path / "a")
    assert kernels.load(name, [src], [], [], builder=b) is not None
    (lib,) = cache.glob(f"*/{name}.so")
    data = lib.read_bytes()
    lib.unlink()  # a new file: this process has the built one mapped, and truncating it in place would kill it
    if damage == "truncated":
        lib.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        lib.write_bytes(b"\x7fELF" + b"\0" * (len(data) - 4))
    else:
        lib.write_bytes(data)
        lib.with_name(lib.name + ".sha256").unlink()
    assert not kernels.verified(lib)
    # A fresh process, as a later run would be: it must finish, with the library rebuilt.
    here, root = str(Path(__file__).parent), str(Path(__file__).parents[1])
    code = (f"import sys; sys.path[:0] = [{here!r}, {root!r}]; import test_kernels as t; "
            "from kvbench import kernels; from pathlib import Path; b = t.Builder(); "
            f"m = kernels.load({name!r}, [Path({str(src)!r})], [], [], builder=b); print(b.calls, m is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVBENCH_CACHE": str(cache.parent)})
    assert out.returncode == 0, out.stderr  # today: -7 (SIGBUS) for the truncated library
    assert out.stdout.split() == ["1", "True"]
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "rebuilding the kernel" in err[0], err
    assert kernels.verified(lib) and lib.read_bytes() == data


# ---------------------------------------------------------------------------------------------- no compiler


def test_no_compiler_is_one_line_and_the_blocks(tmp_path, cache, monkeypatch, capfd, caplog):
    """With ninja but no C++ compiler: one line, no torch banner, and attention reads blocks."""
    monkeypatch.setenv("CXX", "no-such-compiler-kvbench")
    caplog.set_level(logging.WARNING, logger="kvbench.kernels")
    assert kernels.load(_name(tmp_path), [_source(tmp_path / "a")], [], []) is None
    lines = _warnings(caplog)
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "attention reads blocks" in lines[0]
    captured = capfd.readouterr()
    assert "!!!" not in captured.err + captured.out  # torch's banner
