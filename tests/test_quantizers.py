"""Property tests of the low-level quantizers: round-trip bounds, packing, layouts, edge values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvbench.errors import KVBenchError
from kvbench.quantizers import (
    AsymmetricQuant,
    fp8_dtype,
    fp8_scale,
    gather_tokens,
    group_view,
    pack_codes,
    quantize_asymmetric,
    quantize_bfp,
    quantize_fp8,
    quantize_int8,
    unpack_codes,
)

SETTINGS = settings(max_examples=40, deadline=None)
EPS32 = float(torch.finfo(torch.float32).eps)


@st.composite
def kv_tensors(draw: st.DrawFn, token_multiple: int = 1, max_exp: int = 14,
               min_exp: int = -20) -> torch.Tensor:
    """``[b, h, t, d]`` float32: random, all-zero, constant or sparse, magnitudes 2**min_exp..2**max_exp.

    The default range keeps every value inside float16, which formats with float16 metadata need.
    """
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    t = token_multiple * draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 16, 32]))
    kind = draw(st.sampled_from(["random", "random", "zeros", "constant", "sparse"]))
    scale = 2.0 ** draw(st.integers(min_exp, max_exp))
    if kind == "zeros":
        return torch.zeros(b, h, t, d)
    if kind == "constant":
        return torch.full((b, h, t, d), draw(st.floats(-1, 1, width=32)) * scale)
    base = draw(hnp.arrays(np.float32, (b, h, t, d), elements=st.floats(-1, 1, width=32)))
    x = torch.from_numpy(base.copy()) * scale
    if kind == "sparse":
        x = torch.where(x.abs() > 0.9 * scale, x, torch.zeros_like(x))
    return x


# -- packing --------------------------------------------------------------------------------------------


@SETTINGS
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(0, 5), groups=st.integers(1, 6),
       seed=st.integers(0, 99))
def test_pack_unpack_round_trip(bits: int, rows: int, groups: int, seed: int) -> None:
    d = groups * (8 // bits)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, d), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, d * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_pack_layout_low_bits_first() -> None:
    assert pack_codes(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_codes(torch.tensor([3, 0, 1, 2], dtype=torch.uint8), 2).tolist() == [0b10010011]
    with pytest.raises(KVBenchError, match="divisible by 2"):
        pack_codes(torch.zeros(3, dtype=torch.uint8), 4)
    with pytest.raises(KVBenchError, match="valid: 2, 4, 8"):
        pack_codes(torch.zeros(3, dtype=torch.uint8), 3)


# -- asymmetric b-bit -------------------------------------------------------------------------------------


def _per_element(q: AsymmetricQuant, g: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
    dims = (-2, -1) if q.axis == "token" else (-3, -2)
    return stat.expand_as(g).flatten(*dims)


def _asym_bound(x: torch.Tensor, q: AsymmetricQuant) -> torch.Tensor:
    """Bound s'/2 + |z - z'| + levels |s - s'| per element from the stored fp16 scale/zero, plus slack."""
    g, dim = group_view(x, q.group_size, q.axis)
    levels = 2**q.bits - 1
    lo, hi = g.amin(dim=dim, keepdim=True), g.amax(dim=dim, keepdim=True)
    s, z = (hi - lo) / levels, lo
    s2, z2 = q.scale.float(), q.zero.float()
    bound = s2 / 2 + (z - z2).abs() + levels * (s - s2).abs()
    # fp32 slack: a few ulps of the magnitudes, and levels x subnormal spacing where s underflows
    slack = 4 * EPS32 * (z2.abs() + levels * s2 + g.abs()) + 1e-42
    return _per_element(q, g, bound + slack)


