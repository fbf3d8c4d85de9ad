"""Device placement on CPU-only machines: every strategy runs on a *simulated accelerator*, and any tensor a
strategy creates on the host and mixes with device tensors fails the test — the bug class that crashes on CUDA
(issue 14: H2O's accumulator from ``torch.zeros`` without a device, ``random``'s scores from a CPU generator).

How the simulation works. The tiny model's weights, the token ids and everything computed from them are
:class:`OnDevice` tensors: real CPU tensors (so values, ``.item()`` and data-dependent control flow all work)
that report the ``privateuseone`` device, registered as a Python backend, so ``.device``, ``.to(x.device)``,
``torch.zeros(..., device=x.device)`` and indexing behave as on a real second device. A dispatch mode
(:class:`SimulatedDevice`) sees every aten op: an op that mixes device tensors with a host tensor of one or more
dimensions raises :class:`DeviceMixing` (CUDA accepts 0-dim host scalars and cross-device ``copy_``/``to``, so
they pass). Factory ops without a device stay on the host and are caught where they meet device tensors.

Why not the alternatives — measured on the pre-fix code (h2o / random store prefill, torch 2.13 CPU build):
on the ``meta`` device h2o stops at the first ``.item()`` (the query-position check) before reaching the bug,
and random runs clean because meta accepts the CPU scores; ``FakeTensorMode`` with a fake ``cuda`` device
fails on the first tensor indexing (a CPU-only build has no CUDA device guard) for fixed and buggy code alike,
and ``.item()`` raises ``DataDependentOutputException`` under it; a dispatch mode that flags factory ops
"without a device" cannot tell ``torch.zeros(n)`` from ``torch.zeros(n, device=x.device)`` on a CPU run (both
arrive as ``device=cpu``). This simulation fails on exactly the two bugs and passes once they are fixed.
Not covered: code behind ``device.type == "cuda"`` (tiered's pinned memory and side streams) — the simulated
device is ``privateuseone``; ``tests/test_gpu_path.py`` covers it on a real GPU.
"""

from __future__ import annotations

import pytest
import torch
from kvbench.strategies.base import RunContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.models import tiny_llama

aten = torch.ops.aten
DEVICE = torch.device("privateuseone", 0)
#: Parameters a strategy needs to fit the tiny model (head_dim 16); everything else runs at its defaults.
TINY_PARAMS: dict[str, dict] = {"quant_recompute": {"group_size": 16}}
#: Ops that legitimately move data between host and device.
CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten.to.device, aten.to.dtype_layout,
                aten.to.dtype, aten.to.other}

pytestmark = pytest.mark.usefixtures("single_torch_thread")


class DeviceMixing(AssertionError):
    """A host tensor met device tensors in one op (a crash on a real GPU)."""


class OnDevice(torch.Tensor):
    """A CPU tensor that reports the simulated device; its data lives in ``_host``."""

    _host: torch.Tensor

    @staticmethod
    def __new__(cls, host: torch.Tensor) -> OnDevice:
        t = torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(),
                                                storage_offset=host.storage_offset(), dtype=host.dtype,
                                                device=DEVICE, requires_grad=False)
        t._host = host
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self._host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})  # outside the mode too: prefetch threads do not inherit it


def _on_device(d: object) -> bool:
    return isinstance(d, torch.device) and d.type == DEVICE.type


_SHIMS = {aten._pin_memory.default: lambda t: t, aten.is_pinned.default: lambda t: False,
          aten.record_stream.default: lambda t, s: None}


def _dispatch(func, args, kwargs):
    """Run ``func`` on the host data; raise :class:`DeviceMixing` where a GPU would refuse the operands."""
    if func in _SHIMS:  # pinning and stream bookkeeping have no host equivalent
        return _SHIMS[func](*args)
    flat, spec = tree_flatten((args, kwargs))
    from_device = any(isinstance(a, OnDevice) for a in flat)
    to_device = any(_on_device(a) for a in flat)
    generator = kwargs.get("generator")
    if to_device and generator is not None and generator.device.type != DEVICE.type:
        raise DeviceMixing(f"{func}: a host random generator for a device tensor")
    host = [tuple(a.shape) for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) and a.dim()]
    if (from_device or to_device) and host and func not in CROSS_DEVICE:
        raise DeviceMixing(f"{func}: host tensors {host} mixed with device tensors")
    real = [a._host if isinstance(a, OnDevice) else torch.device("cpu") if _on_device(a) else a for a in flat]
    r_args, r_kwargs = tree_unflatten(real, spec)
    out = func(*r_args, **r_kwargs)
    if func is aten.copy_.default:
        return args[0]
    if func in CROSS_DEVICE:  # lands where its device argument says, else stays where it was
        wrap = to_device or (from_device and not any(isinstance(a, torch.device) for a in flat))
    else:
        wrap = from_device or to_device
    return tree_map(lambda t: OnDevice(t) if type(t) is torch.Tensor else t, out) if wrap else out


