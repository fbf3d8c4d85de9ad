"""Bytes that decoding holds: the model's weights as the engine uses them, and a batch's decode working set.

:func:`decode_working_set` is the one place ``kvbench throughput`` (:mod:`kvbench.throughput`) asks what a
decode step of a batch of caches holds at its peak; it reads :class:`kvbench.workingset.WorkingSet`.
:func:`weight_bytes` counts the weights as the engine holds them (float32 linear copies included).

:class:`LiveBytes` (``scripts/bench_phases.py``: what each phase of a sample allocates) is a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`: every ATen op's outputs whose storage is new are counted
until the last tensor on that storage dies. Allocations inside one kernel that are freed before it returns (a
kernel's own workspace) are invisible to it, and tensors made outside dispatch too: a lower bound of the
allocator's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensors created inside the ``with`` block and alive at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[Any]] = {}  # storage data_ptr -> [bytes, tensors alive on it]

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes:
                continue
            entry = self._refs.get(key)
            if entry is None:
                if any(key == a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                       if isinstance(a, torch.Tensor)):
                    continue  # a view or in-place result on an input's storage (held before the step)
                entry = self._refs[key] = [nbytes, 0]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        return out


def unique_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied or shared weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights hold as the engine runs it: parameters and buffers, plus the float32 copies of
    ``engine.linear=float32`` (:mod:`kvbench.linear`), each storage once."""
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        fwd = m.__dict__.get("forward")
        if fwd is not None and hasattr(fwd, "weight") and isinstance(fwd.weight, torch.Tensor):
            tensors += [fwd.weight, getattr(fwd, "bias", None)]
    return unique_bytes(tensors)


def decode_working_set(model: torch.nn.Module, cache: Any, step: Callable[[], Any],
                       device: str = "cpu") -> dict[str, int]:
    """What ``cache`` (a KVBench cache, or several rows of them decoded together) holds at the peak of one decode
    ``step()`` of ``model``: the one function ``kvbench throughput`` sizes batches with.

    Read from :class:`kvbench.workingset.WorkingSet` (the record field ``working_set_bytes``): the bytes the stores
    hold (stored and scratch) as each attention module starts, plus the largest net allocation inside it (the
    attention's blocks, scores and decoded copies), the largest over the step's layers. Returns that as
    ``working_set_bytes``, beside ``kv_bytes`` and ``scratch_bytes`` before the step and ``temp_bytes``, what the
    peak adds to the bytes held at the step's start. The model's own activations outside attention (the MLP's,
    the logits) are the model's, not the cache's, and are not in it."""
    from kvbench.workingset import WorkingSet

    caches = getattr(cache, "caches", None) or [cache]
    kv = sum(c.kv_bytes() for c in caches)
    scratch = sum(c.scratch_bytes() for c in caches)
    with WorkingSet(model, cache, device) as ws:
        step()
    return {"kv_bytes": kv, "scratch_bytes": scratch, "temp_bytes": ws.transient_bytes,
            "working_set_bytes": ws.bytes}