@SETTINGS
@given(data=st.data(), bits=st.sampled_from([2, 4, 8]), axis=st.sampled_from(["token", "channel"]))
def test_asymmetric_round_trip_within_bound(data: st.DataObject, bits: int, axis: str) -> None:
    group = 8
    x = data.draw(kv_tensors(token_multiple=group))
    q = quantize_asymmetric(x, bits, group, axis)
    xh = q.dequantize(torch.float32)
    assert xh.shape == x.shape and xh.dtype == torch.float32
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (*x.shape[:-1], x.shape[-1] * bits // 8)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    assert ((xh - x).abs() <= _asym_bound(x, q)).all()
    # Dequantizing into bfloat16 (the engine's dtype) computes in float32 and rounds once, at the end.
    assert torch.equal(q.dequantize(torch.bfloat16), xh.to(torch.bfloat16))


def test_asymmetric_constant_and_zero_groups_are_exact_up_to_fp16() -> None:
    x = torch.full((1, 2, 16, 8), 0.1)
    for axis in ("token", "channel"):
        q = quantize_asymmetric(x, 4, 8, axis)
        assert torch.equal(q.dequantize(torch.float32), torch.full_like(x, float(torch.tensor(0.1).half())))
        assert torch.equal(quantize_asymmetric(torch.zeros_like(x), 2, 8, axis).dequantize(torch.float32),
                           torch.zeros_like(x))


def test_asymmetric_extremes() -> None:
    x = torch.tensor([[60000.0, -60000.0, 1.0, 0.0], [1e-30, -1e-30, 0.0, 5e-31]])
    q = quantize_asymmetric(x, 4, 4, "token")
    err = (q.dequantize(torch.float32) - x).abs()
    assert err[0].max() <= _asym_bound(x, q)[0].max() and err[1].max() <= 1e-29
    with pytest.raises(KVBenchError, match="float16 range"):
        quantize_asymmetric(torch.tensor([[7e4, 0.0]]), 4, 2, "token")
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(KVBenchError, match="NaN or inf"):
            quantize_asymmetric(torch.tensor([[bad, 0.0]]), 4, 2, "token")
    with pytest.raises(KVBenchError, match="divisible by group_size=8"):
        quantize_asymmetric(torch.zeros(1, 1, 12, 8), 4, 8, "channel")
    with pytest.raises(KVBenchError, match="valid: token, channel"):
        quantize_asymmetric(torch.zeros(1, 1, 8, 8), 4, 8, "head")


# -- symmetric int8 ----------------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data(), axis=st.sampled_from(["token", "channel"]))
def test_int8_round_trip_within_bound(data: st.DataObject, axis: str) -> None:
    x = data.draw(kv_tensors(token_multiple=8, max_exp=20))
    q = quantize_int8(x, 8, axis)
    xh = q.dequantize(torch.float32)
    assert q.codes.dtype == torch.int8 and q.codes.shape == x.shape and q.scales.dtype == torch.float16
    scales = q.scales.float()
    g = x.unflatten(-1, (-1, 8)) if axis == "token" else x.unflatten(-2, (-1, 8))
    true_s = g.abs().amax(dim=-1 if axis == "token" else -2, keepdim=True) / 127
    # slack: fp32 ulps, and 127 subnormal ulps where computing s = absmax / 127 underflows
    bound = scales / 2 + 127 * (true_s - scales).abs() + 4 * EPS32 * g.abs() + 1e-42
    err = (xh - x).unflatten(-1, (-1, 8)) if axis == "token" else (xh - x).unflatten(-2, (-1, 8))
    assert (err.abs() <= bound).all()
    assert torch.equal(q.dequantize(torch.bfloat16), xh.to(torch.bfloat16))


def test_int8_extremes() -> None:
    with pytest.raises(KVBenchError, match="float16 range"):
        quantize_int8(torch.tensor([[1e10, 0.0]]), 2)
    with pytest.raises(KVBenchError, match="NaN or inf"):
        quantize_int8(torch.tensor([[float("inf"), 0.0]]), 2)
    zero = quantize_int8(torch.zeros(1, 1, 8, 8), 8, "channel")
    assert torch.equal(zero.dequantize(torch.float32), torch.zeros(1, 1, 8, 8))


# -- FP8 ---------------------------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from(["e4m3", "e5m2"]), mode=st.sampled_from(["tensor", "channel"]))
def test_fp8_round_trip_within_bound(data: st.DataObject, fmt: str, mode: str) -> None:
    x = data.draw(kv_tensors(max_exp=100, min_exp=-100))
    scale = fp8_scale(x, fmt, mode)
    q, saturated = quantize_fp8(x, fmt, scale)
    fi = torch.finfo(fp8_dtype(fmt))
    assert saturated == 0 and q.payload.dtype == fp8_dtype(fmt) and q.payload.shape == x.shape
    assert scale.dtype == torch.float32
    assert scale.shape == ((1, 1, 1, 1) if mode == "tensor" else (*x.shape[:2], 1, x.shape[-1]))
    xh = q.dequantize(torch.float32)
    # Half a unit in the last place: relative for normals, absolute (scaled) in the subnormal range.
    bound = x.abs() * (fi.eps / 2 + 4 * EPS32) + scale * fi.smallest_normal * fi.eps / 2
    assert ((xh - x).abs() <= bound).all()
    # the table decoder rounds once into the target dtype
    assert torch.equal(q.dequantize(torch.bfloat16), xh.to(torch.bfloat16))


def test_fp8_fixed_scale_saturates() -> None:
    calib = torch.ones(1, 1, 4, 4)
    for fmt in ("e4m3", "e5m2"):
        scale = fp8_scale(calib, fmt, "tensor")
        q, saturated = quantize_fp8(torch.tensor([[[[5.0, -5.0, 0.5, 1.0]]]]), fmt, scale)
        assert saturated == 2
        assert q.dequantize(torch.float32).flatten().tolist() == [1.0, -1.0, 0.5, 1.0]
    zero_scale = fp8_scale(torch.zeros(1, 1, 2, 2), "e4m3", "channel")
    assert (zero_scale > 0).all()  # an all-zero channel still gets a usable, finite scale
    with pytest.raises(KVBenchError, match="valid: e4m3, e5m2"):
        fp8_scale(calib, "e3m4", "tensor")
    with pytest.raises(KVBenchError, match="valid: tensor, channel"):
        fp8_scale(calib, "e4m3", "block")


# -- block floating point ------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data(), bits=st.sampled_from([4, 8]), block=st.sampled_from([4, 8]))
def test_bfp_round_trip_within_bound(data: st.DataObject, bits: int, block: int) -> None:
    x = data.draw(kv_tensors(max_exp=120, min_exp=-120))
    q = quantize_bfp(x, bits, block)
    assert q.exponents.dtype == torch.uint8 and q.exponents.shape == (*x.shape[:-1], x.shape[-1] // block, 1)
    if bits == 8:
        assert q.mantissas.dtype == torch.int8 and q.mantissas.shape == x.shape
    else:
        assert q.mantissas.dtype == torch.uint8 and q.mantissas.shape == (*x.shape[:-1], x.shape[-1] // 2)
    m = q.signed_mantissas()
    assert m.abs().max() <= 2 ** (bits - 1) - 1
    xh = q.dequantize(torch.float32)
    unit = torch.exp2(q.exponents.float() - 127)  # one mantissa unit of each block
    g = x.unflatten(-1, (-1, block))
    err = (xh - x).unflatten(-1, (-1, block)).abs()
    assert (err <= unit + 4 * EPS32 * g.abs()).all()
    # ... and relative to the block maximum: at most 2**-(M-2) of it.
    assert (err <= g.abs().amax(-1, keepdim=True) * 2.0 ** -(bits - 2) + 1e-38).all()


def test_bfp_zero_blocks_and_nan() -> None:
    q = quantize_bfp(torch.zeros(1, 1, 2, 8), 8, 8)
    assert torch.equal(q.dequantize(torch.float32), torch.zeros(1, 1, 2, 8))
    assert (q.exponents == 0).all()  # E8M0 code 0 = 2**-127: the smallest scale
    with pytest.raises(KVBenchError, match="NaN or inf"):
        quantize_bfp(torch.tensor([[float("nan")] * 8]), 8, 8)
    with pytest.raises(KVBenchError, match="must divide head_dim"):
        quantize_bfp(torch.zeros(1, 12), 8, 8)


# -- chunk operations ------------------------------------------------------------------------------------


def _chunks(x: torch.Tensor) -> dict[str, object]:
    return {
        "int8": lambda t: quantize_int8(t, 8),
        "int8-channel": lambda t: quantize_int8(t, 4, "channel"),
        "int4": lambda t: quantize_asymmetric(t, 4, 8, "token"),
        "int4-channel": lambda t: quantize_asymmetric(t, 4, 4, "channel"),
        "int2": lambda t: quantize_asymmetric(t, 2, 8, "token"),
        "bfp4": lambda t: quantize_bfp(t, 4, 8),
        "fp8": lambda t: quantize_fp8(t, "e4m3", fp8_scale(x, "e4m3", "channel"))[0],
    }


@pytest.mark.parametrize("kind", ["int8", "int8-channel", "int4", "int4-channel", "int2", "bfp4", "fp8"])
def test_chunks_concatenate_and_take_tokens(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 20, 16, generator=g)
    enc = _chunks(x)[kind]
    a, b = enc(x[:, :, :12]), enc(x[:, :, 12:])
    both = a.cat(b)
    whole = torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)], dim=-2)
    assert both.num_tokens == 20 and torch.equal(both.dequantize(torch.float32), whole)
    index = torch.sort(torch.randperm(20, generator=g)[:7]).values.expand(2, 3, 7).clone()
    index[1, 2] = torch.arange(7)  # rows may keep different tokens
    kept = both.take(index)
    assert kept.num_tokens == 7
    assert torch.equal(kept.dequantize(torch.float32), gather_tokens(whole, index, -2))