class SimulatedDevice(TorchDispatchMode):
    """Routes every op, including factories that name the device, through :func:`_dispatch`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


_BACKEND_READY = False


def _register_backend() -> None:
    """Register ``privateuseone`` as a Python backend once per process (it cannot be unregistered; nothing else
    in the suite uses that device): a device guard, so indexing works, and the three kernels that
    ``torch.tensor(..., device=...)`` reaches below the dispatch mode."""
    global _BACKEND_READY
    if _BACKEND_READY:
        return
    from torch.utils import backend_registration

    if not hasattr(torch, "privateuseone"):
        backend_registration._setup_privateuseone_for_python_backend()
    lib = torch.library.Library("aten", "IMPL")  # kept alive on the function below

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return OnDevice(torch.empty_strided(size, stride, dtype=dtype))

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return OnDevice(torch.empty(size, dtype=dtype))

    def copy_from(src, dst, non_blocking=False):
        (dst._host if isinstance(dst, OnDevice) else dst).copy_(src._host if isinstance(src, OnDevice) else src)
        return dst

    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    _register_backend.lib = lib  # type: ignore[attr-defined]
    _BACKEND_READY = True


@pytest.fixture(scope="module")
def device_model():
    """The tiny Llama with every weight and buffer on the simulated device (tied weights stay tied)."""
    _register_backend()
    model = tiny_llama(seed=0).eval()  # a fresh instance: the session's tiny_model stays on the host
    moved: dict[int, torch.nn.Parameter] = {}
    with SimulatedDevice():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    if id(p) not in moved:
                        moved[id(p)] = torch.nn.Parameter(OnDevice(p.data), requires_grad=False)
                    module._parameters[name] = moved[id(p)]
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = OnDevice(b)
    return model


def _run(model, strategy_name: str, params: dict | None = None, steps: int = 4) -> KVBenchCache:
    """Prefill 48 tokens and decode ``steps`` more inside ``attach``, all on the simulated device."""
    ids = OnDevice(torch.randint(1, 255, (1, 48), generator=torch.Generator().manual_seed(1)))
    strategy = strategies.build(strategy_name, {**TINY_PARAMS.get(strategy_name, {}), **(params or {})})
    with SimulatedDevice(), torch.no_grad():  # no_grad: inference tensors refuse wrapper subclasses
        strategy.bind(RunContext(model=model, prefix_ids=ids, device=str(DEVICE)))
        cache = KVBenchCache(strategy, model.config)
        with cache.attach(model):
            out = model(ids, cache=cache, use_cache=True)
            for _ in range(steps):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        held = [(type(layer.store).__name__, t.device) for layer in cache.layers for t in layer.store.tensors()]
    assert held and all(d == DEVICE for _, d in held), f"tensors held off the device: {held}"
    return cache


@pytest.mark.parametrize("name", strategies.available())
def test_every_strategy_keeps_its_tensors_on_the_device(device_model, name):
    _run(device_model, name)


@pytest.mark.parametrize("name,params", [("knorm", {"decode_evict": True}), ("random", {"decode_evict": True}),
                                         ("tova", {"per_head": True, "protect_last": True}),
                                         ("h2o", {"budget_tokens": 20}), ("h2o", {"fixed_cache": True}),
                                         ("streaming_llm", {"rerotate": True}),
                                         ("tiered", {"hot_heavy_tokens": 4, "recent_tokens": 8})])
def test_decode_time_eviction_paths_stay_on_the_device(device_model, name, params):
    _run(device_model, name, params)


def test_the_check_catches_host_tensors_and_generators():
    """The simulation must fail on exactly the two bugs of issue 14, or it proves nothing."""
    _register_backend()
    x = OnDevice(torch.ones(2, 3))
    with SimulatedDevice():
        with pytest.raises(DeviceMixing, match="add_"):
            torch.zeros(2, 3).add_(x)  # h2o's accumulator before the fix
        with pytest.raises(DeviceMixing, match="gather"):
            torch.rand(2, 3).gather(1, torch.zeros(2, 1, dtype=torch.long).to(x.device))  # random's scores
        with pytest.raises(DeviceMixing, match="generator"):
            torch.rand(3, generator=torch.Generator(), device=x.device)
        # What CUDA accepts passes: 0-dim host scalars, explicit moves, factories with the device.
        y = x * torch.tensor(2.0) + torch.ones(3).to(x.device) + torch.arange(3, device=x.device)
        assert isinstance(y, OnDevice) and y.device == DEVICE and y.sum().item() == 24.0
