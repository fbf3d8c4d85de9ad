"""The fused reader (``kvbench.fused``, ``kvbench/fused_attend.cpp``) equals blockattn's blocks on every format.

Every chunk format the stores hold (int8 by tokens and by channels, KIVI's packed 4- and 2-bit codes with zero
points, FP8 with a per-tensor or per-channel scale, block floating point with 8- and 4-bit mantissas, dense
residuals in float32, bfloat16 and float16) is cut into pieces of uneven lengths, and attention of a short
grouped query over them is computed twice: by the kernel (chunks of a few tokens, so the online-softmax merge runs
across piece boundaries) and by ``blockattn``'s PyTorch blocks (``KVBENCH_FUSED=0``), which is itself checked
against dequantize-then-SDPA by tests/test_attention.py. Masks: none, boolean with per-head padding, additive.
The registry-wide test in tests/test_attention.py runs every strategy through whichever reader applies.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench import blockattn, fused
from kvbench.quantizers import (
    fp8_scale,
    quantize_asymmetric,
    quantize_bfp,
    quantize_fp8,
    quantize_int8,
    unpack_codes,
)

pytestmark = pytest.mark.skipif(not fused.available(), reason="the fused kernel could not be built here")

READERS = [r for r in fused.READERS if r != "blocks"]


@pytest.fixture(params=READERS)
def reader(request):
    """Each kernel in turn (the first, kept for its runs, and the vector one), then the default again."""
    fused.choose(request.param)
    if not fused.available():
        pytest.skip(f"the {request.param} kernel could not be built here")
    yield request.param
    fused.choose("auto")

D = 16


def _formats(ref: torch.Tensor) -> dict:
    return {
        "int8-token": lambda x: quantize_int8(x, D, "token"),
        "int8-token-g8": lambda x: quantize_int8(x, 8, "token"),
        "int8-channel": lambda x: quantize_int8(x, 4, "channel"),
        "int4-token": lambda x: quantize_asymmetric(x, 4, 8, "token"),
        "int4-channel": lambda x: quantize_asymmetric(x, 4, 4, "channel"),
        "int2-channel": lambda x: quantize_asymmetric(x, 2, 4, "channel"),
        "int2-token": lambda x: quantize_asymmetric(x, 2, 8, "token"),
        "fp8-tensor": lambda x: quantize_fp8(x, "e4m3", fp8_scale(ref, "e4m3", "tensor"))[0],
        "fp8-channel": lambda x: quantize_fp8(x, "e5m2", fp8_scale(ref, "e5m2", "channel"))[0],
        "bfp8": lambda x: quantize_bfp(x, 8, 8),
        "bfp4": lambda x: quantize_bfp(x, 4, 8),
        "dense-f32": lambda x: blockattn.Dense(x.float()),
        "dense-bf16": lambda x: blockattn.Dense(x.bfloat16()),
        "dense-f16": lambda x: blockattn.Dense(x.half()),
    }


FORMATS = list(_formats(torch.zeros(1, 1, 1, D)))
PIECES = [12, 4, 20, 8, 4, 12]  # multiples of every channel-axis group above; 60 tokens


def _runs(fmt: str, k: torch.Tensor, v: torch.Tensor, residual: int) -> tuple[blockattn.TokenRun, ...]:
    runs = []
    for x in (k, v):
        enc, parts, at = _formats(x)[fmt], [], 0
        for n in PIECES:
            parts.append(enc(x[..., at:at + n, :]))
            at += n
        if residual:  # a dense residual after the codes, as KIVI's stores hold
            parts.append(blockattn.Dense(x[..., :residual, :].to(torch.bfloat16)))
        runs.append(blockattn.TokenRun(parts, x.shape[1]))
    return tuple(runs)


def _both(monkeypatch, query, keys, values, mask, scaling=0.25):
    monkeypatch.setenv("KVBENCH_FUSED", "0")
    ref = blockattn.attend(query, keys, values, mask, scaling)
    monkeypatch.setenv("KVBENCH_FUSED", "1")
    calls = []
    real = fused._kernel().attend
    monkeypatch.setattr(fused, "_kernel", lambda: type("M", (), {"attend": staticmethod(
        lambda *a: calls.append(1) or real(*a))}))
    out = blockattn.attend(query, keys, values, mask, scaling)
    assert calls, "the fused kernel did not run"
    return out, ref


def _mask(kind: str, b: int, hq: int, q: int, n: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    visible = torch.rand(b, hq, q, n, generator=g) > 0.3
    visible[..., -1] = True  # every query sees a token
    visible[0, :, :, :5] = False  # left padding of row 0
    if kind == "bool":
        return visible
    return torch.where(visible, torch.randn(b, hq, q, n, generator=g) * 0.1, float("-inf"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mask", ["none", "bool", "additive"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_fused_equals_blocks(monkeypatch, reader, fmt, mask, q_len):
    monkeypatch.setattr(fused, "CHUNK_TOKENS", 7)  # chunks straddle pieces; the last chunk is short
    g = torch.Generator().manual_seed(hash((fmt, mask, q_len)) % 2**31)
    b, hkv, group = 2, 2, 3
    k, v = (torch.randn(b, hkv, sum(PIECES), D, generator=g).to(torch.bfloat16) for _ in range(2))
    keys, values = _runs(fmt, k, v, residual=5)
    query = torch.randn(b, hkv * group, q_len, D, generator=g).to(torch.bfloat16)
    m = _mask(mask, b, hkv * group, q_len, keys.num_tokens, g)
    out, ref = _both(monkeypatch, query, keys, values, m)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)  # bfloat16 outputs: one ulp
    # In float32 the two readers differ only in the order of float32 sums.
    out32, ref32 = _both(monkeypatch, query.float(), keys, values, m)
    torch.testing.assert_close(out32, ref32, atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), chunk=st.integers(1, 64),
       group=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16), which=st.sampled_from(READERS))
def test_fused_int8_any_pieces_and_chunks(lengths, chunk, group, seed, which):
    """int8 (the headline format) over any cut into pieces and any chunk size equals the blocks (at D = 16 the
    vector reader decodes int8 rows to floats: its integer path needs 32 channels)."""
    fused.choose(which)
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    k, v = (torch.randn(1, 2, n, D, generator=g) * 3 for _ in range(2))
    runs = []
    for x in (k, v):
        parts, at = [], 0
        for m in lengths:
            parts.append(quantize_int8(x[..., at:at + m, :], D, "token"))
            at += m
        runs.append(blockattn.TokenRun(parts, 2))
    qg = torch.randn(1, 2, group, D, generator=g)
    old = fused.CHUNK_TOKENS
    fused.CHUNK_TOKENS = chunk
    try:
        out = fused.attend(qg, runs[0].fused(), runs[1].fused(), None, 1, 0.3)
    finally:
        fused.CHUNK_TOKENS = old
        fused.choose("auto")
    assert out is not None
    # The reference: dequantize, then one softmax over all tokens.
    kd = torch.cat([p.dequantize(torch.float32) for p in runs[0].parts], -2)
    vd = torch.cat([p.dequantize(torch.float32) for p in runs[1].parts], -2)
    ref = torch.softmax(qg @ kd.transpose(-1, -2) * 0.3, -1) @ vd
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_long_queries_and_undescribed_parts_read_blocks():
    """More query rows than the kernel takes, or a part without a description, go to the blocks."""
    k = torch.randn(1, 1, 8, D)
    run = blockattn.TokenRun([quantize_int8(k, D, "token")], 1)
    wide = torch.randn(1, 1, fused.MAX_ROWS + 1, D)
    assert fused.attend(wide, run.fused(), run.fused(), None, fused.MAX_ROWS + 1, 1.0) is None

    class Opaque:
        num_tokens = 8

    assert blockattn.TokenRun([Opaque()], 1).fused() is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_narrower_than_keys_read_blocks(fmt):
    """Value rows narrower than key rows (MiMo-V2-Flash: 192 and 128): every format's description names its width
    (codes packed several to a byte included), and the kernel, which reads every row at the query's width, leaves
    such a step to the blocks."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, sum(PIECES), 2 * D, generator=g), torch.randn(1, 2, sum(PIECES), D, generator=g)
    keys, values = _runs(fmt, k, v, residual=5)
    fk, fv = keys.fused(), values.fused()
    assert fk is not None and fv is not None
    assert {p.width for p in fk} == {2 * D} and {p.width for p in fv} == {D}
    qg = torch.randn(1, 2, 3, 2 * D, generator=g)
    assert fused.attend(qg, fk, fk, None, 1, 0.25) is not None  # the same parts at the query's width: the kernel
    assert fused.attend(qg, fk, fv, None, 1, 0.25) is None
    out = blockattn.attend(qg.reshape(1, 6, 1, 2 * D), keys, values, None, 0.25)
    assert out.shape == (1, 6, 1, D)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 6), group=st.sampled_from([4, 8, 16]), scale=st.floats(1e-6, 1e4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_native_int8_quantizer_is_bit_identical(tokens, group, scale, dtype, seed):
    """The C++ token-axis int8 quantizer gives the PyTorch one's codes and scales bit for bit, zeros, ties and
    float16-rounded scales included."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 3, tokens, D, generator=g) * scale).to(dtype)
    if tokens:
        x[0, 0, 0, :group] = 0  # an all-zero group: scale 0, codes 0
        x[1, 2, -1, 0] = x[1, 2, -1].abs().max() * 0.5  # a code at a tie before rounding, often
    assert fused.native() is not None
    native = quantize_int8(x, group, "token")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_FUSED", "0")
        ref = quantize_int8(x, group, "token")
    assert torch.equal(native.codes, ref.codes) and torch.equal(native.scales, ref.scales)
    assert native.scales.shape == ref.scales.shape and native.codes.dtype == ref.codes.dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e9])
def test_native_int8_quantizer_refuses_what_the_reference_refuses(monkeypatch, bad):
    from kvbench.errors import KVBenchError

    x = torch.ones(1, 1, 2, D)
    x[0, 0, 1, 3] = bad
    messages = []
    for flag in ("1", "0"):
        monkeypatch.setenv("KVBENCH_FUSED", flag)
        with pytest.raises(KVBenchError) as err:
            quantize_int8(x, D, "token")
        messages.append(str(err.value))
    assert messages[0] == messages[1]


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 5), block=st.sampled_from([4, 8, 16]), scale=st.floats(1e-30, 1e30),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_native_bfp8_quantizer_is_bit_identical(tokens, block, scale, dtype, seed):
    """8-bit block floating point: mantissas and exponents as the PyTorch quantizer gives them, across the E8M0
    range (tiny and huge blocks, all-zero blocks, ties)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 2, tokens, D, generator=g) * scale).to(dtype)
    if tokens:
        x[0, 0, 0, :block] = 0
        x[1, 1, -1, :2] = torch.tensor([64.5, -0.5]).to(dtype)  # mantissas at exact halves
    assert fused.native() is not None
    native = quantize_bfp(x, 8, block)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_FUSED", "0")
        ref = quantize_bfp(x, 8, block)
    assert torch.equal(native.mantissas, ref.mantissas) and torch.equal(native.exponents, ref.exponents)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 5), fmt=st.sampled_from(["e4m3", "e5m2"]), mode=st.sampled_from(["tensor", "channel"]),
       spread=st.floats(0.01, 100), seed=st.integers(0, 2**16))