def test_channel_groups_drop_tokens_exactly_and_free_emptied_groups() -> None:
    """Dropping tokens from groups that span tokens re-encodes nothing: groups turn ragged."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 32, 8, generator=g)
    q = quantize_asymmetric(x, 4, 8, "channel")  # 4 groups of 8 tokens
    index = torch.tensor([[[0, 3, 9, 10, 30], [1, 2, 4, 5, 6]]])  # head 1 keeps group 0 only
    kept = q.take(index)
    assert isinstance(kept, AsymmetricQuant) and kept.group_index is not None
    assert kept.group_index.dtype == torch.int16 and kept.group_index.shape == (1, 2, 5)
    assert kept.scale.shape == (1, 2, 3, 1, 8)  # groups 0, 1, 3 for head 0; freed: group 2
    assert kept.group_index[0, 1].tolist() == [0] * 5
    whole = q.dequantize(torch.float32)
    assert torch.equal(kept.dequantize(torch.float32), gather_tokens(whole, index, -2))
    # Ragged chunks keep concatenating with new whole groups, and keep dropping tokens.
    more = quantize_asymmetric(x[..., :8, :] * 2, 4, 8, "channel")
    both = kept.cat(more)
    want = torch.cat([kept.dequantize(torch.float32), more.dequantize(torch.float32)], dim=-2)
    assert both.num_tokens == 13 and torch.equal(both.dequantize(torch.float32), want)
    index = torch.tensor([[[1, 4, 12], [0, 7, 8]]])
    assert torch.equal(both.take(index).dequantize(torch.float32), gather_tokens(want, index, -2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_quantizer_rejects_nan_and_inf(bad: float) -> None:
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 3, 5] = bad
    for quantize in (lambda t: quantize_int8(t, 8), lambda t: quantize_int8(t, 8, "channel"),
                     lambda t: quantize_asymmetric(t, 4, 8, "channel"), lambda t: quantize_bfp(t, 4, 8),
                     lambda t: fp8_scale(t, "e4m3", "channel"),
                     lambda t: quantize_fp8(t, "e5m2", torch.ones(1, 1, 1, 1))):
        with pytest.raises(KVBenchError, match="NaN or inf"):
            quantize(x)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), n=st.integers(1, 40), spare=st.integers(0, 9),
       d=st.sampled_from([1, 2, 8, 16]), data=st.data(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8]))
def test_gather_tokens_row_copy_equals_torch_gather(b, h, n, spare, d, data, dtype) -> None:
    """``gather_tokens`` along -2 copies whole rows through a view of the storage (the fast path): on contiguous
    tensors and on the held-token views of buffers with spare capacity it returns exactly ``torch.gather``'s
    values, shape and order; an index past the held rows still raises rather than reading the spare ones."""
    buf = (torch.randn(b, h, n + spare, d) * 50).to(dtype)
    t = buf[..., :n, :] if data.draw(st.booleans()) else buf[..., :n, :].contiguous()
    keep = data.draw(st.integers(1, n))
    index = torch.stack([torch.randperm(n)[:keep].sort().values for _ in range(b * h)]).view(b, h, keep)
    index = index.to(data.draw(st.sampled_from([torch.long, torch.int32, torch.int16])))
    want = torch.gather(t, 2, index.long()[..., None].expand(b, h, keep, d))
    got = gather_tokens(t, index, -2)
    assert got.shape == want.shape and torch.equal(got, want)
    if spare:
        with pytest.raises(RuntimeError):
            gather_tokens(t, torch.full_like(index, n), -2)
