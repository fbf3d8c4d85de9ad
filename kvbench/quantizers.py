"""Low-level K/V quantizers shared by the quantization strategies: integer, FP8 and block floating point.

Every quantizer takes a tensor ``[..., tokens, head_dim]`` and returns a *chunk*: a small dataclass of
the tensors really held (packed codes, scales, zero points, exponents) that can dequantize itself,
list its tensors for byte accounting, be concatenated with a later chunk along the token axis, and
keep a subset of its tokens without re-encoding anything (channel-axis groups turn ragged, see
:class:`GroupedChunk`).

Grouping convention (both layouts are free views, no copy):

* ``axis="token"`` — groups of ``group_size`` consecutive channels within one token: grouped view
  ``[..., T, D/G, G]``, one scale per token per group (``[..., T, D/G, 1]``). New tokens quantize
  independently during decoding.
* ``axis="channel"`` — groups of ``group_size`` consecutive tokens within one channel: grouped view
  ``[..., T/G, G, D]``, one scale per group of tokens per channel (``[..., T/G, 1, D]``). This is
  KIVI's choice for keys, whose outliers sit in fixed channels (Liu et al. 2024).

In both layouts the token (or token-group) index of a scale tensor is dimension ``-3`` and that of a
code tensor is ``-2``, so chunks concatenate along those dimensions.

Scales and zero points of the integer formats are float16 (the metadata cost quoted in the KIVI
paper); b-bit codes (b in 2, 4) are packed ``8 // b`` per byte along ``head_dim``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

import kvbench.fused as fused
from kvbench.errors import KVBenchError
from kvbench.fused import Fused

SCALE_DTYPE = torch.float16
FP16_MAX = float(torch.finfo(torch.float16).max)
AXES = ("token", "channel")
PACKABLE_BITS = (2, 4, 8)
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_SCALES = ("tensor", "channel")
NONFINITE = "cannot quantize a tensor containing NaN or inf"  # check_finite's and _check_metadata's error
E8M0_BIAS = 127  # OCP MX shared-scale encoding: an unsigned 8-bit exponent, bias 127 (255 is NaN)


def check_finite(*stats: torch.Tensor) -> None:
    """Raise on NaN/inf. Quantizers pass per-group min/max/absmax: reductions propagate NaN and inf, and
    checking them costs a fraction of a pass over the whole tensor."""
    if not all(bool(torch.isfinite(t).all()) for t in stats):
        raise KVBenchError(NONFINITE)


def group_view(x: torch.Tensor, group_size: int, axis: str) -> tuple[torch.Tensor, int]:
    """``x`` viewed with one extra group dimension, and the dimension to reduce for per-group statistics."""
    if axis == "token":
        d = x.shape[-1]
        if group_size <= 0 or d % group_size:
            raise KVBenchError(f"group_size={group_size} must divide head_dim={d}")
        return x.unflatten(-1, (d // group_size, group_size)), -1
    if axis == "channel":
        t = x.shape[-2]
        if group_size <= 0 or t % group_size:
            raise KVBenchError(f"channel-axis groups need a token count divisible by group_size={group_size} "
                               f"(got {t} tokens)")
        return x.unflatten(-2, (t // group_size, group_size)), -2
    raise KVBenchError(f"unknown quantization axis {axis!r}; valid: {', '.join(AXES)}")


def gather_tokens(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``index`` (``t.shape[:dim] + (n,)``) of ``t`` along the negative dimension ``dim``."""
    if dim == -2:
        rows = _take_rows(t, index)
        if rows is not None:
            return rows
    trailing = t.shape[dim + 1:] if dim != -1 else ()
    idx = index.reshape(*index.shape, *([1] * len(trailing))).expand(*index.shape, *trailing)
    idx = idx.to(device=t.device, dtype=torch.long)
    if t.dtype in FP8_FORMATS.values():
        # CPU gather has no float8 kernel; the bytes are moved unchanged through a uint8 view.
        return torch.gather(t.view(torch.uint8), t.dim() + dim, idx).view(t.dtype)
    return torch.gather(t, t.dim() + dim, idx)