def test_native_fp8_encoder_is_bit_identical(tokens, fmt, mode, spread, seed):
    """FP8 payloads and saturation counts as the PyTorch encoder gives them, scales calibrated on other tokens
    (so later tokens saturate)."""
    g = torch.Generator().manual_seed(seed)
    calib = torch.randn(2, 2, 4, D, generator=g)
    scale = fp8_scale(calib, fmt, mode)
    x = torch.randn(2, 2, tokens, D, generator=g) * spread
    native = quantize_fp8(x, fmt, scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_FUSED", "0")
        ref = quantize_fp8(x, fmt, scale)
    assert native[1] == ref[1]
    assert torch.equal(native[0].payload.view(torch.uint8), ref[0].payload.view(torch.uint8))


def _packed_integer_path(fmt: str, head_dim: int) -> bool:
    """Whether the vector reader reads this KIVI layout by integer dot products (its packed rows a whole number of
    16-byte pieces): keys by channel, values by token (the same format serves both in the test below)."""
    bits = {"int4": 4, "int2": 2}.get(fmt.split("-")[0])
    return bits is not None and head_dim * bits % 128 == 0


@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("fmt", ["int4-token", "int4-channel", "int2-token", "int2-channel", "bfp4", "bfp2"])
def test_packed_codes_at_real_head_widths(reader, fmt, head_dim):
    """Packed rows wide enough for the vector unpacking (16 bytes at a time) and a tail after it (96), decoded into
    floats (the vector reader's integer paths for KIVI's layouts are bounded by the tests below)."""
    if reader == "simd" and _packed_integer_path(fmt, head_dim):
        pytest.skip("the vector reader's integer path: test_simd_packed_integer_path_error_is_bounded")
    g = torch.Generator().manual_seed(head_dim)
    enc = {"int4-token": lambda x: quantize_asymmetric(x, 4, 32, "token"),
           "int4-channel": lambda x: quantize_asymmetric(x, 4, 8, "channel"),
           "int2-token": lambda x: quantize_asymmetric(x, 2, 32, "token"),
           "int2-channel": lambda x: quantize_asymmetric(x, 2, 8, "channel"),
           "bfp4": lambda x: quantize_bfp(x, 4, 32), "bfp2": lambda x: quantize_bfp(x, 2, 32)}[fmt]
    k, v = (torch.randn(1, 2, 40, head_dim, generator=g) for _ in range(2))
    runs = [blockattn.TokenRun([enc(x[..., :32, :]), enc(x[..., 32:, :])], 2) for x in (k, v)]
    qg = torch.randn(1, 2, 3, head_dim, generator=g)
    out = fused.attend(qg, runs[0].fused(), runs[1].fused(), None, 1, 0.1)
    assert out is not None
    kd = torch.cat([p.dequantize(torch.float32) for p in runs[0].parts], -2)
    vd = torch.cat([p.dequantize(torch.float32) for p in runs[1].parts], -2)
    ref = torch.softmax(qg @ kd.transpose(-1, -2) * 0.1, -1) @ vd
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [48, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,q_len", [(1, 1), (3, 1), (5, 1), (3, 3)])
def test_dense_16bit_rows_at_real_head_widths(reader, head_dim, dtype, group, q_len):
    """Dense bfloat16 and float16 rows (full's cache; the vector reader reads them where they lie, 16 channels a
    load) at widths of 3, 4 and 8 such pieces, 1 to 9 query rows per KV head, chunks straddling pieces: float
    attention over the same rows, up to the order of float32 sums."""
    g = torch.Generator().manual_seed(head_dim * 7 + group)
    k, v = (torch.randn(2, 2, 75, head_dim, generator=g).to(dtype) for _ in range(2))
    runs = [blockattn.TokenRun([blockattn.Dense(x[..., :40, :]), blockattn.Dense(x[..., 40:, :])], 2) for x in (k, v)]
    qg = torch.randn(2, 2, group * q_len, head_dim, generator=g)
    out = fused.attend(qg, runs[0].fused(), runs[1].fused(), None, q_len, 0.1)
    assert out is not None
    ref = torch.softmax(qg @ k.float().transpose(-1, -2) * 0.1, -1) @ v.float()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def _int8_bound(qg: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor, scaling: float, levels: int,
                block: int) -> torch.Tensor:
    """The vector reader's integer path's error bound per output row: the query rounded to integers of at most
    ``levels`` per row moves a score by at most scaling * max|q| / (2 levels) * sum|k| (delta), which moves the
    softmax's output by at most (exp(2 delta) - 1) * max|v|; each block's weights rounded to 7 bits of its largest
    move it by at most block * max|v| / 254 (each token by half a step of the block's largest weight, over a
    softmax sum at least that weight)."""
    qmax = qg.abs().amax(-1, keepdim=True)  # [b, h, rows, 1]
    delta = scaling * qmax / (2 * levels) * kd.abs().sum(-1).amax(-1)[..., None, None]
    vmax = vd.abs().amax((-1, -2))[..., None, None]
    return (torch.exp(2 * delta) - 1) * vmax + block * vmax / 254


# 64 and 128 channels take the 64-channel vectors where the build has AVX-512 VNNI, 96 the 32-channel ones
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("mask", ["none", "additive"])
@pytest.mark.parametrize("lengths,chunk", [([256, 256], 256), ([100, 37, 200, 3], 64), ([5], 256)])
def test_simd_int8_integer_path_error_is_bounded(head_dim, mask, lengths, chunk):
    """int8 keys scored by integer dot products against an int8 query, int8 values summed against 15-bit
    weights: within the bound above of float attention over the dequantized cache, and far inside it in
    practice (measured here: the error relative to max|v|)."""
    fused.choose("simd")
    if not fused.available():
        pytest.skip("the simd kernel could not be built here")
    g = torch.Generator().manual_seed(head_dim + len(lengths))
    n, hkv, group = sum(lengths), 2, 4
    k, v = (torch.randn(2, hkv, n, head_dim, generator=g) for _ in range(2))
    runs = []
    for x in (k, v):
        parts, at = [], 0
        for m in lengths:
            parts.append(quantize_int8(x[..., at:at + m, :], head_dim, "token"))
            at += m
        runs.append(blockattn.TokenRun(parts, hkv))
    qg = torch.randn(2, hkv, group, head_dim, generator=g)  # logits of unit spread, as a trained model's
    m = None
    if mask == "additive":
        visible = torch.rand(2, hkv, group, 1, n, generator=g) > 0.3
        visible[..., -1] = True
        m = torch.where(visible, torch.randn(visible.shape, generator=g) * 0.1, float("-inf"))
    scaling = head_dim ** -0.5
    old = fused.CHUNK_TOKENS
    fused.CHUNK_TOKENS = chunk
    try:
        out = fused.attend(qg, runs[0].fused(), runs[1].fused(), m, 1, scaling)
    finally:
        fused.CHUNK_TOKENS = old
        fused.choose("auto")
    assert out is not None
    kd = torch.cat([p.dequantize(torch.float32) for p in runs[0].parts], -2)
    vd = torch.cat([p.dequantize(torch.float32) for p in runs[1].parts], -2)
    logits = qg @ kd.transpose(-1, -2) * scaling
    if m is not None:
        logits = logits + m.reshape(2, hkv, group, n)
    ref = torch.softmax(logits, -1) @ vd
    err = (out - ref).abs().amax(-1, keepdim=True)
    assert (err <= _int8_bound(qg, kd, vd, scaling, fused._simd().query_levels(), 32)).all()
    # measured (AVX2: a 6-bit query, 7-bit weights per 32 tokens): 0.08-0.14% of max|v| over 256 tokens and more,
    # 0.7% over 5 tokens (one peaked block)
    assert err.max() / vd.abs().max() < 1e-2
    assert not torch.equal(out, ref)  # the integer path ran (float attention would agree to rounding only)


def _kivi_parts(x: torch.Tensor, bits: int, group: int, axis: str, lengths: list[int]) -> list:
    parts, at = [], 0
    for n in lengths:
        parts.append(quantize_asymmetric(x[..., at:at + n, :], bits, group, axis))
        at += n
    return parts


def _token_meta(part, field: str) -> torch.Tensor:
    """A KIVI part's scale or zero point as one row per token: [b, h, tokens, head_dim] (keys, channel-axis groups
    of part.group_size tokens) or [b, h, tokens, head_dim / group] (values, token-axis groups)."""
    m = getattr(part, field).float()
    if part.axis == "channel":  # [b, h, tokens / group, 1, d]
        return m.squeeze(-2).repeat_interleave(part.group_size, -2)
    return m.squeeze(-1)  # [b, h, tokens, d / group, 1]


def _packed_bound(qg, key_parts, value_parts, vd, scaling: float, levels: int, block: int = 32) -> torch.Tensor:
    """The packed (KIVI int4 / int2) integer path's error bound per output row, from its two roundings, each
    centred on the mid-range code mid = (2^bits - 1) / 2 (the rounding's sum times mid is added back exactly):
    - keys: per token group the query folded with the scales, q'_c = q_c s_c, rounded to integers of a step
      a = max|q'| / levels, so a score moves by at most scaling * a / 2 * sum_c |code_tc - mid| (delta, the
      largest over tokens), and the softmax output by at most (exp(2 delta) - 1) * max|v|;
    - values: per block and channel group the weights p_t s_tg rounded to 7-bit steps of the block's largest
      (at most max_t p_t * max s), so an output moves by at most block * mid * max s / (2 levels) (each token by
      half a step times |code - mid| <= mid, over a softmax sum of at least each block's largest p)."""
    bits = key_parts[0].bits
    mid = (2**bits - 1) / 2
    codes = torch.cat([unpack_codes(p.codes, bits).float() for p in key_parts], -2)  # [b, h, n, d]
    s = torch.cat([_token_meta(p, "scale") for p in key_parts], -2)
    step = (qg[..., :, None, :] * s[..., None, :, :]).abs().amax(-1) / levels  # [b, h, rows, n]
    delta = (scaling * step / 2 * (codes - mid).abs().sum(-1)[..., None, :]).amax(-1, keepdim=True)
    vmax = vd.abs().amax((-1, -2))[..., None, None]
    smax = torch.cat([_token_meta(p, "scale") for p in value_parts], -2).amax((-1, -2))[..., None, None]
    return (torch.exp(2 * delta) - 1) * vmax + block * mid * smax / (2 * levels) + 1e-5


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 96, 192])
@pytest.mark.parametrize("lengths,chunk,key_group", [([256, 256], 256, 32), ([96, 32, 160], 36, 32),
                                                      ([40, 24], 20, 8)])
