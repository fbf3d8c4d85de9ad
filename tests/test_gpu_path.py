"""The GPU path: what can be exercised on CPU runs everywhere; CUDA-only checks skip cleanly without a GPU.

Every registered strategy runs on CUDA here; ``tests/test_device_placement.py`` runs the same strategies on a
simulated device on CPU-only machines, so host/device mixing is caught without a GPU too."""

from __future__ import annotations

import pytest
import torch
from kvbench.strategies.base import RunContext
from omegaconf import OmegaConf

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.config import conf_dir
from kvbench.errors import KVBenchError
from kvbench.hardware import HardwareProfile, check_available
from kvbench.spec import PeakMemory, Timer

#: Parameters a strategy needs to fit the tiny model (head_dim 16); the rest run at their defaults.
TINY_PARAMS: dict[str, dict] = {"quant_recompute": {"group_size": 16}}

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["consumer-gpu-24g", "server-gpu-80g"])
def test_gpu_profiles_fail_clearly_or_simulate(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml")
    profile = HardwareProfile.from_config(cfg)
    assert profile.device == "cuda" and profile.dtype in ("bfloat16", "float16")
    with pytest.raises(KVBenchError, match="simulate=true"):
        check_available(profile)
    cfg.simulate = True
    assert check_available(HardwareProfile.from_config(cfg)) == "cpu"


def test_cpu_timer_and_peak_memory_do_not_touch_cuda(monkeypatch):
    def boom() -> None:
        raise AssertionError("CUDA synchronisation on a CPU run")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    with Timer("cpu") as t, PeakMemory("cpu") as m:
        torch.ones(1000).sum()
    assert t.seconds >= 0 and m.peak_bytes > 0


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", strategies.available())
def test_strategies_run_on_cuda(tiny_model, tiny_ids, name):
    model = tiny_model.to("cuda", torch.bfloat16)
    ids = tiny_ids.cuda()
    try:
        strategy = strategies.build(name, TINY_PARAMS.get(name))
        strategy.bind(RunContext(model=model, prefix_ids=ids, device="cuda"))
        cache = KVBenchCache(strategy, model.config)
        with torch.inference_mode(), cache.attach(model):
            out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
        assert out.shape[1] == ids.shape[1] + 8
        assert all(t.is_cuda for layer in cache.layers for t in layer.store.tensors())
    finally:
        tiny_model.to("cpu", torch.float32)


@cuda
@pytest.mark.cuda
def test_cuda_peak_memory_sees_an_allocation():
    with Timer("cuda") as t, PeakMemory("cuda") as m:
        x = torch.ones(64 * 2**20 // 4, device="cuda")
        del x
    assert m.peak_bytes >= 64 * 2**20 and t.seconds > 0
