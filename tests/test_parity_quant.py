"""Parity of the quantization strategies with their reference implementations (issue 15).

* Registry-wide: every strategy class with a ``reference`` classmethod is checked against it. Contract:
  ``cls.reference(keys, values, capture=None, **params) -> dict | None`` describes what the reference
  implementation holds after a prefill of ``keys``/``values`` (``[b, kv_heads, T, D]``) with captured
  queries ``capture``: ``"keys"``/``"values"`` — the K/V the next attention step reads for the held
  tokens; optionally ``"kv_bytes"`` — the bytes the reference layout holds; ``"source"`` — where the
  reference lives. ``None``: no reference for these parameters.
* KIVI (``int4``/``int2``): which tokens are exact and the bytes at several T, prefill and decode, against
  the formula of the paper/repository.
* ThinK (``channel_sparse``): the kept channels against ThinK's score written here from the paper's
  equation, GQA included; the recent window and decoded tokens are never pruned.
"""

from __future__ import annotations

import pytest
import torch
from kvbench.strategies._quantstore import TAIL_TOKENS
from kvbench.strategies.base import LayerCapture, held_bytes

from kvbench import strategies

WITH_REFERENCE = [n for n in strategies.available()
                  if callable(getattr(strategies.strategy_class(n), "reference", None))]
# Parameters each reference is checked at (defaults always); small G/R so tokens flush at these lengths.
REFERENCE_PARAMS: dict[str, list[dict]] = {
    "int4": [{}, {"group_size": 8, "residual_length": 16}, {"group_size": 16, "residual_length": 0}],
    "int2": [{}, {"group_size": 8, "residual_length": 32}, {"group_size": 16, "residual_length": 8}],
    "channel_sparse": [{}, {"keep_ratio": 0.25, "window": 8, "recent_window": 5},
                       {"keep_ratio": 0.75, "recent_window": 0}, {"mode": "outlier"}],
}
LENGTHS = [1, 16, 31, 128, 129, 300]


def _inputs(tokens: int, batch: int = 2, kv_heads: int = 2, groups: int = 3, dim: int = 16, window: int = 40,
            seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv_heads, tokens, dim, generator=g)
    k[..., ::4] *= 6  # key outlier channels
    v = torch.randn(batch, kv_heads, tokens, dim, generator=g)
    q = torch.randn(batch, kv_heads * groups, min(window, tokens), dim, generator=g)
    cap = LayerCapture(layer_idx=0, num_kv_groups=groups, scaling=dim**-0.5, queries=q)
    return k.to(torch.bfloat16), v.to(torch.bfloat16), cap


def test_kivi_and_think_expose_a_reference() -> None:
    assert {"int4", "int2", "channel_sparse"} <= set(WITH_REFERENCE)


@pytest.mark.parametrize("tokens", LENGTHS)
@pytest.mark.parametrize("name", WITH_REFERENCE)
def test_store_matches_its_reference(name: str, tokens: int) -> None:
    cls = strategies.strategy_class(name)
    for params in REFERENCE_PARAMS.get(name, [{}]):
        keys, values, cap = _inputs(tokens)
        ref = cls.reference(keys, values, cap, **params)
        if ref is None:
            continue
        if not {"keys", "values", "kv_bytes"} & set(ref):
            pytest.skip(f"{name}.reference returns none of keys, values, kv_bytes: {sorted(ref)}")
        store = strategies.build(name, params).new_layer(0, 1)
        store.prefill(keys, values, cap)
        got_k, got_v = store.append(keys[..., :0, :], values[..., :0, :])
        if "keys" in ref:
            assert torch.equal(got_k, ref["keys"]), (params, ref.get("source"))
        if "values" in ref:
            assert torch.equal(got_v, ref["values"]), (params, ref.get("source"))
        if "kv_bytes" in ref:
            assert held_bytes(store.tensors()) == ref["kv_bytes"], params


# -- KIVI ----------------------------------------------------------------------------------------------------


