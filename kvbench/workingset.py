"""The decode working set of a cache, measured while decoding: what the cache really occupies at the moment it is read.

``kv_bytes`` counts what a store holds between steps. While a step attends, a store may hold more: a dequantized
working copy (``scratch_bytes``), a dense copy decoded for the attention, the blocks and scores of the attention
itself. :class:`WorkingSet` measures one forward (one decode step) over a kvbench cache:

    with WorkingSet(model, cache, device) as ws:
        model(input_ids=..., cache=cache)
    ws.bytes    # held at the step's start + the peak of what was allocated and not yet freed, inside attention

* As each layer's attention module starts (its K/V update included), the bytes the cache holds then: the distinct
  storages of every store's tensors and scratch tensors (:func:`strategies.base.held_bytes`), i.e. ``kv_bytes``
  plus ``scratch_bytes`` at that moment;
* plus the largest net allocation (bytes allocated minus bytes freed) while that module runs: the attention's
  blocks, scores, decoded copies, a store's re-allocations. On CPU it is read from ``torch.profiler``'s memory
  events (each allocation and free of PyTorch's CPU allocator, with its time), the module's span marked by a
  ``record_function`` range; on CUDA from the allocator's peak, reset as the module starts.

``bytes``, the record's ``working_set_bytes``, is the largest sum over the step's attention modules (and at least
what was held at the step's start, ``held_bytes``). Outside attention a decode step holds the model's own
activations (MLP, logits), which belong to the model, not the cache.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from kvbench.strategies.base import held_bytes

WINDOW = "kvbench.attention"

# What PyTorch's CPU profiler (kineto) writes to the process's stderr on every start and stop, whatever its log
# level, and the allocator's note that frees of older blocks are not seen (the bias the docstring of
# :func:`_window_peaks` states). Neither is news to a user; every other line written meanwhile is passed on.
_PROFILER_NOISE = re.compile(r"^(USDT|STAGE):.*SyncActivityProfilerHandler|^\[W.*CPUAllocator\.cpp.*unknown size")


@contextlib.contextmanager
def _profiler_quiet() -> Iterator[None]:
    """Hold file descriptor 2 in a temporary file while the profiler runs, then replay all but its noise."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # stderr replaced (pytest's capture, a notebook): nothing to do
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not _PROFILER_NOISE.search(line):
                    sys.stderr.write(line)
            sys.stderr.flush()


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor and scratch tensor of the stores of a ``KVBenchCache`` or ``RowsCache``."""
    caches = getattr(cache, "caches", None) or [cache]
    out: list[torch.Tensor] = []
    for c in caches:
        for layer in c.layers:
            store = getattr(layer, "store", None)
            if store is None:  # a hybrid's recurrent layer: transformers' own state, not a store's
                continue
            out.extend(store.tensors())
            out.extend(store.scratch_tensors())
    return out


class WorkingSet:
    """Measure one forward's decode working set of ``cache`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: Any, device: str | torch.device = "cpu") -> None:
        self.model, self.cache = model, cache
        self.cuda = torch.device(device).type == "cuda"
        self.held_bytes = 0  # held at the step's start
        self.bytes = 0
        self._held: list[int] = []  # held as each attention module starts, in call order
        self._peaks: list[int] = []  # CUDA: net allocation peak inside each attention module
        self._base: list[int] = []
        self._hooks: list[Any] = []
        self._ranges: dict[int, list[Any]] = {}  # per module: a model run inside attention (a recompute) nests
        self._prof: Any = None
        self._quiet: Any = None
        self._gc = True

    @property
    def transient_bytes(self) -> int:
        """What the peak adds to the bytes held at the step's start."""
        return self.bytes - self.held_bytes

    def _enter_attention(self, module: torch.nn.Module, *_: Any) -> None:
        self._held.append(held_bytes(cache_tensors(self.cache)))
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base.append(int(torch.cuda.memory_allocated()))
        else:
            rf = torch.autograd.profiler.record_function(WINDOW)
            rf.__enter__()
            self._ranges.setdefault(id(module), []).append(rf)

    def _leave_attention(self, module: torch.nn.Module, *_: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            i = len(self._peaks)
            self._peaks.append(max(0, int(torch.cuda.max_memory_allocated()) - self._base[i]))
        else:
            self._ranges[id(module)].pop().__exit__(None, None, None)

    def __enter__(self) -> WorkingSet:
        from kvbench.arch import attention_modules

        # Garbage from before (an earlier cache's reference cycles) freed during the step would count as this
        # cache's frees: collected now, and no collection while measuring.
        gc.collect()
        self._gc = gc.isenabled()
        gc.disable()
        self.held_bytes = held_bytes(cache_tensors(self.cache))
        for m in attention_modules(self.model):
            self._hooks.append(m.register_forward_pre_hook(self._enter_attention))
            self._hooks.append(m.register_forward_hook(self._leave_attention))
        if not self.cuda:
            from torch.profiler import ProfilerActivity, profile

            self._quiet = _profiler_quiet()
            self._quiet.__enter__()
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._gc:
            gc.enable()
        if self._prof is not None:
            try:
                self._prof.__exit__(*exc)
            finally:
                self._quiet.__exit__(None, None, None)
            if exc[0] is None:
                self._peaks = _window_peaks(self._prof.profiler.kineto_results.events())
            self._prof = None
        if exc[0] is None:
            assert len(self._peaks) == len(self._held), (len(self._peaks), len(self._held))
            self.bytes = max([self.held_bytes, *(h + p for h, p in zip(self._held, self._peaks, strict=True))])


def _window_peaks(events: list[Any]) -> list[int]:
    """Per :data:`WINDOW` range, in start order: the largest net allocation (``[memory]`` events, allocations
    minus frees) since the range began, at any time inside it.

    PyTorch's CPU profiler drops the frees of blocks allocated before it started (a store's old residual that a
    step replaces): such a free inside a range is missed, so the figure errs high, by at most what one attention
    call replaces; never low."""
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in mem]
    running, total = [], 0
    for _, n in mem:
        total += n
        running.append(total)
    out = []
    for lo, hi in sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == WINDOW):
        i, j = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi)
        at_start = running[i - 1] if i > 0 else 0
        out.append(max(0, max(running[i:j], default=at_start) - at_start))
    return out
