"""Quantization strategies: measured bytes against the bit budget, cache/generate integration, capture-path
equivalence, token dropping, decode-time rolling of the residual window, and the ThinK channel score."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvbench.strategies._quantstore import TAIL_TOKENS
from kvbench.strategies.base import LayerCapture, held_bytes

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.quantizers import gather_tokens, quantize_asymmetric

QUANT = ["int8", "int4", "int2", "fp8", "bfp", "channel_sparse", "hf_quantized"]
CONF = Path(__file__).resolve().parents[1] / "conf" / "strategy"

# (name, params) run on the tiny model (head_dim 16): defaults plus settings that exercise every code path,
# KIVI with small groups and window so the residual rolls within a short generation.
TINY_CASES = [
    ("int8", {}), ("int8", {"axis": "channel", "group_size": 16}),
    ("int4", {}), ("int4", {"group_size": 8, "residual_length": 16}),
    ("int2", {"group_size": 8, "residual_length": 16}),
    ("fp8", {}), ("fp8", {"format": "e5m2", "scale": "channel"}),
    ("bfp", {}), ("bfp", {"mantissa_bits": 4, "block_size": 8}),
    ("channel_sparse", {}), ("channel_sparse", {"mode": "outlier"}),
    ("hf_quantized", {"group_size": 16, "residual_length": 8}),
    ("hf_quantized",
     {"backend": "hqq", "group_size": 16, "residual_length": 8, "axis_key": 1, "axis_value": 1}),
]


def _build(name: str, params: dict | None = None):
    if name == "hf_quantized":
        backend = (params or {}).get("backend", "quanto")
        pytest.importorskip("optimum.quanto" if backend == "quanto" else "hqq")
    return strategies.build(name, params)


def _case_id(case: tuple[str, dict]) -> str:
    name, params = case
    return name + "".join(f"-{k}={v}" for k, v in params.items())


def _kv(tokens: int, heads: int = 3, dim: int = 64, seed: int = 0, dtype=torch.bfloat16):
    """K/V shaped like SmolLM2's ([1, 3, T, 64]), with key channel outliers as in real models."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, tokens, dim, generator=g)
    k[..., :: dim // 4] *= 8  # a few outlier channels (KIVI's observation about keys)
    v = torch.randn(1, heads, tokens, dim, generator=g)
    return k.to(dtype), v.to(dtype)


def _synthetic_cache(name: str, params: dict, tokens: int, decode: int = 0, layers: int = 2, heads: int = 3,
                     dim: int = 64) -> KVBenchCache:
    """A cache from a synthetic bf16 prefill of ``tokens`` tokens, then ``decode`` single-token steps."""
    strategy = _build(name, params)
    k, v = _kv(tokens, heads, dim)
    q = torch.randn(1, heads * 3, 8, dim).to(torch.bfloat16)
    caps = [LayerCapture(layer_idx=i, num_kv_groups=3, scaling=dim**-0.5, queries=q) for i in range(layers)]
    cache = KVBenchCache.from_capture(strategy, SimpleNamespace(num_hidden_layers=layers), [k] * layers,
                                      [v] * layers, caps)
    for step in range(decode):
        nk, nv = _kv(1, heads, dim, seed=100 + step)
        for layer in cache.layers:
            layer.update(nk, nv)
    return cache


# -- registry, config, validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANT)
def test_registered_with_yaml_defaults(name: str) -> None:
    from omegaconf import OmegaConf

    from kvbench.config import compose_config  # generated from the dataclass; the YAML only points at it

    cls = strategies.strategy_class(name)
    conf = OmegaConf.to_container(compose_config([f"strategy={name}"]).strategy)
    assert conf.pop("name") == name
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    assert conf == defaults
    assert cls.family in ("quantization", "reference")


@pytest.mark.parametrize("name, params, needle", [
    ("int8", {"axis": "head"}, "int8.axis must be one of token, channel"),
    ("int8", {"group_size": 12}, "int8.group_size must be one of"),
    ("int4", {"group_size": 0}, "int4.group_size must be one of"),
    ("int2", {"residual_length": -1}, "int2.residual_length must be an integer >= 0"),
    ("fp8", {"format": "e3m4"}, "fp8.format must be one of e4m3, e5m2"),
    ("fp8", {"scale": "block"}, "fp8.scale must be one of tensor, channel"),
    ("bfp", {"mantissa_bits": 6}, "bfp.mantissa_bits must be one of 4, 8"),
    ("bfp", {"block_size": 33}, "bfp.block_size must be one of"),
    ("channel_sparse", {"mode": "drop"}, "channel_sparse.mode must be one of prune, outlier"),
    ("channel_sparse", {"keep_ratio": 0.0}, "keep_ratio must be in"),
    ("channel_sparse", {"outlier_bits": 2}, "outlier_bits must be one of 4, 8"),
    ("hf_quantized", {"backend": "bnb"}, "hf_quantized.backend must be one of quanto, hqq"),
    ("hf_quantized", {"nbits": 8}, "nbits for backend quanto must be one of 2, 4"),
    ("hf_quantized", {"axis_key": -1}, "axis_key for backend quanto must be one of 0 "),
    ("hf_quantized", {"backend": "hqq", "nbits": 3}, "nbits for backend hqq must be one of 2, 4, 8"),
])
def test_bad_parameters_are_one_line_errors(name: str, params: dict, needle: str) -> None:
    with pytest.raises(KVBenchError, match=needle) as err:
        strategies.build(name, params)
    assert "\n" not in str(err.value)


def test_missing_backend_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbench.strategies.hf_quantized as hf

    monkeypatch.setattr(hf, "backend_available", lambda backend: False)
    with pytest.raises(KVBenchError, match=r"pip install --no-deps optimum-quanto"):
        strategies.build("hf_quantized")
    with pytest.raises(KVBenchError, match=r"pip install --no-deps hqq"):
        strategies.build("hf_quantized", {"backend": "hqq", "nbits": 4})


# -- measured bytes against the bit budget -------------------------------------------------------------------


def _expected_bytes(name: str, params: dict, t: int, h: int, d: int, decode: int) -> int:
    """Theoretical bytes of one layer holding ``t`` bf16 tokens, from the format's definition."""
    p = {f.name: f.default for f in dataclasses.fields(strategies.strategy_class(name))} | params
    kv = 2 * h * d  # elements of one token, K and V together
    if name == "int8":
        if p["axis"] == "token":
            return t * kv * 1 + t * 2 * h * (d // min(p["group_size"], d)) * 2
        tq = t // p["group_size"] * p["group_size"]
        return tq * kv + 2 * (tq // p["group_size"]) * h * d * 2 + (t - tq) * kv * 2
    if name in ("int4", "int2"):
        bits, g, r = (4 if name == "int4" else 2), p["group_size"], p["residual_length"]
        if p["residual_layout"] == "kivi":  # keys: all but the last T mod R; values: all but the last R
            unit = max(1, -(-r // g)) * g  # R rounded up to whole groups (KIVI itself needs R mod G = 0)
            tk, tv = t - t % unit, max(0, t - r)
        else:  # both: the oldest whole groups beyond the R newest
            tk = tv = max(0, (t - r) // g * g)
        key_meta = (tk // g) * h * d * 2 * 2  # scale + zero per channel per token group
        value_meta = tv * h * (d // min(g, d)) * 2 * 2  # scale + zero per token per channel group
        quantized = (tk + tv) * h * d * bits // 8 + key_meta + value_meta
        return quantized + (2 * t - tk - tv) * h * d * 2
    if name == "fp8":
        scales = 2 * 4 if p["scale"] == "tensor" else 2 * h * d * 4
        return t * kv + scales
    if name == "bfp":
        n = min(p["block_size"], d)
        return t * kv * p["mantissa_bits"] // 8 + t * 2 * h * (d // n)
    if name == "channel_sparse" and p["mode"] == "prune":
        k = d - int(d * (1 - p["keep_ratio"]) + 1e-6)
        pruned = max(0, (t if p["prune_decoded"] else t - decode) - p["recent_window"])
        return pruned * h * k * 2 + (t - pruned) * h * d * 2 + t * h * d * 2 + h * k * 2
    if name == "channel_sparse":
        k = math.ceil(p["outlier_ratio"] * d)  # d - k stays even for these ratios: no adjustment
        per_tensor = h * d * 2 + t * h * k * 2 + t * h * (d - k) * p["outlier_bits"] // 8 + t * h * 2 * 2
        return 2 * per_tensor
    if name == "hf_quantized":
        tq = t - decode  # the whole prefill is quantized; decoded tokens wait in the residual (decode < R)
        g = min(p["group_size"], d)
        return tq * kv * p["nbits"] // 8 + 2 * (tq * h * d // g) * 2 * 2 + decode * kv * 2
    raise AssertionError(name)


def _reserved_bytes(name: str, params: dict, h: int, d: int, decode: int) -> int:
    """Bytes of the slots reserved past the held tokens after ``decode`` single-token steps: a stream whose decode
    steps each quantize one token of a per-token format writes it into a tail of ``TAIL_TOKENS`` slots
    (``strategies/_quantstore.py``), so ``-decode mod TAIL_TOKENS`` slots are held empty, counted as ``full``'s
    reserve is. From the formats' flush rules: int8/bfp/fp8 quantize every token on arrival (int8's channel axis
    a group at a time; fp8's dense read, which these steps take, merges its pieces, tail included); KIVI's values
    flush one token per step (its window layout a group at a time)."""
    p = {f.name: f.default for f in dataclasses.fields(strategies.strategy_class(name))} | params
    spare = -decode % TAIL_TOKENS
    if name == "int8" and p["axis"] == "token":
        per_token = 2 * h * (d + 2 * (d // min(p["group_size"], d)))  # K and V: codes and float16 scales
    elif name == "bfp":
        per_token = 2 * h * (d * p["mantissa_bits"] // 8 + d // min(p["block_size"], d))
    elif name in ("int4", "int2") and p["residual_layout"] == "kivi":  # values only
        bits, g = (4 if name == "int4" else 2), min(p["group_size"], d)
        per_token = h * (d * bits // 8 + (d // g) * 2 * 2)
    else:
        return 0
    return spare * per_token


BYTE_CASES = [
    ("int8", {}), ("int8", {"group_size": 32}), ("int8", {"axis": "channel", "group_size": 32}),
    ("int4", {}), ("int4", {"group_size": 64, "residual_length": 64}), ("int2", {}),
    ("int4", {"group_size": 64, "residual_length": 32}), ("int2", {"group_size": 16, "residual_length": 40}),
    ("int4", {"group_size": 64, "residual_length": 32, "residual_layout": "window"}),
    ("int2", {"residual_layout": "window"}), ("int4", {"residual_length": 0}),
    ("fp8", {}), ("fp8", {"scale": "channel", "format": "e5m2"}),
    ("bfp", {}), ("bfp", {"mantissa_bits": 4, "block_size": 16}),
    ("channel_sparse", {}), ("channel_sparse", {"keep_ratio": 0.25}), ("channel_sparse", {"mode": "outlier"}),
    ("channel_sparse", {"keep_ratio": 0.6, "recent_window": 0, "prune_decoded": True}),
    ("channel_sparse", {"recent_window": 16, "prune_decoded": True}),
    ("channel_sparse", {"mode": "outlier", "outlier_bits": 8, "outlier_ratio": 0.125}),
    ("hf_quantized", {}), ("hf_quantized", {"nbits": 2, "group_size": 32}),
    ("hf_quantized", {"backend": "hqq", "axis_key": 1, "axis_value": 1}),
    ("hf_quantized", {"backend": "hqq", "nbits": 8}),
]


@pytest.mark.parametrize("case", BYTE_CASES, ids=_case_id)
def test_measured_bytes_match_the_bit_budget(case: tuple[str, dict]) -> None:
    """kv_bytes from tensor storage equals payload + metadata from the format's definition (within 1%)."""
    name, params = case
    prefill, decode = 230, 41  # decoding crosses KIVI group boundaries and flushes the residual
    cache = _synthetic_cache(name, params, prefill, decode=decode)
    t = prefill + decode
    assert cache.held_tokens() == [t, t] and cache.get_seq_length() == t
    want = 2 * (_expected_bytes(name, params, t, 3, 64, decode) + _reserved_bytes(name, params, 3, 64, decode))
    assert cache.kv_bytes() == pytest.approx(want, rel=0.01)
    assert cache.kv_bytes_fp16() == 2 * 2 * t * 3 * 64 * 2
    assert cache.stats()["bits_per_element"] == pytest.approx(8 * cache.kv_bytes() / (2 * 2 * t * 3 * 64))


def test_int4_reaches_its_bit_budget_at_4k() -> None:
    """The done criterion: 4096 tokens at SmolLM2's dims over 30 layers, KIVI defaults G=32, R=128.

    KIVI's layout: 4096 mod 128 = 0, so every key is quantized; the 128 newest values stay exact."""
    cache = _synthetic_cache("int4", {}, 4096, layers=30)
    reduction = 1 - cache.kv_bytes() / cache.kv_bytes_fp16()
    # keys: 4096 tokens at 4 + 32/32 bits; values: 3968 at 5 bits, 128 exact at 16 bits.
    assert reduction == pytest.approx(1 - (4096 * 5 + 3968 * 5 + 128 * 16) / (2 * 4096 * 16), abs=1e-6)
    assert round(100 * reduction, 1) == 67.7
    assert cache.stats()["quantized_fraction"] == pytest.approx((4096 + 3968) / (2 * 4096))


@pytest.mark.parametrize("name, params, reduction", [
    ("int8", {}, 1 - 8.25 / 16), ("int2", {}, 1 - (4096 * 3 + 3968 * 3 + 128 * 16) / (2 * 4096 * 16)),
    ("int4", {"residual_layout": "window"}, 1 - (3968 * 5 + 128 * 16) / (4096 * 16)),
    ("bfp", {}, 1 - 8.25 / 16), ("bfp", {"mantissa_bits": 4}, 1 - 4.25 / 16),
    # ThinK keeps the 32 newest keys whole: (4064 x 32 + 32 x 64 key columns + 4096 x 64 values) / (2 x 4096 x 64)
    ("fp8", {}, 0.5), ("channel_sparse", {}, 1 - (4064 * 32 + 32 * 64 + 4096 * 64) / (2 * 4096 * 64)),
    ("channel_sparse", {"recent_window": 0, "prune_decoded": True}, 0.25),
    ("channel_sparse", {"mode": "outlier"}, 1 - 5.25 / 16),
])
def test_reductions_at_4k(name: str, params: dict, reduction: float) -> None:
    cache = _synthetic_cache(name, params, 4096, layers=1)
    assert 1 - cache.kv_bytes() / cache.kv_bytes_fp16() == pytest.approx(reduction, abs=0.002)


# -- prefill safety ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TINY_CASES, ids=_case_id)
def test_prefill_leaves_inputs_alone_and_holds_no_view(case: tuple[str, dict]) -> None:
    name, params = case
    k, v = _kv(150, heads=2, dim=16)
    k0, v0 = k.clone(), v.clone()
    store = _build(name, params).new_layer(0, 1)
    q = torch.randn(1, 4, 8, 16).to(torch.bfloat16)
    store.prefill(k, v, LayerCapture(layer_idx=0, num_kv_groups=2, scaling=0.25, queries=q))
    store.append(*_kv(3, heads=2, dim=16, seed=5))
    assert torch.equal(k, k0) and torch.equal(v, v0)
    shared = {k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()}
    assert not shared & {t.untyped_storage().data_ptr() for t in store.tensors()}
    # never more than the dense bf16 cache of the same tokens
    assert held_bytes(store.tensors()) <= 2 * k.numel() * 2 * 153 / 150


@pytest.mark.parametrize("name", ["int8", "int4", "fp8", "bfp", "channel_sparse"])
def test_any_prefill_length_including_zero(name: str) -> None:
    """compose hands the quantizer whatever eviction kept: any token count must work, even none."""
    params = {"mode": "outlier"} if name == "channel_sparse" else {}
    for tokens in (0, 1, 7, 33):
        store = strategies.build(name, params).new_layer(0, 1)
        store.prefill(*_kv(tokens, heads=2, dim=16), None)
        assert store.num_tokens() == tokens
        k, v = store.append(*_kv(2, heads=2, dim=16, seed=9))
        assert k.shape == v.shape == (1, 2, tokens + 2, 16) and store.num_tokens() == tokens + 2


# -- decode-time behaviour -----------------------------------------------------------------------------------


def test_kivi_layout_exact_tokens_while_decoding() -> None:
    """KIVI's residual: the last T mod R keys and exactly the R newest values are exact after every step, and
    each step attends to its own token exactly (KIVI quantizes after attention)."""
    g, r = 8, 16
    store = strategies.build("int4", {"group_size": g, "residual_length": r}).new_layer(0, 1)
    k, v = _kv(30, heads=2, dim=16, dtype=torch.float32)
    store.prefill(k, v, None)
    assert store.qk.num_tokens == 16 and store.rk.shape[-2] == 14  # type: ignore[attr-defined]
    assert store.qv.num_tokens == 14 and store.rv.shape[-2] == 16  # type: ignore[attr-defined]
    seen_k, seen_v = [k], [v]
    for step in range(20):
        nk, nv = _kv(1, heads=2, dim=16, seed=50 + step, dtype=torch.float32)
        seen_k.append(nk)
        seen_v.append(nv)
        held = store.num_tokens()
        exact_k, exact_v = held % r + 1, min(held, r) + 1  # before this step's flush
        out_k, out_v = store.append(nk, nv)
        all_k, all_v = torch.cat(seen_k, dim=-2), torch.cat(seen_v, dim=-2)
        t = all_k.shape[-2]
        assert out_k.shape == all_k.shape
        assert torch.equal(out_k[..., t - exact_k:, :], all_k[..., t - exact_k:, :])
        assert torch.equal(out_v[..., t - exact_v:, :], all_v[..., t - exact_v:, :])
        assert not torch.equal(out_k[..., :t - exact_k, :], all_k[..., :t - exact_k, :])
        assert (out_k - all_k).abs().max() < 0.1 * all_k.abs().max()  # the rest within 4-bit error
        assert store.rk.shape[-2] == t % r and store.rv.shape[-2] == r  # type: ignore[attr-defined]
    assert store.num_tokens() == 50


def test_window_layout_rolls_a_group_at_a_time() -> None:
    """residual_layout=window (kvbench's earlier layout): R to R + G - 1 newest K and V exact."""
    params = {"group_size": 8, "residual_length": 16, "residual_layout": "window"}
    store = strategies.build("int4", params).new_layer(0, 1)
    k, v = _kv(30, heads=2, dim=16, dtype=torch.float32)
    store.prefill(k, v, None)
    assert store.qk.num_tokens == 8 and store.rk.shape[-2] == 22  # type: ignore[attr-defined]
    seen_k = [k]
    for step in range(20):
        nk, nv = _kv(1, heads=2, dim=16, seed=50 + step, dtype=torch.float32)
        seen_k.append(nk)
        out_k, _ = store.append(nk, nv)
        residual = store.rk.shape[-2]  # type: ignore[attr-defined]
        assert 16 <= residual < 24 and store.qk.num_tokens % 8 == 0  # type: ignore[attr-defined]
        all_k = torch.cat(seen_k, dim=-2)
        assert out_k.shape == all_k.shape
        assert torch.equal(out_k[..., -16:, :], all_k[..., -16:, :])  # the recent window is exact
        assert (out_k - all_k).abs().max() < 0.1 * all_k.abs().max()  # the rest within 4-bit error
    assert store.num_tokens() == 50


def test_decode_holds_few_pieces_and_merges_them_exactly() -> None:
    """Appending never copies the whole quantized chunk nor keeps a list of per-token chunks: pieces merge like a
    binary counter (O(log T) of them); merged, they are one chunk equal to quantizing every flush at once."""
    for name, params in [("int8", {}), ("int4", {"group_size": 8, "residual_length": 8}), ("bfp", {}),
                         ("fp8", {})]:
        store = strategies.build(name, params).new_layer(0, 1)
        store.prefill(*_kv(40, heads=2, dim=16), None)
        for step in range(300):
            store.append(*_kv(1, heads=2, dim=16, seed=step))
        tensors = list(store.tensors())
        per_piece = {"int8": 2, "bfp": 2, "int4": 3, "fp8": 2}[name]
        assert len(tensors) <= 2 * per_piece * 10 + 2  # log2(340) < 10 pieces per tensor, plus the residuals
        assert store.num_tokens() == 340
        merged_before = held_bytes(store.tensors())
        spare = (store.kc if name == "fp8" else store.ks.chunks).spare  # type: ignore[attr-defined]
        k = store.k if name == "fp8" else store.qk  # type: ignore[attr-defined]  # merges the pieces
        assert k.num_tokens == (340 if name != "int4" else 336)
        # Merging changes no byte but the keys' reserved tail slots (ChunkList), which it frees; fp8's dense read
        # merges at every step, int4's keys are grouped along channels.
        assert spare == (0 if name in ("fp8", "int4") else -300 % TAIL_TOKENS)
        per_token = held_bytes(k.tensors()) // k.num_tokens
        assert held_bytes(store.tensors()) == merged_before - spare * per_token


def test_fp8_scale_is_fixed_and_saturation_reported() -> None:
    store = strategies.build("fp8").new_layer(0, 1)
    k, v = _kv(20, heads=2, dim=16, dtype=torch.float32)
    store.prefill(k, v, None)
    scale = store.k.scale.clone()  # type: ignore[attr-defined]
    big = k[..., :1, :] * 100
    out_k, _ = store.append(big, v[..., :1, :])
    assert torch.equal(store.k.scale, scale)  # type: ignore[attr-defined]
    assert out_k[..., -1, :].abs().max() <= k.abs().max() * 1.0001  # clamped to the prefill's range
    assert store.stats()["saturated_fraction"] > 0.2


# -- token dropping (for compose) ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in TINY_CASES if c[0] != "hf_quantized"], ids=_case_id)
def test_select_tokens_keeps_exactly_the_chosen_tokens(case: tuple[str, dict]) -> None:
    name, params = case
    store = strategies.build(name, params).new_layer(0, 1)
    k, v = _kv(64, heads=2, dim=16, dtype=torch.float32)
    q = torch.randn(1, 4, 8, 16)
    store.prefill(k, v, LayerCapture(layer_idx=0, num_kv_groups=2, scaling=0.25, queries=q))
    before_k, before_v = store.append(*_kv(1, heads=2, dim=16, seed=3, dtype=torch.float32))
    before = held_bytes(store.tensors())
    g = torch.Generator().manual_seed(0)
    index = torch.stack([torch.sort(torch.randperm(65, generator=g)[:30]).values for _ in range(2)])[None]
    store.select_tokens(index)
    ragged = name in ("int4", "int2") or params.get("axis") == "channel"
    # Token-wise formats shrink in proportion; with groups spanning tokens, the kept tokens a head holds
    # beyond the smallest per-head quantized count move, dequantized, into the (16/32-bit) residual.
    assert store.num_tokens() == 30 and held_bytes(store.tensors()) < (0.8 if ragged else 0.6) * before
    after_k, after_v = store.append(*_kv(1, heads=2, dim=16, seed=4, dtype=torch.float32))
    # Nothing re-encoded: every kept token decodes to exactly the value attention saw before.
    assert torch.equal(after_k[..., :30, :], gather_tokens(before_k, index, -2))
    assert torch.equal(after_v[..., :30, :], gather_tokens(before_v, index, -2))


@pytest.mark.parametrize("name, params", [("int4", {"group_size": 8, "residual_length": 16}),
                                          ("int2", {"group_size": 8, "residual_length": 8}),
                                          ("int8", {"axis": "channel", "group_size": 8})])
def test_decode_time_eviction_never_re_rounds(name: str, params: dict) -> None:
    """compose may drop a token at every step: tokens keep the value of their one and only rounding."""
    store = strategies.build(name, params).new_layer(0, 1)
    k, v = _kv(60, heads=2, dim=16, dtype=torch.float32)
    original = {i: k[..., i, :] for i in range(60)}
    store.prefill(k, v, None)
    ids = list(range(60))  # original position of each held token
    frozen: dict[int, torch.Tensor] = {}
    for step in range(31):
        if step:
            drop = 4 + (step * 7) % (len(ids) - 8)  # the same token on every head, like streaming_llm
            store.select_tokens(torch.tensor([i for i in range(len(ids)) if i != drop]).expand(1, 2, -1))
            del ids[drop]
        nk, nv = _kv(1, heads=2, dim=16, seed=10 + step, dtype=torch.float32)
        original[60 + step] = nk[..., 0, :]
        ids.append(60 + step)
        before = 0 if store.qk is None else store.qk.num_tokens  # type: ignore[attr-defined]
        out_k, _ = store.append(nk, nv)
        # KIVI attends before it flushes: what this step quantized is read exactly one last time.
        quantized = before if store.attend_before_flush else store.qk.num_tokens  # type: ignore[attr-defined]
        for j, i in enumerate(ids):
            if j >= quantized:
                assert torch.equal(out_k[..., j, :], original[i])  # the residual is exact
            elif i in frozen:
                assert torch.equal(out_k[..., j, :], frozen[i]), (step, i)  # never rounded twice
            else:
                frozen[i] = out_k[..., j, :].clone()
    assert len(frozen) > 40
    assert store.num_tokens() == 61


def test_hf_quantized_cannot_drop_tokens() -> None:
    store = _build("hf_quantized", {"group_size": 16}).new_layer(0, 1)
    store.prefill(*_kv(8, heads=2, dim=16), None)
    with pytest.raises(KVBenchError, match="cannot drop individual tokens"):
        store.select_tokens(torch.zeros(1, 2, 3, dtype=torch.long))


# -- inside transformers: generate, and the shared-prefill path ----------------------------------------------


@pytest.mark.parametrize("case", TINY_CASES, ids=_case_id)
def test_generate_with_the_cache(tiny_model, tiny_ids, case: tuple[str, dict]) -> None:
    name, params = case
    cache = KVBenchCache(_build(name, params), tiny_model.config)
    with torch.inference_mode(), cache.attach(tiny_model):
        out = tiny_model.generate(tiny_ids, max_new_tokens=24, do_sample=False, cache=cache)
    assert out.shape == (1, tiny_ids.shape[1] + 24)
    t = tiny_ids.shape[1] + 23
    assert cache.get_seq_length() == t and cache.held_tokens() == [t, t]
    # float32 model: 32-bit residuals may exceed the 16-bit reference, never twice it
    assert 0 < cache.kv_bytes() <= 2 * cache.kv_bytes_fp16()


@pytest.mark.parametrize("case", TINY_CASES, ids=_case_id)
def test_capture_path_equals_normal_forward(tiny_model, tiny_ids, case: tuple[str, dict]) -> None:
    """from_capture (the engine's shared prefill) and a plain forward build the same cache: same logits."""
    name, params = case
    prefix, question = tiny_ids[:, :80], tiny_ids[:, 80:]
    with torch.inference_mode():
        normal = KVBenchCache(_build(name, params), tiny_model.config)
        with normal.attach(tiny_model):
            tiny_model(input_ids=prefix, cache=normal, use_cache=True)
            want = tiny_model(input_ids=question, cache=normal, use_cache=True).logits
        strategy = _build(name, params)
        full = KVBenchCache(strategies.build("full"), tiny_model.config)
        with QueryRecorder(tiny_model, strategy.query_window) as rec:
            tiny_model(input_ids=prefix, cache=full, use_cache=True)
        keys = [layer.store.keys for layer in full.layers]
        values = [layer.store.values for layer in full.layers]
        captured = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values, rec.captures)
        got = tiny_model(input_ids=question, cache=captured, use_cache=True).logits
    assert torch.equal(want, got)
    assert captured.kv_bytes() == normal.kv_bytes()


@pytest.mark.parametrize("name, params, tol", [
    ("int8", {}, 0.01), ("fp8", {}, 0.03), ("bfp", {}, 0.01),
    ("int4", {"group_size": 8, "residual_length": 8}, 0.05),
    ("channel_sparse", {"mode": "outlier"}, 0.05), ("channel_sparse", {"keep_ratio": 0.75}, 0.1),
])
def test_logits_stay_close_to_full(tiny_model, tiny_ids, name: str, params: dict, tol: float) -> None:
    with torch.inference_mode():
        ref = tiny_model(input_ids=tiny_ids).logits[:, -8:]
        cache = KVBenchCache(strategies.build(name, params), tiny_model.config)
        with cache.attach(tiny_model):
            tiny_model(input_ids=tiny_ids[:, :-8], cache=cache, use_cache=True)
            got = tiny_model(input_ids=tiny_ids[:, -8:], cache=cache, use_cache=True).logits
    assert (got - ref).abs().max() < tol * ref.abs().max()


def test_error_falls_with_bits_and_kivi_key_axis_wins() -> None:
    """Measured reconstruction error orders int2 > int4 > int8; per-channel key groups beat per-token ones."""
    k, v = _kv(256, dtype=torch.float32)
    err = {}
    for name in ("int8", "int4", "int2"):
        store = strategies.build(name, {"residual_length": 0} if name != "int8" else {}).new_layer(0, 1)
        store.prefill(k, v, None)
        out_k, out_v = store.append(k[..., :0, :], v[..., :0, :])
        err[name] = ((out_k - k).pow(2).mean() + (out_v - v).pow(2).mean()).item()
    assert err["int8"] < err["int4"] < err["int2"]
    per_channel = (quantize_asymmetric(k, 2, 32, "channel").dequantize(torch.float32) - k).pow(2).mean()
    per_token = (quantize_asymmetric(k, 2, 32, "token").dequantize(torch.float32) - k).pow(2).mean()
    assert per_channel < 0.5 * per_token


# -- channel_sparse specifics --------------------------------------------------------------------------------


def test_think_keeps_the_channels_with_most_query_key_energy() -> None:
    d, keep = 16, {2, 5, 9, 14}
    k = torch.full((1, 2, 12, d), 0.1)
    q = torch.full((1, 4, 6, d), 0.1)
    k[0, 0, :, [2, 5]] = 3.0  # head 0: large keys in channels 2, 5 ...
    q[0, :2, :, [9, 14]] = 3.0  # ... and large queries (of its two query heads) in 9, 14
    k[0, 1, :, [0, 1, 3, 4]] = 3.0  # head 1: keys large where its queries are zero
    q[0, 2:, :, [0, 1, 3, 4]] = 0.0
    q[0, 2:, :, [6, 7, 8, 10]] = 2.0
    # every token pruned (kvbench's earlier behaviour; ThinK's recent window is tested in test_parity_quant.py)
    params = {"keep_ratio": 0.25, "recent_window": 0, "prune_decoded": True}
    store = strategies.build("channel_sparse", params).new_layer(0, 1)
    store.prefill(k, k.clone(), LayerCapture(layer_idx=0, num_kv_groups=2, scaling=0.25, queries=q))
    assert set(store.kept[0, 0].tolist()) == keep  # type: ignore[attr-defined]
    assert set(store.kept[0, 1].tolist()) == {6, 7, 8, 10}  # type: ignore[attr-defined]
    out_k, _ = store.append(k[..., :1, :], k[..., :1, :])
    scores = q[:, ::2] @ out_k.transpose(-1, -2)  # pruned q·k = q·k over the kept channels only
    mask = torch.zeros(1, 2, 1, d)
    mask[0, 0, 0, list(keep)] = 1
    mask[0, 1, 0, [6, 7, 8, 10]] = 1
    want = (q[:, ::2] * mask) @ torch.cat([k, k[..., :1, :]], dim=-2).transpose(-1, -2)
    assert torch.allclose(scores, want)
    assert store.stats()["kept_fraction"] == 0.25


@pytest.mark.parametrize("params", [{}, {"window": 8, "recent_window": 0, "prune_decoded": True}])
def test_think_reads_only_its_own_window_of_a_wider_capture(params: dict) -> None:
    """Issue 12: the engine captures the widest window of any co-run strategy (h2o: all queries). channel_sparse
    must score with its own last ``window`` queries only, so its result does not depend on who runs beside it."""
    window = strategies.build("channel_sparse", params).window  # type: ignore[attr-defined]
    k, v = _kv(100, heads=2, dim=16)
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(1, 6, 100, 16, generator=g).to(torch.bfloat16)
    wide[..., :-window, 1::2] *= 50  # earlier queries favour other channels: reading them changes the choice
    results = []
    for queries in (wide[..., -window:, :], wide):
        store = strategies.build("channel_sparse", params).new_layer(0, 1)
        cap = LayerCapture(layer_idx=0, num_kv_groups=3, scaling=0.25, queries=queries,
                           positions=torch.arange(100)[-queries.shape[-2]:])
        store.prefill(k, v, cap)
        results.append((store.kept.clone(), *store.append(*_kv(1, heads=2, dim=16, seed=3))))  # type: ignore
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_think_inside_compose_ignores_the_evictors_wider_window() -> None:
    """The same path inside ``compose``: snapkv's 32-query capture, channel_sparse's own window of 4."""
    k, v = _kv(100, heads=2, dim=16)
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(1, 6, 32, 16, generator=g).to(torch.bfloat16)
    wide[..., :-4, ::2] *= 50
    composed = strategies.build("compose", {"evict": "snapkv", "quantize": "channel_sparse",
                                            "quantize_params": {"window": 4}})
    assert composed.query_window == 32
    store = composed.new_layer(0, 1)
    store.prefill(k, v, LayerCapture(layer_idx=0, num_kv_groups=3, scaling=0.25, queries=wide))
    inner = store.inner  # type: ignore[attr-defined]
    # The tokens snapkv kept, recovered from the inner store's dense (exact) values.
    kept = torch.stack([(v[0, h, :, None, :] == inner._values()[0, h][None]).all(-1).any(-1).nonzero()[:, 0]
                        for h in range(2)])[None]
    alone = strategies.build("channel_sparse", {"window": 4}).new_layer(0, 1)
    alone.prefill(gather_tokens(k, kept, -2), gather_tokens(v, kept, -2),
                  LayerCapture(layer_idx=0, num_kv_groups=3, scaling=0.25, queries=wide[..., -4:, :]))
    assert torch.equal(inner.kept, alone.kept)  # type: ignore[attr-defined]


def test_prune_mode_needs_queries_and_outlier_mode_does_not() -> None:
    k, v = _kv(8, heads=2, dim=16)
    with pytest.raises(KVBenchError, match="captured queries"):
        strategies.build("channel_sparse").new_layer(0, 1).prefill(k, v, None)
    outlier = strategies.build("channel_sparse", {"mode": "outlier"})
    assert outlier.query_window == 0 and strategies.build("channel_sparse").query_window == 32
    store = outlier.new_layer(0, 1)
    store.prefill(k, v, None)
    out_k, out_v = store.append(k[..., :0, :], v[..., :0, :])
    kept = store.ko.perm[..., :store.ko.k].long()  # type: ignore[attr-defined]
    # outlier channels come back bit-exact; the rest within 4-bit per-token error
    assert torch.equal(out_k.gather(-1, kept.unsqueeze(-2).expand(1, 2, 8, -1)),
                       k.gather(-1, kept.unsqueeze(-2).expand(1, 2, 8, -1)))
    assert (out_k - k).abs().max() < 0.1 * k.abs().max() and store.stats()["kept_fraction"] == 2 / 16


# -- the real model ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_smollm_quantized_caches_track_full(smollm) -> None:
    """512 real tokens on SmolLM2-135M (bf16): measured reduction equals the bit budget, next-token
    predictions stay with ``full``, and the error grows as bits fall."""
    model, tok = smollm.model, smollm.tokenizer
    from kvbench import attention

    # The session's model may have been switched to kvbench's attention by an Engine built in another test;
    # the reference figures below are SDPA's.
    attention.use(model, "sdpa", "cpu")
    text = ("The history of the printing press begins in Mainz, where Johannes Gutenberg combined "
            "movable metal type, oil-based ink and a screw press. ") * 40
    ids = torch.tensor([tok.encode(text)[:512]])
    prefix, question = ids[:, :496], ids[:, 496:]
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[:, -16:].float()
        full = KVBenchCache(strategies.build("full"), model.config)
        model(input_ids=prefix, cache=full, use_cache=True)
        keys = [layer.store.keys for layer in full.layers]
        values = [layer.store.values for layer in full.layers]
        results = {}
        for name in ("int8", "fp8", "bfp", "int4", "int2"):
            cache = KVBenchCache.from_capture(strategies.build(name), model.config, keys, values)
            logits = model(input_ids=question, cache=cache, use_cache=True).logits.float()
            agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                            reduction="batchmean").item() / 16
            results[name] = (agree, kl, 1 - cache.kv_bytes() / cache.kv_bytes_fp16())
    t = 512  # KIVI's layout: every key (512 mod 128 = 0), all values but the 128 newest, at 5 bits
    assert results["int4"][2] == pytest.approx(1 - (t * 5 + (t - 128) * 5 + 128 * 16) / (2 * t * 16), abs=1e-6)
    assert results["int8"][2] == pytest.approx(1 - 8.25 / 16, abs=1e-6)
    for name in ("int8", "fp8", "bfp", "int4"):
        assert results[name][0] >= 0.8, (name, results)
    # int8 and int4 both far below int2; their own order is not asserted: at 512 tokens KIVI's int4 keeps the 128
    # newest values exact, so the two KLs lie within a few percent of each other and which is smaller depends
    # on the CPU's kernels (int8 1.43e-4 vs int4 1.39e-4 on one machine where the ordering once held).
    assert max(results["int8"][1], results["int4"][1]) < results["int2"][1]


# -- the benchmark script's table ----------------------------------------------------------------------------


def test_bench_table_from_run_summary() -> None:
    import pandas as pd

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_quantization as bench
    finally:
        sys.path.pop(0)
    summary = pd.DataFrame([
        {"task": "legal", "strategy": "full", "n": 4, "accuracy": 0.75, "memory_reduction": 0.0,
         "decode_ms_per_token": 20.0, "kl": 0.0, "top1_agreement": 1.0},
        {"task": "legal", "strategy": "int4(group_size=32,residual_length=128)", "n": 4, "accuracy": 0.5,
         "delta_pp": -25.0, "delta_ci_low": -50.0, "delta_ci_high": 0.0, "memory_reduction": 0.666015625,
         "decode_ms_per_token": 30.0, "kl": 0.02, "top1_agreement": 0.9},
    ])
    table = bench.build_table(bench.rows_from_summary(summary))
    assert len(table) == 1 and table["strategy"].iloc[0].startswith("int4")
    row = table.iloc[0]
    assert row["bits_per_element"] == pytest.approx(5.34375)
    assert row["decode_vs_full"] == pytest.approx(1.5) and row["baseline_accuracy"] == 0.75
    md = bench.to_markdown(table, ["hf_quantized skipped"])
    assert "66.6%" in md and "-25.0 [-50.0, +0.0]" in md and "1.50x" in md and "hf_quantized skipped" in md
    cmds = [j.command("python", []) for j in bench.jobs(["legal"], ["int8", "int4"], variants=True)]
    assert cmds[0][:5] == ["python", "-m", "kvbench", "task=legal", "strategies=[full,int8,int4]"]
    assert not any("hf_quantized" in " ".join(c) for c in cmds)