def _kivi_bytes(t: int, bits: int, g: int, r: int, heads: int, dim: int) -> int:
    """KIVI's layout (jy-yuan/KIVI models/llama_kivi.py) for one layer of ``t`` bf16 tokens, from the paper's
    cost: quantized elements at ``bits`` plus a float16 scale and zero point per group of G, exact ones at 16.

    Keys: all but the last ``t mod R`` are quantized (per channel, groups of G tokens); values: all but the
    ``R`` newest (per token, groups of G channels)."""
    tk, tv = t - t % r, max(t - r, 0)
    quantized = (tk + tv) * heads * dim * (bits + 2 * 16 / g) / 8
    exact = (2 * t - tk - tv) * heads * dim * 2
    return int(quantized + exact)


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("prefill, decode", [(100, 0), (128, 0), (4096, 0), (4000, 0), (120, 20), (250, 140)])
def test_kivi_exact_tokens_and_bytes(name: str, prefill: int, decode: int) -> None:
    """Exact tokens: the last T mod R keys and the R newest values; bytes: the formula above, exactly."""
    bits, g, r, heads, dim = (4 if name == "int4" else 2), 32, 128, 3, 64
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, heads, prefill, dim, generator=gen), torch.randn(1, heads, prefill, dim, generator=gen)
    store = strategies.build(name).new_layer(0, 1)  # defaults G = 32, R = 128 (the paper's)
    store.prefill(k.bfloat16(), v.bfloat16(), None)
    all_k, all_v = [k.bfloat16()], [v.bfloat16()]
    for _ in range(decode):
        nk, nv = torch.randn(1, heads, 1, dim, generator=gen), torch.randn(1, heads, 1, dim, generator=gen)
        all_k.append(nk.bfloat16())
        all_v.append(nv.bfloat16())
        store.append(nk.bfloat16(), nv.bfloat16())
    t = prefill + decode
    out_k, out_v = store.append(k[..., :0, :].bfloat16(), v[..., :0, :].bfloat16())
    want_k, want_v = torch.cat(all_k, dim=-2), torch.cat(all_v, dim=-2)
    exact_k, exact_v = t % r, min(t, r)
    assert torch.equal(out_k[..., t - exact_k:, :], want_k[..., t - exact_k:, :])
    assert torch.equal(out_v[..., t - exact_v:, :], want_v[..., t - exact_v:, :])
    # every quantized token differs from its exact value somewhere (4 and 2 bits never round-trip bf16 noise)
    assert (out_k[..., :t - exact_k, :] != want_k[..., :t - exact_k, :]).any(-1).all()
    assert (out_v[..., :t - exact_v, :] != want_v[..., :t - exact_v, :]).any(-1).all()
    # Plus the value slots reserved past the held tokens while decoding (strategies/_quantstore.py ChunkList): each
    # step past R quantizes one value; after the value chunk's first piece they fill tails of TAIL_TOKENS slots.
    singles = max(0, t - r) - max(0, prefill - r) - (prefill <= r < t)
    reserved = (-singles % TAIL_TOKENS) * heads * (dim * bits // 8 + dim // g * 2 * 2)
    assert held_bytes(store.tensors()) == _kivi_bytes(t, bits, g, r, heads, dim) + reserved


def test_kivi_int4_at_4k_is_the_papers_67_7_percent() -> None:
    assert 1 - _kivi_bytes(4096, 4, 32, 128, 3, 64) / (2 * 4096 * 3 * 64 * 2) == pytest.approx(0.6767578125)


# -- ThinK ---------------------------------------------------------------------------------------------------


def _think_kept(queries: torch.Tensor, keys: torch.Tensor, window: int, keep_ratio: float) -> list[list[set]]:
    """ThinK §3.2, literally: channel i of a head scores ``||Q[:, i] K[:, i]^T||_F`` — the Frobenius norm of the
    outer product of the query and key columns — over the last ``window`` queries; with GQA the query rows
    of every query head sharing the KV head are stacked. The ``int(D * (1 - keep_ratio))`` lowest-scoring
    channels are pruned."""
    b, h, _, d = keys.shape
    groups = queries.shape[1] // h
    kept: list[list[set]] = []
    for bi in range(b):
        kept.append([])
        for hi in range(h):
            q = torch.cat([queries[bi, hi * groups + j, -window:] for j in range(groups)]).double()
            k = keys[bi, hi].double()
            scores = [torch.linalg.matrix_norm(torch.outer(q[:, i], k[:, i])).item() for i in range(d)]
            pruned = sorted(range(d), key=lambda i: scores[i])[:int(d * (1 - keep_ratio) + 1e-6)]
            kept[bi].append(set(range(d)) - set(pruned))
    return kept


@pytest.mark.parametrize("keep_ratio, window, groups", [(0.5, 32, 3), (0.25, 8, 2), (0.75, 4, 1), (0.6, 16, 4)])
def test_think_channel_selection_matches_the_papers_score(keep_ratio: float, window: int, groups: int) -> None:
    keys, values, cap = _inputs(90, groups=groups, window=48, seed=3)  # the capture is wider than the window
    params = {"keep_ratio": keep_ratio, "window": window}
    store = strategies.build("channel_sparse", params).new_layer(0, 1)
    store.prefill(keys, values, cap)
    want = _think_kept(cap.queries.float(), keys.float(), window, keep_ratio)
    got = [[set(store.kept[bi, hi].tolist()) for hi in range(2)] for bi in range(2)]  # type: ignore[attr-defined]
    assert got == want


def test_think_recent_window_and_decoded_keys_stay_whole() -> None:
    keys, values, cap = _inputs(60, seed=4)
    store = strategies.build("channel_sparse", {"recent_window": 10}).new_layer(0, 1)
    store.prefill(keys, values, cap)
    new = [_inputs(1, seed=10 + i)[:2] for i in range(5)]
    for nk, nv in new:
        out_k, out_v = store.append(nk, nv)
    whole = torch.cat([keys[..., 50:, :]] + [nk for nk, _ in new], dim=-2)
    assert torch.equal(out_k[..., 50:, :], whole)  # the 10 recent prefill keys and all 5 decoded ones
    pruned = out_k[..., :50, :]
    assert int((pruned != 0).any(-2).sum(-1).max()) == 8  # older keys keep 8 of 16 channels
    assert store.stats()["pruned_token_fraction"] == pytest.approx(50 / 65)
    # prune_decoded: the window rolls, only the 10 newest stay whole
    rolling = strategies.build("channel_sparse", {"recent_window": 10, "prune_decoded": True}).new_layer(0, 1)
    rolling.prefill(keys, values, cap)
    for nk, nv in new:
        out_k, _ = rolling.append(nk, nv)
    assert int((out_k[..., :55, :] != 0).any(-2).sum(-1).max()) == 8
    assert torch.equal(out_k[..., 55:, :], whole[..., 5:, :])