def test_simd_packed_integer_path_error_is_bounded(bits, head_dim, lengths, chunk, key_group):
    """KIVI's int4 / int2 (keys by channel in groups of tokens, values by token in groups of 32 channels, a dense
    residual after them) read by the vector reader's integer path: within _packed_bound of float attention over
    the dequantized cache, within a measured tolerance far below it, and distinguishable from wrong readings.
    Chunks of 36 and 20 tokens start blocks inside key groups (sub-blocks that straddle two groups)."""
    fused.choose("simd")
    if not fused.available():
        pytest.skip("the simd kernel could not be built here")
    g = torch.Generator().manual_seed(head_dim * bits + len(lengths))
    n, hkv, group, residual = sum(lengths), 2, 4, 5
    k, v = (torch.randn(2, hkv, n + residual, head_dim, generator=g) for _ in range(2))
    kparts = _kivi_parts(k, bits, key_group, "channel", lengths)
    vparts = _kivi_parts(v, bits, 32, "token", lengths)
    dense = [blockattn.Dense(x[..., n:, :].to(torch.bfloat16)) for x in (k, v)]  # KIVI's full-precision residual
    keys, values = (blockattn.TokenRun([*ps, d], hkv) for ps, d in ((kparts, dense[0]), (vparts, dense[1])))
    qg = torch.randn(2, hkv, group, head_dim, generator=g)
    scaling = head_dim ** -0.5
    old = fused.CHUNK_TOKENS
    fused.CHUNK_TOKENS = chunk
    try:
        out = fused.attend(qg, keys.fused(), values.fused(), None, 1, scaling)
    finally:
        fused.CHUNK_TOKENS = old
        fused.choose("auto")
    assert out is not None

    def reference(kd: torch.Tensor, vd: torch.Tensor) -> torch.Tensor:
        return torch.softmax(qg @ kd.transpose(-1, -2) * scaling, -1) @ vd

    kd, vd = (torch.cat([*(p.dequantize(torch.float32) for p in ps), d.x.float()], -2)
              for ps, d in ((kparts, dense[0]), (vparts, dense[1])))
    err = (out - reference(kd, vd)).abs().amax(-1, keepdim=True)
    integer = head_dim * bits % 128 == 0  # rows of whole 16-byte pieces; other widths decode into floats
    if not integer:
        assert err.max() < 1e-5
        return
    assert (err <= _packed_bound(qg, kparts, vparts, vd, scaling, fused._simd().packed_levels())).all()
    # measured (AVX2, 7-bit query and weights): 0.07-0.17% of max|v| over 512 tokens, up to 0.6% over 64 (peaked
    # blocks); float decoding agrees to ~1e-7. The slips below miss by 6-56% of max|v|.
    tol = 1e-2 * vd.abs().max()
    assert 1e-5 < err.max() < tol
    # Readings a slip in the layout would give are far outside the tolerance: each code's two nibbles (or crumbs)
    # swapped, the value zero points dropped, each key token scaled with the next token group's scales.
    swap = torch.arange(head_dim).view(-1, 2).flip(-1).flatten()
    wrong = {
        "codes swapped": reference(kd[..., swap], vd[..., swap]),
        "value zeros dropped": reference(kd, torch.cat([p.dequantize(torch.float32) - _token_meta(p, "zero")
                                                        .repeat_interleave(32, -1) for p in vparts] + [vd[..., n:, :]],
                                                       -2)),
        "key groups shifted": reference(kd.roll(key_group, -2), vd),
    }
    for name, w in wrong.items():
        assert (out - w).abs().max() > 2 * tol, name


