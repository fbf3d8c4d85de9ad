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
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

#: ``engine.linear`` values; ``auto`` picks per device and dtype (:func:`resolve`).
CHOICES = ("auto", "native", "float32")
#: Products with fewer rows (tokens x batch) than this stay native (see the module docstring).
MIN_ROWS = 2
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


def _sixteen_bit_params(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules()
               if type(m) is torch.nn.Linear and m.weight.dtype in _SIXTEEN_BIT)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume it does not fit
        return 0


def resolve(choice: str, device: str, model: torch.nn.Module | None = None) -> str:
    """What ``engine.linear=choice`` means for ``model`` on ``device``: ``native`` or ``float32``."""
    from kvbench.errors import KVBenchError

    if choice not in CHOICES:
        raise KVBenchError(f"unknown engine.linear {choice!r}; valid: {', '.join(CHOICES)}")
    n16 = _sixteen_bit_params(model) if model is not None else 0
    if choice == "native" or n16 == 0 or torch.device(device).type != "cpu":
        return "native"  # float32 models have nothing to upcast; accelerators have 16-bit GEMMs
    if choice == "auto" and 4 * n16 * 4 > _memory_bytes():
        return "native"
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
        if name == "float32" and m.weight.dtype in _SIXTEEN_BIT:
            if not isinstance(m.__dict__.get("forward"), _Float32Linear):
                m.forward = _Float32Linear(m)
        elif isinstance(m.__dict__.get("forward"), _Float32Linear):
            del m.forward  # back to the class's own forward
    return name
