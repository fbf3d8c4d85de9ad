"""The fused reader: attention of a short query over stored parts in one C++ pass (``fused_attend.cpp``).

:func:`kvbench.blockattn.attend` composes a step from PyTorch ops, so each block of codes is first decoded into
a float tensor and then read by a matmul: several times the bytes SDPA reads from a dense cache. This kernel
decodes each key or value row once, into a head_dim of scratch, and uses it at once for every query row of its
KV head, with flash-decoding's split over chunks of tokens merged by an online softmax. It is what decode steps
and other short queries run whenever every part can describe itself to it (:class:`Fused`); anything else (more
than :data:`MAX_ROWS` query rows per KV head, a softcap, a part with no description) goes through
``blockattn``'s blocks, which stay the reference the tests compare it with.

Two kernels read (:data:`READERS`, chosen by ``engine.reader``): ``fused`` (``fused_attend.cpp``, the first,
kept unchanged so its runs reproduce) and ``simd`` (``fused_simd.cpp``, blocks of tokens in vector registers and
integer dot products for int8 and KIVI int4 / int2 keys and values; opt-in). Each is compiled on first use by
``torch.utils.cpp_extension`` into a build keyed by its source, flags and this CPU's instruction sets
(:mod:`kvbench.kernels`). Without a compiler, with ``engine.reader=blocks`` or with ``KVBENCH_FUSED=0``, every
query goes through the blocks: same results within float rounding, slower. The vector kernel also reads a batch of
sequences' rows, each over its own parts, in one call (:func:`attend_rows`): a decode step of many sequences
otherwise pays a call, and the Python around it, per row and layer. :func:`reader` names which one a run
used (its run identity carries it), and the decode and throughput benchmarks record it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench import kernels

#: Query rows per KV head (query heads per KV head x query tokens) up to which the kernel runs. Beyond it the
#: products are matrix products, which blockattn's blocks hand to BLAS at a far higher FLOP rate.
MAX_ROWS = 32

#: Tokens per task: each (batch row, KV head, chunk) is one task with its own softmax sums, so two threads share a
#: single sequence's step; 256 tokens of one head are 16 KB of int8 keys, their scores at most 32 KB.
CHUNK_TOKENS = 256

#: Part widths the kernel reads (``Fused.bits``): dense float32, bfloat16, float16, and 8/4/2-bit codes.
DENSE_BITS = {torch.float32: 0, torch.bfloat16: 16, torch.float16: -16}
#: How codes are read (``Fused.mode``): integers, two's-complement integers, FP8 bytes (8-bit codes only).
MODES = ("unsigned", "signed", "e4m3", "e5m2")
EMPTY = torch.empty(0)


@dataclass(frozen=True)
class Fused:
    """A part as the kernel reads it: ``data`` ``[b, kv_heads, tokens, width]`` (rows contiguous), either dense
    (``bits`` from :data:`DENSE_BITS`) or codes of ``bits`` bits packed along the width, first in the low bits,
    each read as ``mode`` says (:data:`MODES`); then times ``scale`` and plus ``zero``, both ``[b or 1, kv_heads
    or 1, rows, cols]`` indexed by (token // ``tg``, channel // ``cg``) (``tg = 0``: row 0 for every token).
    Scales are float32, float16 or uint8 E8M0 exponents. ``tokens``: read only the first ``tokens`` of ``data``'s
    (``-1``: all; :meth:`upto`), for a part with reserved slots past its filled ones."""

    data: torch.Tensor
    bits: int
    mode: str = "unsigned"
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    tg: int = 1
    cg: int = 1
    tokens: int = -1

    @functools.cached_property  # asked of every part at every read; a cut (head) keeps it
    def width(self) -> int:
        """Channels per row: ``data``'s last dimension, times the codes per byte where codes are packed."""
        return int(self.data.shape[-1]) * (8 // self.bits if self.bits in (2, 4) else 1)

    def head(self, tokens: int, data: torch.Tensor | None = None) -> Fused | None:
        """The part's first ``tokens`` tokens: ``data`` and per-token sides (``tg = 1``) cut, shared sides (``tg =
        0``) kept; ``None`` for sides by groups of tokens. ``data``: that cut of ``data`` where the caller made it."""
        if self.tg not in (0, 1):
            return None
        # Made without the dataclass's __init__ (a decode step cuts two descriptions per layer and sequence):
        # this part's fields, data and per-token sides cut.
        self.width  # noqa: B018 -- cached here first, so every cut carries it rather than working it out again
        part = object.__new__(Fused)
        fields = part.__dict__
        fields.update(self.__dict__)
        fields["data"] = self.data.narrow(2, 0, tokens) if data is None else data
        fields["tokens"] = -1
        if self.tg == 1:
            for side in ("scale", "zero"):
                if fields[side] is not None:
                    fields[side] = fields[side].narrow(2, 0, tokens)
        return part

    def upto(self, tokens: int) -> Fused:
        """This part read up to its first ``tokens`` (a store's open tail: its reserve, filled that far), without a
        cut of its tensors: :func:`attend_rows` tells the kernel the count; :func:`attend` cuts it (:meth:`head`)."""
        self.width  # noqa: B018 -- cached first, as in head
        part = object.__new__(Fused)
        part.__dict__.update(self.__dict__)
        part.__dict__["tokens"] = tokens
        return part

    def cut(self) -> Fused | None:
        """The part with ``tokens`` applied to its tensors (itself where it reads all its data holds)."""
        return self if self.tokens < 0 else self.head(self.tokens)

    def flat(self) -> tuple[list[torch.Tensor], list[int]]:
        tensors = [self.data, EMPTY if self.scale is None else self.scale, EMPTY if self.zero is None else self.zero]
        return tensors, [self.bits, MODES.index(self.mode), self.tg, self.cg]


def flatten(parts: list[Fused]) -> tuple[list[torch.Tensor], list[int]]:
    """Parts as the kernel's ``attend`` takes them: every part's tensors, then every part's integers, in order."""
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for p in parts:
        t, i = p.flat()
        tensors += t
        ints += i
    return tensors, ints


def dense(x: torch.Tensor) -> Fused | None:
    """A dense ``[b, h, tokens, d]`` tensor as a part (``None`` for a dtype or layout the kernel does not read)."""
    bits = DENSE_BITS.get(x.dtype)
    if bits is None or x.dim() != 4 or (x.shape[-2] and x.stride(-1) != 1):
        return None
    return Fused(x, bits)


#: The readers a run chooses from (``engine.reader``), each with the name its runs carry (the determinant
#: ``attention_reader``; the blocks' runs carry none, as before any kernel existed). ``fused`` is the first kernel
#: (``fused_attend.cpp``: one row decoded into scratch, a scalar score and exponential per token), kept unchanged
#: so the runs made with it reproduce; ``simd`` (``fused_simd.cpp``) scores blocks of tokens in vector registers,
#: int8 and packed keys by integer dot products against a quantized query.
READERS = {"simd": "fused-simd", "fused": "fused", "blocks": "blocks"}
#: What ``engine.reader=auto`` (and a process that chooses nothing) reads with: the first kernel, until the vector one
#: meets issue 50's targets (docs/throughput.md), so runs in progress keep their identity.
DEFAULT_READER = "fused"
CHOICES = ("auto", *READERS)
#: Every kernel's flags: the build is keyed by what ``-march=native`` means on the CPU at hand (kvbench.kernels).
FLAGS = ["-O3", "-march=native", "-fopenmp"]
SOURCE = Path(__file__).with_name("fused_attend.cpp")
SIMD_SOURCE = Path(__file__).with_name("fused_simd.cpp")

_chosen = DEFAULT_READER


def choose(reader: str) -> str:
    """Read with ``reader`` (:data:`CHOICES`) in this process from now on; returns the resolved choice."""
    if reader not in CHOICES:
        raise ValueError(f"unknown engine.reader {reader!r}; valid: {', '.join(CHOICES)}")
    global _chosen
    _chosen = DEFAULT_READER if reader == "auto" else reader
    return _chosen


def enabled() -> bool:
    return os.environ.get("KVBENCH_FUSED", "1") != "0"


@functools.cache
def _module() -> Any | None:
    """The first kernel (also the native quantizers), built on first use; ``None`` (logged once) where it cannot
    be built or loaded."""
    return kernels.load("kvbench_fused_attend", [SOURCE], FLAGS, ["-fopenmp"])


@functools.cache
def _simd() -> Any | None:
    """The vector kernel (it includes the first one's format decoders, so both sources key its build)."""
    return kernels.load("kvbench_fused_simd", [SIMD_SOURCE], FLAGS, ["-fopenmp"], includes=[SOURCE])


def _kernel() -> Any | None:
    """The module whose ``attend`` reads attention for the chosen reader, or ``None`` (blocks)."""
    if not enabled() or _chosen == "blocks":
        return None
    return _simd() if _chosen == "simd" else _module()


def native() -> Any | None:
    """The compiled module where it is built and enabled (its ops are bit-identical to the PyTorch ones they
    replace: tests/test_fused.py), else ``None``."""
    return _module() if enabled() else None


def rows_native() -> Any | None:
    """The chosen reader's module where it also encodes a batch of sequences' tokens in one call (the vector
    kernel's ``quantize_int8_token_rows_into``), else ``None``: each row then writes through :func:`native`."""
    mod = _kernel()
    return mod if mod is not None and hasattr(mod, "quantize_int8_token_rows_into") else None


def available() -> bool:
    """Whether the chosen reader's kernel is built (building it now if needed) and enabled."""
    return _kernel() is not None


def reader() -> str:
    """What reads a compressed cache in this process: ``"fused-simd"``, ``"fused"`` or ``"blocks"``."""
    return READERS[_chosen] if available() else "blocks"


def attend(qg: torch.Tensor, keys: list[Fused], values: list[Fused], mask: torch.Tensor | None,
           q_len: int, scaling: float) -> torch.Tensor | None:
    """``[b, kv_heads, rows, d]`` float32 attention of the grouped query ``qg`` (rows ``g * q_len``, float32 on
    CPU) over the parts, or ``None`` where the kernel does not apply (then the caller reads blocks).

    ``mask``: ``None``, or boolean / additive, viewable as ``[b or 1, kv_heads or 1, g or 1, q_len, tokens]``
    (``blockattn.grouped_mask``'s layout).
    """
    if not (qg.is_cpu and qg.dtype == torch.float32 and qg.shape[-2] <= MAX_ROWS
            and qg.shape[-1] <= 512 and qg.shape[-1] % 4 == 0):  # head_dim: the kernel's row scratch
        return None
    # The kernel reads every key and value row at the query's width: value heads narrower than query/key heads
    # (MiMo-V2-Flash's 192/128) are read by the blocks.
    if any(p.width != qg.shape[-1] for p in (*keys, *values)):
        return None
    mod = _kernel()
    if mod is None:
        return None
    if any(p.tokens >= 0 for p in (*keys, *values)):  # its ``attend`` reads all a part's data holds
        cut = [p.cut() for p in (*keys, *values)]
        if any(p is None for p in cut):
            return None
        keys, values = cut[:len(keys)], cut[len(keys):]  # type: ignore[assignment]
    kt, ki = flatten(keys)
    vt, vi = flatten(values)
    m = EMPTY
    if mask is not None:
        m = torch.where(mask, 0.0, float("-inf")) if mask.dtype == torch.bool else mask.float()
    return mod.attend(qg.contiguous(), kt, ki, vt, vi, m, q_len, scaling, CHUNK_TOKENS)


def attend_rows(qg: torch.Tensor, keys: list[list[Fused]], values: list[list[Fused]], q_len: int,
                scaling: float) -> torch.Tensor | None:
    """:func:`attend` for several sequences decoding together, row ``r`` of ``qg`` over its own parts ``keys[r]``
    and ``values[r]`` (each of batch 1), unmasked, in one call: row ``r``'s result is what :func:`attend` gives for
    it alone, bit for bit. ``None`` where that one call does not apply (a reader without it: the first kernel, kept
    as its runs made it; see :func:`attend`'s other conditions), and the caller reads row by row."""
    if not (qg.is_cpu and qg.dtype == torch.float32 and qg.shape[-2] <= MAX_ROWS
            and qg.shape[-1] <= 512 and qg.shape[-1] % 4 == 0):
        return None
    width = qg.shape[-1]
    if any(p.width != width or p.data.shape[0] != 1 for row in (*keys, *values) for p in row):
        return None
    mod = _kernel()
    if mod is None or not hasattr(mod, "attend_rows"):
        return None
    kp = [p for row in keys for p in row]
    vp = [p for row in values for p in row]
    kt, ki = flatten(kp)
    vt, vi = flatten(vp)
    return mod.attend_rows(qg.contiguous(), kt, ki, vt, vi, [len(r) for r in keys], [len(r) for r in values],
                           [p.tokens for p in kp], [p.tokens for p in vp], q_len, scaling, CHUNK_TOKENS)