def _take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor | None:
    """:func:`gather_tokens` along ``-2`` as one ``index_select`` of whole rows, or ``None`` where ``t``'s layout
    does not allow it.

    ``torch.gather`` reads an index per *element* (the row index expanded over the last dimension), which made
    it ~10x slower than copying the same rows on CPU (an eviction step drops one token from each layer's
    window: 1.2 ms against 0.1 ms for [1, 3, 2048, 64] bf16). When every row is ``d`` contiguous elements and
    every leading stride a whole number of rows — a contiguous tensor, or the held-token view of a buffer with
    spare capacity, as the stores keep — all rows are rows of one ``[R, d]`` view of the storage, and the kept
    ones are selected by their row numbers there. The values and their order are exactly ``gather``'s."""
    if t.dim() < 2 or t.dtype in FP8_FORMATS.values():
        return None
    d = t.shape[-1]
    lead = t.shape[:-2]
    if (t.stride(-1) != 1 or t.stride(-2) != d or any(s % d for s in t.stride()[:-2]) or not t.numel()
            or tuple(index.shape[:-1]) != tuple(lead) or not index.numel()):
        return None
    index = index.to(device=t.device, dtype=torch.long)
    low, high = index.aminmax()
    if int(low) < 0 or int(high) >= t.shape[-2]:
        return None  # gather raises on it; the storage view below would read past the held rows instead
    offsets = torch.zeros((), dtype=torch.long, device=t.device)
    extent = t.shape[-2]
    for i, (size, stride) in enumerate(zip(lead, t.stride()[:-2], strict=True)):
        shape = [1] * len(lead)
        shape[i] = size
        offsets = offsets + torch.arange(size, device=t.device).mul_(stride // d).view(shape)
        extent += (size - 1) * (stride // d)
    rows = t.as_strided((extent, d), (d, 1))  # at t's storage offset; spans its first to last row
    flat = (index + offsets[..., None]).reshape(-1)
    return rows.index_select(0, flat).view(*lead, index.shape[-1], d)


# -- bit packing ------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (``< 2**bits``) ``8 // bits`` per byte along the last dimension.

    The first code of each byte takes the low bits. 8-bit codes are returned as ``uint8`` unchanged.
    """
    if bits not in PACKABLE_BITS:
        raise KVBenchError(f"cannot pack {bits}-bit codes; valid: {', '.join(map(str, PACKABLE_BITS))}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    per = 8 // bits
    if codes.shape[-1] % per:
        raise KVBenchError(
            f"{bits}-bit packing needs a last dimension divisible by {per} (got {codes.shape[-1]})")
    # The fields do not overlap, so their sum is their bitwise OR and never exceeds 255.
    return torch.sum(codes.unflatten(-1, (-1, per)) << _shifts(bits, codes.device), dim=-1, dtype=torch.uint8)


@functools.lru_cache(maxsize=16)
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """Each packed field's bit offset (built once: packing runs per token and layer while decoding)."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8`` codes, ``8 // bits`` times as many along the last dim."""
    if bits == 8:
        return packed
    mask = 2**bits - 1
    # One op per field (2 or 4 of them), then one interleave: about 3x faster on CPU than a broadcast
    # shift against a tensor of shifts.
    middle = [(packed >> s) & mask for s in range(bits, 8 - bits, bits)]
    fields = [packed & mask, *middle, packed >> (8 - bits)]
    return torch.stack(fields, dim=-1).flatten(-2)


# -- chunks -------------------------------------------------------------------------------------------


class TokenChunk(ABC):
    """Behaviour common to quantized chunks: concatenation, token selection, byte accounting.

    ``TOKEN_DIMS`` maps each per-token tensor field to its token (or token-group) dimension; other
    tensor fields (fixed scales) are shared by all tokens and kept as they are.
    """

    TOKEN_DIMS: ClassVar[dict[str, int]]

    @property
    def num_tokens(self) -> int:
        # The first field listed is the payload, whose token dimension is -2.
        return int(getattr(self, next(iter(self.TOKEN_DIMS))).shape[-2])

    def cat(self, other: TokenChunk) -> TokenChunk:
        """This chunk followed by ``other`` (same format) along the token axis, as one contiguous chunk."""
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            f: torch.cat([getattr(self, f), getattr(other, f)], dim=d) for f, d in self.TOKEN_DIMS.items()})

    def take(self, index: torch.Tensor) -> TokenChunk:
        """Keep tokens ``index`` (``[..., n]``, ascending, per leading position); nothing is re-encoded."""
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            f: gather_tokens(getattr(self, f), index, d) for f, d in self.TOKEN_DIMS.items()})

    def narrow(self, start: int, length: int) -> TokenChunk:
        """Tokens ``start .. start + length - 1`` in storage of their own, for formats whose every ``TOKEN_DIMS``
        field has one entry per token (what encoding those tokens alone gives, for token-wise formats)."""
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            f: getattr(self, f).narrow(d, start, length).clone(memory_format=torch.contiguous_format)
            for f, d in self.TOKEN_DIMS.items()})

    def head(self, length: int) -> TokenChunk:
        """Tokens ``0 .. length - 1`` as views of this chunk's storage (no copy: ``ChunkList``'s tail grows through
        them), described for the kernel by cutting this chunk's description (:meth:`kvbench.fused.Fused.head`)
        rather than anew at every decode step."""
        # Made without dataclasses.replace (its field walk and __init__ were most of a decode step's append,
        # twice per layer and sequence): the same fields as this chunk, which was built and checked once, with
        # the per-token ones cut and no description of the whole carried over.
        view = object.__new__(type(self))
        fields = view.__dict__
        fields.update(self.__dict__)
        fields.pop("_described", None)
        for f, d in self.TOKEN_DIMS.items():
            fields[f] = fields[f].narrow(d, 0, length)
        whole = self.fused()
        payload = next(iter(self.TOKEN_DIMS))
        # The description's data is the payload itself where the format reads its codes as stored: one cut serves both.
        data = fields[payload] if whole is not None and whole.data is self.__dict__[payload] else None
        part = None if whole is None else whole.head(length, data)
        if part is not None:
            view.__dict__["_described"] = part
        return view

    def tokenwise(self) -> bool:
        """Whether every ``TOKEN_DIMS`` field has one entry per token (what :meth:`narrow` needs, and what lets a
        token be written into reserved slots, ``ChunkList``'s tail)."""
        return False

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def write(self, x: torch.Tensor, start: int) -> bool:
        """Encode ``x`` (``[b, h, m, d]``) into tokens ``start .. start + m - 1`` of this chunk's own storage, bit
        for bit what encoding ``x`` as a chunk of this format and these parameters gives, where the format can
        (``ChunkList``'s tail: a decode step's token written where it is kept, no chunk made for it); ``False``,
        with nothing written, where it cannot."""
        return False

    @classmethod
    def write_rows(cls, chunks: Sequence[TokenChunk], xs: Sequence[torch.Tensor], starts: Sequence[int]) -> bool:
        """:meth:`write` of ``xs[r]`` (``[1, h, m, d]``, every row the same shape) into ``chunks[r]`` from token
        ``starts[r]`` on, for several sequences at once (a decode step's batch, each row into its own store), each
        what its own :meth:`write` gives; ``False``, with nothing written, where the format cannot do it in one
        call (the caller then writes row by row)."""
        return False

    @abstractmethod
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """All tokens decoded into ``dtype``, shaped like the tensor that was quantized."""

    def fused(self) -> Fused | None:
        """The chunk as ``kvbench.fused``'s kernel reads it, or ``None`` (then attention reads it in blocks).
        Described once per chunk: a chunk's tensors never change after it is made (edits make new chunks)."""
        if "_described" not in self.__dict__:
            self.__dict__["_described"] = self._describe()
        return self.__dict__["_described"]

    def _describe(self) -> Fused | None:
        return None

    # -- block reads for attention (kvbench.blockattn): one block decoded at a time, never the whole chunk ----
    def decode(self, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start:stop`` decoded into ``dtype`` (exactly those rows of :meth:`dequantize`, up to the
        rounding of ``dtype``); the default views the per-token fields of those tokens, copying nothing."""
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            f: getattr(self, f).narrow(d, start, stop - start) for f, d in self.TOKEN_DIMS.items()}).dequantize(dtype)

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``q`` ``[b, h, m, d]`` times keys ``start:stop`` of this chunk: ``[b, h, m, stop - start]``."""
        return torch.matmul(q, self.decode(q.dtype, start, stop).transpose(-1, -2))

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Probabilities ``p`` ``[b, h, m, stop - start]`` times values ``start:stop``: ``[b, h, m, d]``."""
        return torch.matmul(p, self.decode(p.dtype, start, stop))


class GroupedChunk(TokenChunk):
    """Integer codes with per-group metadata (``META`` fields, grouped layout).

    Channel-axis groups span tokens, so dropping tokens cannot simply gather rows of the metadata.
    Instead :meth:`take` keeps every surviving token's codes untouched and records, in ``group_index``
    (``[..., T]`` int16/int32), which metadata row each token uses; groups become ragged but every code
    is still decoded with the scale it was encoded with — exact. Metadata rows no token uses any more
    are freed (per leading position, padded to the largest count). ``group_index`` is ``None`` while
    groups are the implicit ``token // group_size``.
    """

    META: ClassVar[tuple[str, ...]]
    axis: str
    group_size: int
    group_index: torch.Tensor | None

    def _codes(self) -> torch.Tensor:
        return getattr(self, next(iter(self.TOKEN_DIMS)))

    def _rows(self) -> torch.Tensor:
        """Metadata row of every token, ``[..., T]`` int64."""
        if self.group_index is not None:
            return self.group_index.long()
        codes = self._codes()
        t = codes.shape[-2]
        rows = torch.arange(t, device=codes.device) // self.group_size
        return rows.expand(*codes.shape[:-2], t)

    def _per_token_meta(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each token's metadata, ``[..., T, 1, D]``: one gather per field."""
        rows = self._rows()
        return [gather_tokens(getattr(self, f), rows, -3).to(dtype) for f in self.META]

    def cat(self, other: TokenChunk) -> TokenChunk:
        assert isinstance(other, GroupedChunk)
        if self.axis == "token" or (self.group_index is None and other.group_index is None):
            return super().cat(other)
        n_groups = getattr(self, self.META[0]).shape[-3]
        rows = torch.cat([self._rows(), other._rows() + n_groups], dim=-1)
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            f: torch.cat([getattr(self, f), getattr(other, f)], dim=d) for f, d in self.TOKEN_DIMS.items()},
            group_index=_index_tensor(rows, n_groups + getattr(other, self.META[0]).shape[-3]))

    def decode(self, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        if self.axis == "token":
            return super().decode(dtype, start, stop)
        codes = self._codes()
        field = next(iter(self.TOKEN_DIMS))
        if self.group_index is not None:  # ragged groups: the tokens' codes and rows, every metadata row
            return dataclasses.replace(self, **{  # type: ignore[type-var]
                field: codes.narrow(-2, start, stop - start),
                "group_index": self.group_index.narrow(-1, start, stop - start)}).dequantize(dtype)
        # Whole groups of tokens around start:stop, decoded, then the rows asked for.
        g = self.group_size
        a, b = start // g * g, -(-stop // g) * g
        part = dataclasses.replace(self, **{  # type: ignore[type-var]
            field: codes.narrow(-2, a, b - a), **{f: getattr(self, f).narrow(-3, a // g, (b - a) // g)
                                                  for f in self.META}})
        out = part.dequantize(dtype)
        return out if (a, b) == (start, stop) else out.narrow(-2, start - a, stop - start)

    def _describe(self) -> Fused | None:
        """The chunk as the fused kernel reads it (``kvbench.fused``): codes, then each ``META`` field (scale, then
        zero point) as ``[b, h, rows, cols]`` by token group and channel group; ragged groups are not read there."""
        codes = self._codes()
        meta = [getattr(self, f) for f in self.META]
        if self.group_index is not None or codes.dim() != 4 or any(m.dim() != 5 for m in meta):
            return None
        bits = getattr(self, "bits", 8)
        width = codes.shape[-1] * 8 // bits
        if self.axis == "token":
            sides, tg, cg = [m.squeeze(-1) for m in meta], 1, width // meta[0].shape[-2]
        else:
            sides, tg, cg = [m.squeeze(-2) for m in meta], self.group_size, 1
        return Fused(codes, bits, mode="signed" if codes.dtype == torch.int8 else "unsigned", scale=sides[0],
                     zero=sides[1] if len(sides) > 1 else None, tg=tg, cg=cg)

    def tokenwise(self) -> bool:
        return self.axis == "token" and self.group_index is None

    def narrow(self, start: int, length: int) -> TokenChunk:
        if not self.tokenwise():
            raise KVBenchError("only token-axis groups have metadata per token to narrow")
        return super().narrow(start, length)

    def take(self, index: torch.Tensor) -> TokenChunk:
        if self.axis == "token":
            return super().take(index)
        index = index.to(device=self._codes().device, dtype=torch.long)
        rows = torch.gather(self._rows(), -1, index)
        n_groups = getattr(self, self.META[0]).shape[-3]
        used = torch.zeros(*rows.shape[:-1], n_groups, dtype=torch.bool, device=rows.device)
        used.scatter_(-1, rows, True)
        keep = int(used.sum(-1).max()) if used.numel() else 0
        # Used rows first (stable: in order), then as many unused ones as the widest position needs.
        order = torch.argsort((~used).to(torch.int8), dim=-1, stable=True)[..., :keep]
        rank = used.long().cumsum(-1) - 1
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            next(iter(self.TOKEN_DIMS)): gather_tokens(self._codes(), index, -2),
            **{f: gather_tokens(getattr(self, f), order, -3) for f in self.META}},
            group_index=_index_tensor(torch.gather(rank, -1, rows), keep))


