"""The kernel build (``kvbench.kernels``): keyed by source content, flags and CPU, safe against dead lockers and
damaged files.

A tiny CPython extension stands in for the attention kernel (it compiles in a second, where torch's headers
take minutes): ``kernels.load`` treats both alike, and the build keys of the real kernels are checked directly.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from kvbench import fused, kernels

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C++ compiler")

C_SOURCE = """#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%(name)s(void) { return PyModule_Create(&def); }
"""


class Builder:
    """Compiles the tiny extension (the source file only names the module: what matters is its bytes)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, name, sources, flags, ldflags, work: Path):
        self.calls += 1
        src = work / "m.c"
        src.write_text(C_SOURCE % {"name": name})
        lib = work / f"{name}.so"
        subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(src), "-o",
                        str(lib)], check=True)
        return lib, None


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def _source(where: Path, text: str = "// kernel v1\n") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "k.cpp").write_text(text)
    return where / "k.cpp"


def _name(tmp_path: Path) -> str:  # a module name of its own per test: an extension imports once per path
    return f"kvtest_{abs(hash(str(tmp_path))) % 10**9}"


def test_wheel_and_checkout_share_one_build(tmp_path, cache):
    """The same source at two paths (an installed wheel, a checkout) is one build, loaded twice."""
    b, name = Builder(), _name(tmp_path)
    wheel = _source(tmp_path / "site-packages" / "kvbench")
    checkout = _source(tmp_path / "checkout" / "kvbench")
    assert kernels.load(name, [wheel], ["-O2"], [], builder=b) is not None
    assert kernels.load(name, [checkout], ["-O2"], [], builder=b) is not None
    assert b.calls == 1
    assert len(list(cache.iterdir())) == 1
    # The real kernels' keys too: their bytes, not their paths.
    real = fused.SOURCE.read_bytes()
    assert kernels.build_key("k", [real], fused.FLAGS, "cpu") == kernels.build_key("k", [bytes(real)], fused.FLAGS,
                                                                                   "cpu")


def test_other_source_flags_or_cpu_is_another_build(tmp_path, cache, monkeypatch):
    """A build made for other flags or another CPU's instruction sets is never loaded: each has its own key."""
    b, name = Builder(), _name(tmp_path)
    src = _source(tmp_path / "a")
    monkeypatch.setattr(kernels, "target", lambda cxx, flags: "-march=znver3 -mavx2 -mno-avx512f")
    kernels.load(name, [src], ["-O2"], [], builder=b)
    homes = set(cache.iterdir())
    monkeypatch.setattr(kernels, "target", lambda cxx, flags: "-march=sapphirerapids -mavx2 -mavx512f")
    kernels.load(name, [src], ["-O2"], [], builder=b)  # another CPU sharing the cache: its own build
    kernels.load(name, [src], ["-O3"], [], builder=b)  # other flags
    _source(tmp_path / "a", "// kernel v2\n")
    kernels.load(name, [src], ["-O3"], [], builder=b)  # another source
    assert b.calls == 4 and len(set(cache.iterdir()) - homes) == 3


def test_native_flags_are_resolved_into_the_key():
    """``-march=native`` is keyed by what it means here: the CPU's instruction-set options, not the word."""
    cxx = kernels.compiler()
    text = kernels.target(cxx, fused.FLAGS)
    if "-march=native" in text and "-mavx" not in text and "target-feature" not in text:
        pytest.skip(f"{cxx} does not expand -march=native under -###")
    assert kernels.build_key("k", [b"x"], fused.FLAGS, text) != kernels.build_key(
        "k", [b"x"], fused.FLAGS, text.replace("-mavx2", "-mno-avx2").replace("+avx2", "-avx2"))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("owner", ["dead", "old-other-host", "empty"])
def test_stale_lock_is_taken_over(tmp_path, cache, monkeypatch, caplog, owner):
    """A lock left by a killed build (its pid gone, or another host's, too old to be alive) is taken over with
    one line, not waited on forever."""
    b, name = Builder(), _name(tmp_path)
    src = _source(tmp_path / "a")
    key = kernels.build_key(name, [src.read_bytes()], [], kernels.target(kernels.compiler(), []))
    home = cache / f"{name}-{key}"
    home.mkdir(parents=True)
    lock = home / "lock"
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
    t0 = time.monotonic()
    assert kernels.load(name, [src], [], [], builder=b) is not None
    assert time.monotonic() - t0 < 30 and b.calls == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "taking over the kernel build lock" in lines[0], lines
    assert not lock.exists() and not (home / "build-999999").exists()


def test_live_lock_elsewhere_is_not_stale(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text(f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n")
    assert kernels._stale(lock) is None
    lock.write_text(f"1 another-host {time.time():.0f}\n")
    assert kernels._stale(lock) is None  # another host's recent build: wait for it


@pytest.mark.parametrize("damage", ["truncated", "garbage", "no-record"])
def test_damaged_library_is_rebuilt_not_loaded(tmp_path, cache, damage):
    """A library that is not the one built (truncated with its header intact, overwritten, or without its
    recorded hash) is rebuilt before anything maps it: a run never dies of SIGBUS on it."""
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
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]
    assert kernels.verified(lib) and lib.read_bytes() == data


def test_no_compiler_is_one_line_and_the_blocks(tmp_path, cache, monkeypatch, capfd, caplog):
    """With ninja but no C++ compiler: one line, no torch banner, and attention reads blocks."""
    monkeypatch.setenv("CXX", "no-such-compiler-kvbench")
    caplog.set_level(logging.WARNING, logger="kvbench.kernels")
    assert kernels.load(_name(tmp_path), [_source(tmp_path / "a")], [], []) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "attention reads blocks" in lines[0]
    captured = capfd.readouterr()
    assert "!!!" not in captured.err + captured.out  # torch's banner
