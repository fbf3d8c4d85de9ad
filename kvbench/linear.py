"""``engine.linear``: the model's linear layers, on CPU, as float32 GEMMs over 16-bit weights.

On the AVX2 CPUs this harness runs on (no native bf16 instructions), PyTorch's bf16 GEMM ran at ~17 GFLOP/s
against ~98 GFLOP/s in float32 (2 threads, a 4096 x 576 x 1536 product), so a 4,096-token bf16 prefill of
SmolLM2-135M took ~52 s where the same layers computed in float32 took ~12 s (``scripts/bench_decode.py``
re-measures it). ``float32`` keeps a float32 copy of each 16-bit weight and computes ``linear(x.float(),
W32).to(x.dtype)``: products of bf16/fp16 inputs are exact in float32 and PyTorch's 16-bit CPU GEMM
accumulates in float32 too, so what changes is the order of the float32 sums (rounding-level differences
that can flip a greedy near-tie; the choice is therefore part of a run's identity, :mod:`kvbench.identity`).
The model's activations still round to its dtype after every layer, exactly as in the native path.

A single-row product (one decode step) stays native: it is bound by reading the weights, and float32
weights are twice the bytes. The float32 copies cost 4 bytes per parameter of host memory (540 MB for a
135M-parameter model); ``auto`` uses them only on CPU, for 16-bit models, and only while they take at most a
quarter of the machine's memory (``engine.linear=native`` turns them off).

``upcast`` computes float32 products without holding the copies. A product of at most
``linear_rows.max_rows()`` rows (a decode step's batch, one row included) runs in ``linear_rows.cpp``: each bf16
weight row is read once for every input row and converted in registers, so a batch of sequences reads the
weights once, as a GPU's GEMM does, where PyTorch's bf16 product on a CPU without bf16 instructions reads them
once per row. A longer product (a prefill) upcasts its weight a slice of output rows at a time (at most
:data:`UPCAST_BYTES` of float32 at once) and multiplies by it. Nothing is held beside the 16-bit weights: what a
memory budget wants (``kvbench throughput``). Its sums run in other orders than ``float32``'s: rounding-level
differences, so it is its own run identity; where the kernel cannot be built (no compiler, ``KVBENCH_FUSED=0``,
float16 weights) every product takes the slices, and the choice resolves to ``upcast-slices``, another identity.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

#: ``engine.linear`` values; ``auto`` picks per device and dtype (:func:`resolve`).
CHOICES = ("auto", "native", "float32", "upcast")
#: Products with fewer rows (tokens x batch) than this stay native (see the module docstring).
MIN_ROWS = 2
#: ``upcast``: the most float32 weight bytes one slice of a product holds (8 MiB: the MLP's matrices of a small
#: model in one or two slices, a 49K-token vocabulary's head in about ten; each slice a GEMM large enough to run at
#: the float32 rate).
UPCAST_BYTES = 8 * 2**20
ROWS_SOURCE = Path(__file__).with_name("linear_rows.cpp")
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


class _Float32Linear:
    """The bound ``forward`` of one :class:`torch.nn.Linear` whose weight is 16-bit."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        self.weight = module.weight.detach().float()
        self.bias = None if module.bias is None else module.bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if x.numel() < MIN_ROWS * m.in_features or x.dtype not in _SIXTEEN_BIT:
            return F.linear(x, m.weight, m.bias)
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


@functools.cache
def rows_kernel() -> Any | None:
    """``linear_rows.cpp``, built on first use (:mod:`kvbench.kernels`); ``None`` where it cannot be, or with
    ``KVBENCH_FUSED=0`` (the switch of every kvbench kernel, :func:`kvbench.fused.enabled`)."""
    from kvbench import fused, kernels

    if not fused.enabled():
        return None
    return kernels.load("kvbench_linear_rows", [ROWS_SOURCE], fused.FLAGS, ["-fopenmp"])


class _UpcastLinear:
    """The bound ``forward`` of one :class:`torch.nn.Linear` computed in float32 over its 16-bit weight, converted
    as it is read (``engine.linear=upcast``): a few rows by :func:`rows_kernel`, more a slice of output rows at a
    time; no float32 copy is held."""

    def __init__(self, module: torch.nn.Linear, kernel: Any | None) -> None:
        self.module = module
        self.rows = max(1, UPCAST_BYTES // (4 * module.in_features))
        self.kernel = kernel if module.weight.dtype == torch.bfloat16 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if x.dtype not in _SIXTEEN_BIT:
            return F.linear(x, m.weight, m.bias)
        rows = x.numel() // m.in_features
        if self.kernel is not None and rows <= self.kernel.max_rows() and x.is_cpu:
            out = self.kernel.linear_rows(x.reshape(rows, m.in_features).float().contiguous(),
                                          m.weight.contiguous(), m.bias)
            return out.to(x.dtype).reshape(*x.shape[:-1], m.out_features)
        if rows < MIN_ROWS:
            return F.linear(x, m.weight, m.bias)
        x32, w, b = x.float(), m.weight, m.bias
        out = x.new_empty(*x.shape[:-1], m.out_features)
        for a in range(0, m.out_features, self.rows):
            z = min(a + self.rows, m.out_features)
            out[..., a:z] = F.linear(x32, w[a:z].float(), None if b is None else b[a:z].float())
        return out


_PATHS = {"float32": _Float32Linear, "upcast": _UpcastLinear, "upcast-slices": _UpcastLinear}


def _sixteen_bit_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules()
               if type(m) is torch.nn.Linear and m.weight.dtype in _SIXTEEN_BIT)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume it does not fit
        return 0


def resolve(choice: str, device: str, model: torch.nn.Module | None = None) -> str:
    """What ``engine.linear=choice`` means for ``model`` on ``device``: ``native``, ``float32`` or ``upcast``."""
    from kvbench.errors import KVBenchError

    if choice not in CHOICES:
        raise KVBenchError(f"unknown engine.linear {choice!r}; valid: {', '.join(CHOICES)}")
    n16 = _sixteen_bit_params(model) if model is not None else 0
    if choice == "native" or n16 == 0 or torch.device(device).type != "cpu":
        return "native"  # float32 models have nothing to upcast; accelerators have 16-bit GEMMs
    if choice == "auto" and 4 * n16 * 4 > _memory_bytes():
        return "native"
    if choice == "upcast":
        return "upcast" if rows_kernel() is not None else "upcast-slices"
    return "float32"


def use(model: torch.nn.Module | None, choice: str, device: str) -> str:
    """Switch ``model``'s 16-bit linear layers to ``choice`` (resolved); return what was applied."""
    if not isinstance(model, torch.nn.Module):  # an engine over a stand-in (tests' tokenizer-only engines)
        return resolve(choice, device)
    name = resolve(choice, device, model)
    for m in model.modules():
        # Plain nn.Linear only: a subclass may return more than a tensor (Llama-4's router returns scores and
        # logits), and replacing its forward with a linear map would break the model.
        if type(m) is not torch.nn.Linear:
            continue
        path = _PATHS.get(name)
        if path is not None and m.weight.dtype in _SIXTEEN_BIT:
            current = m.__dict__.get("forward")
            if path is _Float32Linear and not isinstance(current, path):
                m.forward = _Float32Linear(m)
            elif path is _UpcastLinear:
                kernel = rows_kernel() if name == "upcast" else None
                if not (isinstance(current, path) and current.kernel is kernel):
                    m.forward = _UpcastLinear(m, kernel)
        elif isinstance(m.__dict__.get("forward"), tuple(_PATHS.values())):
            del m.forward  # back to the class's own forward
    return name