def _index_tensor(rows: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Token-to-row map in the smallest integer type that holds it (2 bytes per token up to 32K groups)."""
    return rows.to(torch.int16 if n_groups <= torch.iinfo(torch.int16).max else torch.int32)


# -- symmetric int8 -------------------------------------------------------------------------------------


@dataclass
class SymmetricInt8(GroupedChunk):
    """Symmetric int8 codes with one float16 absmax scale per group."""

    codes: torch.Tensor  # int8, same shape as the input
    scales: torch.Tensor  # float16, grouped layout ([..., T, D/G, 1] or [..., T/G, 1, D])
    axis: str
    group_size: int
    group_index: torch.Tensor | None = None  # set once tokens were dropped from channel-axis groups

    TOKEN_DIMS: ClassVar[dict[str, int]] = {"codes": -2, "scales": -3}
    META: ClassVar[tuple[str, ...]] = ("scales",)

    def write(self, x: torch.Tensor, start: int) -> bool:
        """``quantize_int8(x, group_size, "token")``'s codes and scales written into this chunk's storage by the
        native quantizer (its same operations), for token-axis chunks on CPU."""
        if self.axis != "token" or self.group_index is not None or not x.is_cpu or x.dim() != 4 \
                or self.codes.dim() != 4 or x.shape[-1] % self.group_size:
            return False
        native = fused.native()
        if native is None:
            return False
        _check_peak(native.quantize_int8_token_into(x, self.group_size, self.codes, self.scales, start),
                    "int8 scale")
        return True

    @classmethod
    def write_rows(cls, chunks: Sequence[TokenChunk], xs: Sequence[torch.Tensor], starts: Sequence[int]) -> bool:
        """:meth:`write` for a batch's rows, one native call for all (``quantize_int8_token_rows_into``)."""
        first = chunks[0]
        assert isinstance(first, SymmetricInt8)
        g = first.group_size
        if not all(type(c) is cls and c.axis == "token" and c.group_index is None and c.group_size == g
                   and c.codes.dim() == 4 and c.codes.shape[0] == 1 for c in chunks):
            return False
        if not all(x.is_cpu and x.dim() == 4 and x.shape == xs[0].shape for x in xs) or xs[0].shape[-1] % g \
                or xs[0].shape[0] != 1:
            return False
        native = fused.rows_native()
        if native is None:
            return False
        _check_peak(native.quantize_int8_token_rows_into(torch.cat(list(xs)), g, [c.codes for c in chunks],
                                                         [c.scales for c in chunks], list(starts)), "int8 scale")
        return True

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # float32 arithmetic, one cast at the end: int8 -> float32 is far cheaper on CPU than -> bfloat16,
        # and the product is rounded once.
        if self.group_index is not None:
            (s,) = self._per_token_meta(torch.float32)
            return (self.codes.float().unsqueeze(-2) * s).squeeze(-2).to(dtype)
        g, _ = group_view(self.codes.float(), self.group_size, self.axis)
        return g.mul_(self.scales.float()).flatten(*_group_dims(self.axis)).to(dtype)


    def _token_scales(self, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor | None:
        """``[.., 1, n]`` scales of tokens ``start:stop`` when each token has one scale for its whole head (token
        axis, group = head_dim), which then folds into the scores and probabilities (KIVI's per-token fold)."""
        if self.axis != "token" or self.scales.shape[-2] != 1:
            return None
        return self.scales[..., start:stop, 0, 0].to(dtype).unsqueeze(-2)

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        s = self._token_scales(q.dtype, start, stop)
        if s is None:
            return super().scores(q, start, stop)
        return torch.matmul(q, self.codes[..., start:stop, :].to(q.dtype).transpose(-1, -2)).mul_(s)

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        s = self._token_scales(p.dtype, start, stop)
        if s is None:
            return super().weighted(p, start, stop)
        return torch.matmul(p * s, self.codes[..., start:stop, :].to(p.dtype))


def _group_dims(axis: str) -> tuple[int, int]:
    return (-2, -1) if axis == "token" else (-3, -2)


def quantize_int8(x: torch.Tensor, group_size: int, axis: str = "token") -> SymmetricInt8:
    """Round-to-nearest symmetric int8: ``code = round(x / s)``, ``s = absmax / 127`` per group.

    Codes are computed with the float16-rounded scale actually stored, so ``|x - x̂| <= s / 2``.
    """
    if axis == "token" and x.is_cpu and group_size > 0 and x.shape[-1] % group_size == 0:
        native = fused.native()
        if native is not None:  # the same operations in one C++ pass (a decode step quantizes a token per layer)
            codes, scale, peak = native.quantize_int8_token(x, group_size)
            _check_peak(float(peak), "int8 scale")
            return SymmetricInt8(codes, scale, axis, group_size)
    g, dim = group_view(x.float(), group_size, axis)
    scale = g.abs().amax(dim=dim, keepdim=True) / 127.0
    _check_metadata(scale, "int8 scale")  # scales are >= 0 (or NaN): their largest is their largest magnitude
    scale = scale.to(SCALE_DTYPE)
    s = scale.float()
    # Groups of zeros keep scale 0 and code 0; dividing by 1 there avoids 0/0.
    codes = torch.round(g / torch.where(s > 0, s, 1.0)).clamp_(-127, 127)
    return SymmetricInt8(codes.to(torch.int8).flatten(*_group_dims(axis)), scale, axis, group_size)


def _check_metadata(magnitudes: torch.Tensor, what: str) -> None:
    """:func:`check_finite` and the float16 range of metadata in one reduction and one host sync (a decode step
    quantizes a token per layer and stream, so each sync counts): ``amax`` propagates NaN and inf, so a finite
    largest magnitude means every magnitude is finite."""
    if not magnitudes.numel():
        return
    _check_peak(float(magnitudes.amax()), what)


def _check_peak(peak: float, what: str) -> None:
    if not math.isfinite(peak):
        raise KVBenchError(NONFINITE)
    if peak > FP16_MAX:
        raise KVBenchError(f"{what} exceeds the float16 range (|x| <= {FP16_MAX:g}); values this large "
                           "cannot carry float16 metadata")


# -- asymmetric b-bit (KIVI) ----------------------------------------------------------------------------


@dataclass
class AsymmetricQuant(GroupedChunk):
    """Asymmetric ``bits``-bit codes packed along ``head_dim``, with float16 scale and zero point per group.

    ``x̂ = code * scale + zero`` with ``zero`` the group minimum and ``scale = (max - min) / (2**bits - 1)``.
    """

    codes: torch.Tensor  # uint8 [..., T, D * bits / 8]
    scale: torch.Tensor  # float16, grouped layout
    zero: torch.Tensor  # float16, grouped layout
    bits: int
    axis: str
    group_size: int
    group_index: torch.Tensor | None = None  # set once tokens were dropped from channel-axis groups

    TOKEN_DIMS: ClassVar[dict[str, int]] = {"codes": -2, "scale": -3, "zero": -3}
    META: ClassVar[tuple[str, ...]] = ("scale", "zero")

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # float32 arithmetic, one cast at the end (faster on CPU than bfloat16 arithmetic). A separate
        # multiply and add, never a fused multiply-add, whose use can differ between a kernel's vector
        # body and its tail: decoding stays element-wise exact, so a token decoded alone equals the same
        # token decoded with its whole chunk (what the stores' working copies rely on).
        c = unpack_codes(self.codes, self.bits).float()
        if self.group_index is not None:
            s, z = self._per_token_meta(torch.float32)
            return (c.unsqueeze(-2) * s + z).squeeze(-2).to(dtype)
        g, _ = group_view(c, self.group_size, self.axis)
        # In place on the fresh float copy: one block-sized temporary, not three (attention decodes block by block).
        out = g.mul_(self.scale.float()).add_(self.zero.float())
        return out.flatten(*_group_dims(self.axis)).to(dtype)


def quantize_asymmetric(x: torch.Tensor, bits: int, group_size: int, axis: str) -> AsymmetricQuant:
    """Min/max asymmetric round-to-nearest quantization (KIVI, Liu et al. 2024).

    Codes use the float16 scale and zero point actually stored; the reconstruction error is bounded
    by ``s'/2 + |z - z'| + (2**bits - 1) * |s - s'|`` (``'`` marks the stored float16 values).
    """
    if bits not in PACKABLE_BITS:
        raise KVBenchError(
            f"asymmetric quantization supports {', '.join(map(str, PACKABLE_BITS))} bits (got {bits})")
    g, dim = group_view(x.float(), group_size, axis)
    levels = 2**bits - 1
    lo, hi = g.amin(dim=dim, keepdim=True), g.amax(dim=dim, keepdim=True)
    _check_metadata(torch.maximum(lo.abs(), hi.abs()), "a value")
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - lo) / levels).to(SCALE_DTYPE)
    s, z = scale.float(), zero.float()
    codes = torch.round((g - z) / torch.where(s > 0, s, 1.0)).clamp_(0, levels)
    codes = codes.to(torch.uint8).flatten(*_group_dims(axis))
    return AsymmetricQuant(pack_codes(codes, bits), scale, zero, bits, axis, group_size)