def test_reader_choice_is_validated_and_named():
    with pytest.raises(ValueError, match="valid: auto, simd, fused, blocks"):
        fused.choose("fastest")
    try:
        assert fused.choose("blocks") == "blocks" and fused.reader() == "blocks"
        assert fused.attend(torch.zeros(1, 1, 1, D), [], [], None, 1, 1.0) is None
        assert fused.choose("auto") == fused.DEFAULT_READER
        assert fused.reader() == fused.READERS[fused.DEFAULT_READER]
    finally:
        fused.choose("auto")


def test_simd_build_holds_its_prefetches(disassembly):
    """The vector reader's prefetch of the next block is in its object: GCC 12 once left an ``_mm_prefetch`` loop
    out of this file without a word, and the reader then waited on memory (docs/throughput.md)."""
    mod = fused._simd()
    if mod is None or mod.isa().startswith("scalar"):
        pytest.skip("no vector build here")
    assert "prefetcht0" in disassembly(mod)


ROW_FORMATS = [*FORMATS, "int8-token-64"]


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 10), min_size=1, max_size=3), min_size=1, max_size=4),
       fmt=st.sampled_from(ROW_FORMATS), chunk=st.integers(1, 64), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_rows_in_one_call_equal_each_row_alone(rows, fmt, chunk, group, seed):
    """``fused.attend_rows`` (a batch of sequences' decode step, each row over its own parts, one kernel call)
    gives each row exactly what ``fused.attend`` gives it alone, bit for bit, for every format the stores hold (at
    64 channels int8 takes the integer path), rows of different lengths and pieces (an empty row included), any
    chunk size; the first kernel, kept for its runs, has no such call and says so (``None``)."""
    d = 64 if fmt == "int8-token-64" else D
    enc = (lambda x: quantize_int8(x, 64, "token")) if d == 64 else None
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(len(rows), 2, group, d, generator=g)
    keys, values = [], []
    for lengths in rows:
        lengths = [4 * m for m in lengths]  # whole channel-axis groups
        n = sum(lengths)
        k, v = (torch.randn(1, 2, n, d, generator=g) * 2 for _ in range(2))
        for x, out in ((k, keys), (v, values)):
            code, parts, at = enc or _formats(x)[fmt], [], 0
            for m in lengths:
                if m:
                    parts.append(code(x[..., at:at + m, :]).fused())
                at += m
            out.append(parts)
    old = fused.CHUNK_TOKENS
    fused.CHUNK_TOKENS = chunk
    try:
        fused.choose("fused")
        assert fused.attend_rows(qg, keys, values, 1, 0.3) is None
        fused.choose("simd")
        if not fused.available():
            pytest.skip("the simd kernel could not be built here")
        together = fused.attend_rows(qg, keys, values, 1, 0.3)
        alone = [fused.attend(qg[r:r + 1], keys[r], values[r], None, 1, 0.3) for r in range(len(rows))]
    finally:
        fused.CHUNK_TOKENS = old
        fused.choose("auto")
    assert together is not None and together.shape == (len(rows), 2, group, d)
    for r, one in enumerate(alone):
        assert one is not None
        # bit for bit (an empty row's 0 / 0 included)
        torch.testing.assert_close(together[r], one[0], rtol=0, atol=0, equal_nan=True)


