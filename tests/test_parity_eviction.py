"""Parity with the papers: for every eviction strategy, an independent implementation of the paper's scoring,
written here from its equations (dense attention with K/V repeated per query head, no kvbench helpers), picks
the kept tokens on small random tensors (GQA, two batch rows); kvbench's store must keep exactly that index set
per (row, KV head). PyramidKV's per-layer budgets are checked against kvpress's schedule; H2O's and TOVA's
decode loops are replayed token by token on explicit held sets.

A new eviction strategy is picked up automatically: the registry-wide test fails until it has a reference.
Either its class declares one next to it, the ``ScorerStrategy`` path: a classmethod ``reference(keys, values,
queries, params, layer)`` returning the paper's scores ``[B, Hkv or 1, N]`` (higher = keep), written from the
paper's equation, with ``queries`` those of every prefix position and ``params`` the resolved parameters; the
store must keep the top ``keep(n)`` per row and KV head, at the strategy's defaults and at ``SCORER_CASES``.
Or ``REFERENCES`` here has an entry returning the kept indices (strategies that protect tokens or evict in
their own way), with parameters in ``CASES``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from kvbench.strategies._eviction import EvictingStore
from kvbench.strategies.base import LayerCapture

from kvbench import strategies

B, HQ, HKV, N, D = 2, 4, 2, 40, 8
SCALING = D ** -0.5
GROUPS = HQ // HKV


def _tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g)
    queries = torch.randn(B, HQ, N, D, generator=g)  # post-RoPE queries of every prefix position
    return keys, values, queries


def _causal_attention(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """softmax(q K^T / sqrt(d)) per query head, K repeated per head (repeat_kv), causal: ``[B, Hq, Q, N]``."""
    k = keys.repeat_interleave(GROUPS, dim=1)
    n, nq = keys.shape[-2], queries.shape[-2]
    logits = queries @ k.transpose(-1, -2) * SCALING
    query_pos = torch.arange(n - nq, n)[:, None]
    return logits.masked_fill(torch.arange(n)[None, :] > query_pos, float("-inf")).softmax(dim=-1)


def _per_kv_head(x: torch.Tensor) -> torch.Tensor:
    """Average the query heads that share a KV head: ``[B, Hq, ...]`` -> ``[B, Hkv, ...]`` (kvpress's GQA rule)."""
    return x.reshape(x.shape[0], HKV, GROUPS, *x.shape[2:]).mean(dim=2)


def _top(scores: torch.Tensor, k: int, offset: int = 0) -> list[set[int]]:
    return [set((scores[i].topk(k).indices + offset).tolist()) if k > 0 else set() for i in range(len(scores))]


# -- the references (each returns, per (row, KV head), the kept set and the scores that ranked it) -----------
Ref = tuple[list[list[set[int]]], torch.Tensor | None]


def _keep(n: int, ratio: float) -> int:
    return n - int(n * ratio)  # kvbench's rule (eviction docs): n - floor(n r), at least one token


def ref_snapkv(keys, values, queries, p, layer=0, layers=1, keep=None) -> Ref:
    """Li et al. 2024, Alg. 1: votes of the last ``w`` queries, pooled with kernel ``k``; window always kept."""
    n = keys.shape[-2]
    w, kernel, pooling = p["window_size"], p["kernel_size"], p["pooling"]
    keep = keep if keep is not None else _keep(n, p["compression_ratio"])
    attn = _causal_attention(queries[..., -w:, :], keys)  # [B, Hq, w, n]
    votes = attn[..., : n - w].sum(dim=-2)  # [B, Hq, n - w]
    pool = {"max": F.max_pool1d, "avg": F.avg_pool1d}[pooling]
    pooled = pool(votes.reshape(B * HQ, 1, -1), kernel, stride=1, padding=kernel // 2).reshape(B, HQ, -1)
    scores = _per_kv_head(pooled)
    protected = min(w, keep)  # a budget below the window keeps the newest window tokens
    window = set(range(n - protected, n))
    return [[s | window for s in _top(scores[b], keep - protected)] for b in range(B)], scores


def ref_pyramidkv(keys, values, queries, p, layer=0, layers=1) -> Ref:
    n = keys.shape[-2]
    return ref_snapkv(keys, values, queries, p, keep=kvpress_pyramid_budget(n, p["compression_ratio"],
                                                                            p["window_size"], p["beta"], layer,
                                                                            layers))


def ref_h2o(keys, values, queries, p, layer=0, layers=1) -> Ref:
    """Zhang et al. 2023: accumulated attention of every query (heavy hitters) plus the most recent tokens."""
    n = keys.shape[-2]
    keep = _keep(n, p["compression_ratio"])
    recent = round(p["recent_fraction"] * keep)
    scores = _per_kv_head(_causal_attention(queries, keys).sum(dim=-2))  # [B, Hkv, n]
    recent_set = set(range(n - recent, n))
    return [[s | recent_set for s in _top(scores[b, :, : n - recent], keep - recent)] for b in range(B)], scores


def ref_tova(keys, values, queries, p, layer=0, layers=1) -> Ref:
    """Oren et al. 2024: the last query's attention averaged over all heads; one token set per layer."""
    n = keys.shape[-2]
    keep = _keep(n, p["compression_ratio"])
    attn = _causal_attention(queries[..., -1:, :], keys)[..., 0, :]  # [B, Hq, n]
    scores = attn.mean(dim=1, keepdim=True).expand(B, HKV, n)
    if p.get("protect_last"):  # kvpress's TOVAPress: the newest token gets the highest score
        scores = torch.cat([scores[..., :-1], torch.full((B, HKV, 1), float("inf"))], dim=-1)
    return [_top(scores[b], keep) for b in range(B)], scores


def ref_streaming_llm(keys, values, queries, p, layer=0, layers=1) -> Ref:
    """Xiao et al. 2023: the first ``sink_tokens`` and the most recent rest, on every head."""
    n = keys.shape[-2]
    keep = _keep(n, p["compression_ratio"])
    kept = set(range(p["sink_tokens"])) | set(range(n - (keep - p["sink_tokens"]), n))
    return [[set(kept) for _ in range(HKV)] for _ in range(B)], None


def ref_knorm(keys, values, queries, p, layer=0, layers=1) -> Ref:
    """Devoto et al. 2024: the keys with the lowest L2 norm, per KV head."""
    n = keys.shape[-2]
    scores = -torch.linalg.vector_norm(keys, dim=-1)
    return [_top(scores[b], _keep(n, p["compression_ratio"])) for b in range(B)], scores


def ref_random(keys, values, queries, p, layer=0, layers=1) -> Ref:
    """The control: a uniform draw per (layer, row, KV head) from the documented seed ``seed * 1000003 + layer``."""
    n = keys.shape[-2]
    n = keys.shape[-2]
    scores = torch.rand(B, HKV, n, generator=torch.Generator().manual_seed(p["seed"] * 1_000_003 + layer))
    return [_top(scores[b], _keep(n, p["compression_ratio"])) for b in range(B)], scores


REFERENCES: dict[str, Callable[..., Ref]] = {
    "snapkv": ref_snapkv, "pyramidkv": ref_pyramidkv, "h2o": ref_h2o, "tova": ref_tova,
    "streaming_llm": ref_streaming_llm, "knorm": ref_knorm, "random": ref_random,
}
EVICTION = strategies.family_names("eviction")
#: Parameters a class-declared reference is checked at, besides the strategy's defaults.
SCORER_CASES: list[dict] = [{"compression_ratio": 0.3}, {"compression_ratio": 0.8}]


def _class_reference(name: str) -> Callable[..., Ref] | None:
    """The strategy's own ``reference`` classmethod (scores), as a kept-set reference; None if it has none."""
    scores_of = getattr(strategies.strategy_class(name), "reference", None)
    if not callable(scores_of):
        return None

    def ref(keys, values, queries, p, layer=0, layers=1) -> Ref:
        n = keys.shape[-2]
        scores = scores_of(keys, values, queries, p, layer=layer).expand(B, HKV, n)
        keep = min(n, p["budget_tokens"]) if p.get("budget_tokens") else _keep(n, p["compression_ratio"])
        return [_top(scores[b], keep) for b in range(B)], scores

    return ref


def _reference(name: str) -> Callable[..., Ref] | None:
    return REFERENCES.get(name) or _class_reference(name)


def _cases(name: str) -> list[dict]:
    return CASES[name] if name in REFERENCES else SCORER_CASES


def kvpress_pyramid_budget(n: int, ratio: float, window: int, beta: float, layer: int, layers: int) -> int:
    """kvpress ``PyramidKVPress.get_layer_budget`` (kvpress/presses/pyramidkv_press.py), restated."""
    capacity = window + n * (1 - ratio)
    min_num = (capacity - window) / beta
    max_num = (capacity - window) * 2 - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = (capacity - window) * 2 - max_num
    if not (n >= max_num >= min_num >= window) or layers < 2:
        return round(n * (1 - ratio))
    return round(max_num - layer * (max_num - min_num) / (layers - 1))


# -- comparison -----------------------------------------------------------------------------------------------
def _held_indices(store: EvictingStore, keys: torch.Tensor) -> list[list[set[int]]]:
    """Which prefix positions the store holds, found by matching its key rows against the originals."""
    held = store.inner.keys  # type: ignore[attr-defined]
    out = []
    for b in range(B):
        row = []
        for h in range(HKV):
            match = (held[b, h][:, None, :] == keys[b, h][None, :, :]).all(-1)  # [kept, N]
            assert (match.sum(-1) == 1).all(), "a held row is not an unmodified prefix row"
            row.append(set(match.float().argmax(-1).tolist()))
        out.append(row)
    return out


def _assert_same_kept(ours: list[list[set[int]]], ref: list[list[set[int]]], scores: torch.Tensor | None) -> None:
    """Exact equality of the kept sets; where they differ, only between tokens of equal reference score (a tie
    at the budget boundary, which max pooling creates by design: either choice is the paper's)."""
    for b in range(B):
        for h in range(HKV):
            o, r = ours[b][h], ref[b][h]
            assert len(o) == len(r), f"row {b} head {h}: kept {len(o)} tokens, the reference {len(r)}"
            if o == r:
                continue
            assert scores is not None, f"row {b} head {h}: kept {sorted(o ^ r)} differ from the reference"
            s = scores[b, h if scores.shape[1] > 1 else 0]
            ours_only, ref_only = [s[i].item() for i in o - r], [s[i].item() for i in r - o]
            assert sorted(ours_only) == sorted(ref_only), f"row {b} head {h}: {sorted(o - r)} vs {sorted(r - o)}"


def _store_kept(name: str, params: dict, layer: int, layers: int, seed: int) -> tuple[list, tuple]:
    keys, values, queries = _tensors(seed)
    strategy = strategies.build(name, params)
    store = strategy.new_layer(layer, layers)
    assert isinstance(store, EvictingStore)
    store.prefill(keys, values, LayerCapture(layer_idx=layer, num_kv_groups=GROUPS, scaling=SCALING,
                                             queries=queries[..., -strategy.query_window:, :]
                                             if strategy.query_window else queries))
    return _held_indices(store, keys), (keys, values, queries, strategy.params())


# Parameters per strategy; each runs as given and as kvbench's defaults (the ratio added where absent).
CASES: dict[str, list[dict]] = {
    "snapkv": [{"window_size": 8, "kernel_size": 5, "pooling": "avg"}, {"window_size": 6, "kernel_size": 3},
               {"preset": "kvpress", "window_size": 8}, {"compression_ratio": 0.8, "window_size": 4}],
    "pyramidkv": [{"window_size": 4, "kernel_size": 3, "pooling": "avg", "beta": 4.0},
                  {"window_size": 2, "compression_ratio": 0.25, "beta": 2.0}],
    "h2o": [{}, {"compression_ratio": 0.7, "recent_fraction": 0.25}],
    "tova": [{}, {"protect_last": True, "compression_ratio": 0.9}],
    "streaming_llm": [{}, {"sink_tokens": 2, "compression_ratio": 0.75}],
    "knorm": [{}, {"compression_ratio": 0.3}],
    "random": [{}, {"seed": 5, "compression_ratio": 0.6}],
}


@pytest.mark.parametrize("name", EVICTION)
def test_every_eviction_strategy_has_a_reference(name):
    assert _reference(name), (f"declare a `reference` classmethod of {name!r}'s paper scoring next to it, or add "
                              "a reference implementation to REFERENCES")
    if name in REFERENCES:
        assert CASES.get(name), f"add parity parameters for {name!r} to CASES"


@pytest.mark.parametrize("name,params,layer,layers", [
    (name, params, layer, layers)
    for name in EVICTION if _reference(name)
    for params in [{}, *_cases(name)]
    for layer, layers in ([(0, 1)] if name != "pyramidkv" else [(0, 4), (2, 4), (3, 4)])
])
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_index_sets_equal_the_papers(name, params, layer, layers, seed):
    ours, (keys, values, queries, resolved) = _store_kept(name, params, layer, layers, seed)
    ref, scores = _reference(name)(keys, values, queries, resolved, layer=layer, layers=layers)
    _assert_same_kept(ours, ref, scores)


# -- PyramidKV budgets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.75, 0.9, 0.97])
@pytest.mark.parametrize("layers", [2, 16, 30, 32])
@pytest.mark.parametrize("n,window", [(4096, 32), (4096, 64), (1000, 8), (300, 32)])
def test_pyramid_budgets_follow_kvpress(ratio, layers, n, window):
    s = strategies.build("pyramidkv", {"compression_ratio": ratio, "window_size": window})
    budgets = [s.prefill_keep(n, layer, layers) for layer in range(layers)]
    assert budgets == [kvpress_pyramid_budget(n, ratio, window, 20.0, layer, layers) for layer in range(layers)]
    assert budgets == sorted(budgets, reverse=True) and all(0 < b < n for b in budgets)
    assert abs(sum(budgets) / layers - n * (1 - ratio)) <= 1  # the mean is SnapKV's budget


def test_pyramid_below_half_eviction_is_a_ramp_with_no_full_layer():
    """Issue 15's case: 4,096 tokens, 25% evicted, 30 layers — 4,064 down to 2,080, 75% kept, none at 100%."""
    s = strategies.build("pyramidkv", {"compression_ratio": 0.25})
    budgets = [s.prefill_keep(4096, layer, 30) for layer in range(30)]
    assert (budgets[0], budgets[-1]) == (4064, 2080) and max(budgets) < 4096
    assert sum(budgets) == pytest.approx(0.75 * 4096 * 30, abs=30)


# -- decoding: the strategies that evict at every step ----------------------------------------------------------
def _decode_reference(name: str, p: dict, keys: torch.Tensor, queries: torch.Tensor, n: int) -> list[list[set]]:
    """Replays the papers' decode loops token by token on explicit held sets (per row and KV head for H2O, per
    row for TOVA): each new query attends over held + itself (softmax over that set only), H2O adds that
    attention to the running sums, then the budget ``keep(seen)`` is enforced."""
    total = keys.shape[-2]
    out = []
    for b in range(B):
        if name == "h2o":
            acc = _per_kv_head(_causal_attention(queries[b:b + 1, :, :n], keys[b:b + 1, :, :n]).sum(-2))[0]
            sums = [dict(enumerate(acc[h].tolist())) for h in range(HKV)]
        held = [set(s) for s in REFERENCES[name](keys[:, :, :n], None, queries[:, :, :n], p)[0][b]]
        for t in range(n, total):
            budget = _keep(t + 1, p["compression_ratio"])
            for h in range(HKV):
                held[h].add(t)
            if name == "h2o":
                for h in range(HKV):
                    pos = sorted(held[h])
                    q = queries[b, h * GROUPS:(h + 1) * GROUPS, t]  # [G, D]
                    attn = (q @ keys[b, h, pos].T * SCALING).softmax(-1).mean(0)
                    sums[h][t] = 0.0
                    for i, j in enumerate(pos):
                        sums[h][j] += attn[i].item()
                    if len(pos) > budget:
                        recent = round(p["recent_fraction"] * budget)
                        rest = pos[: len(pos) - recent] if recent else pos
                        heavy = sorted(rest, key=lambda j, h=h: -sums[h][j])[: budget - recent]
                        held[h] = set(heavy) | set(pos[len(pos) - recent:])
            else:
                pos = sorted(held[0])
                per_head = [(queries[b, qh, t] @ keys[b, qh // GROUPS, pos].T * SCALING).softmax(-1)
                            for qh in range(HQ)]
                score = torch.stack(per_head).mean(0)
                if p.get("protect_last"):
                    score[-1] = float("inf")
                if len(pos) > budget:
                    kept = {pos[i] for i in score.topk(budget).indices.tolist()}
                    held = [set(kept) for _ in range(HKV)]
        out.append(held)
    return out


@pytest.mark.parametrize("name,params", [("h2o", {}), ("h2o", {"recent_fraction": 0.25, "compression_ratio": 0.6}),
                                         ("tova", {}), ("tova", {"protect_last": True, "compression_ratio": 0.7})])
def test_decode_steps_keep_what_the_papers_keep(name, params):
    keys, values, queries = _tensors(3)
    n = 30  # prefix; the remaining 10 positions are decoded one at a time
    strategy = strategies.build(name, params)
    store = strategy.new_layer(0, 1)
    window = strategy.query_window or n

    def capture(lo: int, hi: int) -> LayerCapture:
        return LayerCapture(layer_idx=0, num_kv_groups=GROUPS, scaling=SCALING, queries=queries[..., lo:hi, :],
                            positions=torch.arange(lo, hi)[None])

    store.prefill(keys[:, :, :n], values[:, :, :n], capture(n - window, n))
    for t in range(n, N):
        store.capture = capture(t, t + 1)
        store.append(keys[:, :, t:t + 1], values[:, :, t:t + 1])
    _assert_same_kept(_held_indices(store, keys), _decode_reference(name, strategy.params(), keys, queries, n), None)