# -- FP8 --------------------------------------------------------------------------------------------------


@dataclass
class Fp8Quant(TokenChunk):
    """FP8 payload (``float8_e4m3fn`` or ``float8_e5m2``) with a float32 scale fixed at calibration."""

    payload: torch.Tensor  # float8, same shape as the input
    scale: torch.Tensor  # float32, broadcastable: all-ones shape (per tensor) or [..., 1, D] (per channel)

    TOKEN_DIMS: ClassVar[dict[str, int]] = {"payload": -2}

    def tokenwise(self) -> bool:
        return True

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        # CPU float8 casts are slow (~10x a gather), so decode through a 256-entry table indexed by the
        # raw bytes; a per-tensor scale is folded into the table, so the product is rounded once.
        table = _fp8_table(self.payload.dtype, self.payload.device)
        codes = self.payload.view(torch.uint8).flatten().int()
        shape = self.payload.shape
        if self.scale.numel() == 1:
            return torch.index_select((table * self.scale.flatten()).to(dtype), 0, codes).view(shape)
        return (torch.index_select(table, 0, codes).view(shape) * self.scale).to(dtype)


    def _describe(self) -> Fused | None:
        # FP8 bytes decoded by the kernel's arithmetic (exact); a per-tensor scale folds into the products, a
        # per-channel one is read per channel.
        mode = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(self.payload.dtype)
        if mode is None or self.payload.dim() != 4 or self.scale.dim() != 4:
            return None
        if self.scale.numel() == 1:
            return Fused(self.payload, 8, mode=mode, scale=self.scale.float(), tg=0, cg=self.payload.shape[-1])
        return Fused(self.payload, 8, mode=mode, scale=self.scale.float(), tg=0, cg=1)

    def _codes(self, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start:stop`` as the unscaled FP8 values, in ``dtype`` (through the byte table)."""
        block = self.payload[..., start:stop, :]
        idx = block.view(torch.uint8).to(torch.int32, memory_format=torch.contiguous_format)
        return torch.index_select(_fp8_table(self.payload.dtype, self.payload.device), 0,
                                  idx.view(-1)).view(idx.shape).to(dtype)

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        # Scale per tensor: it multiplies the scores; per channel: it folds into the query (KIVI's key fold).
        scale = self.scale.to(q.dtype)
        if scale.numel() == 1:
            return torch.matmul(q, self._codes(q.dtype, start, stop).transpose(-1, -2)).mul_(scale.flatten())
        return torch.matmul(q * scale, self._codes(q.dtype, start, stop).transpose(-1, -2))

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        scale = self.scale.to(p.dtype)
        out = torch.matmul(p, self._codes(p.dtype, start, stop))
        return out.mul_(scale.flatten()) if scale.numel() == 1 else out.mul_(scale)


@functools.lru_cache(maxsize=8)
def _fp8_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The float32 value of each of the 256 bit patterns of an FP8 format (NaN patterns are never stored)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(dtype).float()


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FP8_FORMATS:
        raise KVBenchError(f"unknown fp8 format {fmt!r}; valid: {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[fmt]


def fp8_scale(x: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """Absmax scale mapping ``x`` onto the format's largest finite value: one per tensor or per channel."""
    if x.shape[-2] == 0:
        raise KVBenchError("an fp8 scale is calibrated on at least one token")
    fmax = torch.finfo(fp8_dtype(fmt)).max
    if mode == "tensor":
        amax = x.abs().amax().float().reshape([1] * x.dim())
    elif mode == "channel":
        amax = x.abs().amax(dim=-2, keepdim=True).float()
    else:
        raise KVBenchError(f"unknown fp8 scale mode {mode!r}; valid: {', '.join(FP8_SCALES)}")
    check_finite(amax)
    # An all-zero tensor or channel would give scale 0; the smallest normal float32 keeps 0/0 away.
    return (amax / fmax).clamp(min=torch.finfo(torch.float32).tiny).to(x.device)


def quantize_fp8(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> tuple[Fp8Quant, int]:
    """Encode ``x / scale`` as FP8, saturating at the format's largest finite value.

    Returns the chunk and how many elements saturated (values beyond ``fmax * scale``, which happens
    only for tokens encoded with a scale calibrated on earlier ones). ``float8_e4m3fn`` has no
    infinity, so clamping first is what keeps out-of-range values from turning into NaN.
    """
    fmax = torch.finfo(fp8_dtype(fmt)).max
    native = fused.native() if x.is_cpu and x.dim() == 4 and scale.dim() == 4 else None
    if native is not None:  # the same operations in one C++ pass (a decode step encodes a token per layer)
        payload, saturated, bad = native.quantize_fp8(x, scale, fp8_dtype(fmt) == torch.float8_e4m3fn)
        if int(bad):
            raise KVBenchError(NONFINITE)
        return Fp8Quant(payload, scale), int(saturated)
    y = x.float() / scale
    magnitude = y.abs()
    if magnitude.numel():
        check_finite(magnitude.amax())
    # Only values truly beyond the range count: x / (amax / fmax) may land a float32 ulp above fmax.
    saturated = int((magnitude > fmax * (1 + 4 * torch.finfo(torch.float32).eps)).sum())
    return Fp8Quant(y.clamp_(-fmax, fmax).to(fp8_dtype(fmt)), scale), saturated


# -- block floating point (OCP Microscaling) --------------------------------------------------------------


@dataclass
class BlockFloat(TokenChunk):
    """Block floating point: per block of ``block_size`` channels one E8M0 exponent, signed integer mantissas.

    ``x̂ = m * 2**e`` with ``m`` a ``mantissa_bits``-bit two's-complement integer (sign included) and
    ``e`` the block's shared exponent, stored biased by 127 in one ``uint8``.
    """

    mantissas: torch.Tensor  # int8 [..., T, D] (8-bit) or uint8 packed [..., T, D * bits / 8]
    exponents: torch.Tensor  # uint8 [..., T, D / N, 1]
    mantissa_bits: int
    block_size: int

    TOKEN_DIMS: ClassVar[dict[str, int]] = {"mantissas": -2, "exponents": -3}

    def tokenwise(self) -> bool:
        return True

    def signed_mantissas(self) -> torch.Tensor:
        if self.mantissa_bits == 8:
            return self.mantissas
        half = 2 ** (self.mantissa_bits - 1)
        # Two's complement: codes >= half are negative.
        return (unpack_codes(self.mantissas, self.mantissa_bits).to(torch.int8) ^ half) - half

    def _describe(self) -> Fused | None:
        # Two's-complement mantissas (int8, or packed) times each block's exponent as an E8M0 scale.
        if self.mantissas.dim() != 4 or self.exponents.dim() != 5:
            return None
        return Fused(self.mantissas, self.mantissa_bits, mode="signed", scale=self.exponents.squeeze(-1),
                     tg=1, cg=self.block_size)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        m = self.signed_mantissas().unflatten(-1, (-1, self.block_size)).float()
        # float32 holds every power of two in E8M0's range; the target dtype may not (fp16).
        scale = torch.exp2(self.exponents.float() - E8M0_BIAS)
        return (m * scale).flatten(-2).to(dtype)


def quantize_bfp(x: torch.Tensor, mantissa_bits: int, block_size: int) -> BlockFloat:
    """MX-style block floating point (OCP Microscaling v1.0; Rouhani et al. 2023).

    The shared exponent is ``floor(log2(absmax)) - (mantissa_bits - 2)``, so the block maximum lands in
    ``[2**(M-2), 2**(M-1))`` mantissa units; mantissas are rounded to nearest and saturate at
    ``±(2**(M-1) - 1)`` as in the spec. The error is below one unit of the block: ``|x - x̂| <= 2**e``.
    """
    if mantissa_bits not in PACKABLE_BITS:
        raise KVBenchError(f"bfp mantissa_bits must be one of {', '.join(map(str, PACKABLE_BITS))} "
                           f"(got {mantissa_bits})")
    native = fused.native() if mantissa_bits == 8 and x.is_cpu and block_size > 0 and \
        x.shape[-1] % block_size == 0 else None
    if native is not None:  # the same operations in one C++ pass (a decode step encodes a token per layer)
        m, e, bad = native.quantize_bfp8(x, block_size)
        if int(bad):
            raise KVBenchError(NONFINITE)
        return BlockFloat(m, e, mantissa_bits, block_size)
    g, _ = group_view(x.float(), block_size, "token")
    amax = g.abs().amax(dim=-1, keepdim=True)
    check_finite(amax)
    # frexp gives amax = f * 2**k with f in [0.5, 1), so floor(log2(amax)) = k - 1 exactly (no log rounding).
    _, k = torch.frexp(amax)
    e = torch.where(amax > 0, k - 1 - (mantissa_bits - 2), torch.full_like(k, -E8M0_BIAS))
    e = e.clamp_(-E8M0_BIAS, E8M0_BIAS)
    top = 2 ** (mantissa_bits - 1) - 1
    m = torch.round(g * torch.exp2(-e.float())).clamp_(-top, top).to(torch.int8).flatten(-2)
    if mantissa_bits < 8:
        m = pack_codes(m.to(torch.uint8) & (2**mantissa_bits - 1), mantissa_bits)
    return BlockFloat(m, (e + E8M0_BIAS).to(torch.uint8), mantissa_bits, block_size)