def test_rows_in_one_call_refuse_parts_of_a_batch():
    """Each row's parts are of batch 1 (a row is one sequence): a part of two is refused by the kernel, not read
    at the wrong row."""
    fused.choose("simd")
    try:
        mod = fused._kernel()
        if mod is None:
            pytest.skip("the simd kernel could not be built here")
        part = blockattn.Dense(torch.randn(2, 1, 4, D)).fused()
        kt, ki = fused.flatten([part])
        with pytest.raises(RuntimeError, match="every part is of batch 1"):
            mod.attend_rows(torch.randn(1, 1, 1, D), kt, ki, kt, ki, [1], [1], [-1], [-1], 1, 0.3, 16)
        with pytest.raises(RuntimeError, match="more parts named than given"):
            mod.attend_rows(torch.randn(1, 1, 1, D), kt, ki, kt, ki, [2], [1], [-1], [-1], 1, 0.3, 16)
        one, oi = fused.flatten([blockattn.Dense(torch.randn(1, 1, 4, D)).fused()])
        with pytest.raises(RuntimeError, match="parts given but not named"):
            mod.attend_rows(torch.randn(1, 1, 1, D), one + one, oi + oi, one, oi, [1], [1], [-1, -1], [-1], 1, 0.3,
                            16)
        with pytest.raises(RuntimeError, match="one token count per part"):
            mod.attend_rows(torch.randn(1, 1, 1, D), one, oi, one, oi, [1], [1], [], [-1], 1, 0.3, 16)
        with pytest.raises(RuntimeError, match="exceeds the tokens its data holds"):
            mod.attend_rows(torch.randn(1, 1, 1, D), one, oi, one, oi, [1], [1], [5], [5], 1, 0.3, 16)
    finally:
        fused.choose("auto")


