"""The kernel build (``kvbench.kernels``): keyed by source content, flags and CPU. (What keeps a damaged cache —
a dead build's lock, a truncated library — from hanging or crashing a run is in ``test_integrity_kernels``.)

A tiny CPython extension stands in for the attention kernel (it compiles in a second, where torch's headers
take minutes): ``kernels.load`` treats both alike, and the build keys of the real kernels are checked directly.
"""

from __future__ import annotations

import subprocess
import sysconfig
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


def test_the_reader_parts_benchmark_ablates_only_parts_the_source_defines():
    """``scripts/bench_reader_parts.py`` builds the vector reader without each part by ``KVBENCH_ABLATE_<PART>``:
    every part it names has its switch in the source (a renamed or removed one would time the whole build under a
    part's name), and the harness's own builds define none of them."""
    import re
    import sys

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    import bench_reader_parts

    text = fused.SIMD_SOURCE.read_text()
    defined = set(re.findall(r"#if !?KVBENCH_ABLATE_([A-Z]+)", text))
    named = {p for parts in bench_reader_parts.BUILDS.values() for p in parts}
    assert named == defined == {"SCORE", "SOFTMAX", "VALUES", "PREFETCH"}
    assert bench_reader_parts.BUILDS["whole"] == ()
    assert not any("ABLATE" in flag for flag in fused.FLAGS)


def test_the_cpu_is_named_with_its_family_and_the_instruction_sets_that_pick_a_kernels_paths():
    """Benchmarks name the CPU they ran on: a VM's bare model name ("AMD EPYC" for Zen 4 and Zen 5 alike) gains
    its family and model numbers; "model" is not confused with "model name"; the first processor's fields count."""
    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu sse avx avx2 fma avx512f avx512_vnni\n\n"
            "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: Other\nflags\t\t: avx\n")
    assert kernels.describe_cpu(info) == "AMD EPYC, family 25 model 17 (avx, avx2, fma, avx512f, avx512_vnni)"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve\n"
    assert kernels.describe_cpu(arm, "aarch64") == "aarch64 (asimd, sve)"
    assert kernels.describe_cpu("", "x86_64") == "x86_64 (no vector extensions listed)"