@pytest.mark.parametrize("fmt", ["dense", "int8"])
def test_rows_read_a_part_up_to_its_count(fmt):
    """A part read up to its first tokens (``Fused.upto``: a store's open tail, its reserve filled that far) gives
    what the part cut to those tokens gives, bit for bit, in one call for several rows and in the single call."""
    fused.choose("simd")
    try:
        if fused._kernel() is None or not hasattr(fused._kernel(), "attend_rows"):
            pytest.skip("the simd kernel could not be built here")
        torch.manual_seed(0)
        rows, filled = 3, [5, 1, 17]
        def part(x):
            if fmt == "dense":
                return blockattn.Dense(x).fused()
            return quantize_int8(x, D, "token").fused()
        whole = [(part(torch.randn(1, 2, 300, D)), part(torch.randn(1, 2, 300, D)),
                  part(torch.randn(1, 2, 32, D)), part(torch.randn(1, 2, 32, D))) for _ in range(rows)]
        q = torch.randn(rows, 2, 3, D)
        capped = fused.attend_rows(q, [[k, t.upto(n)] for (k, _, t, _), n in zip(whole, filled, strict=True)],
                                   [[v, u.upto(n)] for (_, v, _, u), n in zip(whole, filled, strict=True)], 1, 0.125)
        cut = fused.attend_rows(q, [[k, t.head(n)] for (k, _, t, _), n in zip(whole, filled, strict=True)],
                                [[v, u.head(n)] for (_, v, _, u), n in zip(whole, filled, strict=True)], 1, 0.125)
        assert capped is not None and torch.equal(capped, cut)
        k, v, t, u = whole[0]
        one = fused.attend(q[:1], [k, t.upto(filled[0])], [v, u.upto(filled[0])], None, 1, 0.125)
        assert one is not None and torch.equal(one, cut[:1])
    finally:
        fused.choose("auto")
