"""Eviction strategies: exact kept indices on hand-built tensors, real shrinkage, GQA pooling, budgets at every
decode step, and equivalence with a full cache whose attention masks the evicted (layer, head, token) slots."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from kvbench.strategies._eviction import (
    EvictingStore,
    attention_column_sums,
    attention_probs,
    keep_count,
    select_keep,
)
from kvbench.strategies.base import LayerCapture, RunContext
from kvbench.strategies.pyramidkv import pyramid_budgets
from transformers import AttentionInterface, DynamicCache

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.models import tiny_llama

#: Every registered eviction strategy, plugins on sys.path included: a new one is never left out.
EVICTION = strategies.family_names("eviction")
DECODE_EVICTING = [("streaming_llm", {}), ("h2o", {}), ("tova", {}), ("tova", {"per_head": True}),
                   ("knorm", {"decode_evict": True}), ("random", {"decode_evict": True})]
CONF = Path(__file__).resolve().parents[1] / "conf" / "strategy"


# Tiny-model steps are dominated by thread hand-offs; every test here runs on one torch thread.
pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _store(name: str, params: dict | None = None, layer: int = 0, layers: int = 1) -> EvictingStore:
    store = strategies.build(name, params).new_layer(layer, layers)
    assert isinstance(store, EvictingStore)
    return store


def _capture(queries: torch.Tensor, groups: int, scaling: float = 1.0) -> LayerCapture:
    """Hand-built queries of the last positions of a prefix (positions omitted, as a hook may leave them)."""
    return LayerCapture(layer_idx=0, num_kv_groups=groups, scaling=scaling, queries=queries)


def _tagged_keys(b: int, h: int, n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Random keys whose channel 0 holds the token index, so kept rows name their tokens."""
    k = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(seed))
    k[..., 0] = torch.arange(n, dtype=k.dtype)
    return k


def _kept(store: EvictingStore) -> torch.Tensor:
    return store.inner.keys[..., 0].round().long()  # type: ignore[attr-defined]


# -- registry, config, validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", EVICTION + ["compose"])
def test_registered_with_yaml_defaults(name):
    from omegaconf import OmegaConf

    from kvbench.config import compose_config  # generated from the dataclass; the YAML only points at it

    cfg = OmegaConf.to_container(compose_config([f"strategy={name}"]).strategy)
    assert cfg.pop("name") == name
    built = strategies.build(name, cfg)
    assert built.label() == strategies.build(name).label()
    assert name in strategies.available()


def test_keep_count_ratio_and_tokens():
    assert keep_count(96, 0.5, None) == 48
    assert keep_count(97, 0.5, None) == 49
    assert keep_count(100, 0.29, None) == 71  # 100 * 0.29 is 28.999... in floating point
    assert keep_count(8, 0.875, None) == 1
    assert keep_count(3, 0.99, None) == 1
    assert keep_count(96, None, 20) == 20
    assert keep_count(10, None, 20) == 10
    assert keep_count(96, 0.0, None) == 96


@pytest.mark.parametrize("name,params,needle", [
    ("snapkv", {"compression_ratio": 0.5, "budget_tokens": 16}, "not both"),
    ("h2o", {"compression_ratio": 1.0}, "[0, 1)"),
    ("tova", {"compression_ratio": -0.1}, "[0, 1)"),
    ("knorm", {"compression_ratio": "half"}, "[0, 1)"),
    ("random", {"budget_tokens": 0}, ">= 1"),
    ("streaming_llm", {"budget_tokens": 2.5}, ">= 1"),
    ("streaming_llm", {"sink_tokens": -1}, "sink_tokens"),
    ("snapkv", {"kernel_size": 4}, "odd"),
    ("snapkv", {"pooling": "median"}, "max, avg, none"),
    ("snapkv", {"window_size": 0}, "window_size"),
    ("pyramidkv", {"beta": 0.5}, "beta"),
    ("h2o", {"recent_fraction": 1.5}, "recent_fraction"),
    ("tova", {"per_head": "yes"}, "true or false"),
    ("tova", {"protect_last": 1}, "tova.protect_last"),
    ("h2o", {"fixed_cache": "no"}, "h2o.fixed_cache"),
    ("streaming_llm", {"rerotate": "yes"}, "streaming_llm.rerotate"),
    ("snapkv", {"preset": "vllm"}, "kvcache_factory, snapkv, kvpress"),
    ("random", {"seed": -3}, "seed"),
    ("knorm", {"window": 3}, "valid: compression_ratio, budget_tokens, decode_evict"),
])
def test_bad_parameters_are_one_line_errors(name, params, needle):
    with pytest.raises(KVBenchError) as err:
        strategies.build(name, params)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_budget_tokens_alone_disables_the_default_ratio():
    s = strategies.build("snapkv", {"budget_tokens": 16})
    assert s.compression_ratio is None and s.prefill_keep(100, 0, 1) == 16
    assert strategies.build("snapkv").compression_ratio == 0.5


@pytest.mark.parametrize("name", strategies.available())
def test_query_window_is_an_instance_property_never_stored(name):
    """Issue 16: the window is derived per instance; building one never writes it on the instance or class."""
    cls = strategies.strategy_class(name)
    built = strategies.build(name)
    assert "query_window" not in vars(built)
    assert isinstance(cls.query_window, property)
    window = built.query_window
    assert window is None or (isinstance(window, int) and window >= 0)


@pytest.mark.parametrize("name", EVICTION)
def test_reading_queries_is_declared_once(name):
    """Issue 27: the store's query check derives from ``query_window``; no second declaration can disagree."""
    strategy = strategies.build(name)
    assert strategy.policy(0, 1).needs_queries == (strategy.query_window != 0)


def test_attention_guided_is_an_attribute_of_the_strategy():
    """The claim check's "attention-guided eviction": the strategies that score by attention, plugins included."""
    assert {n for n in strategies.available() if strategies.attention_guided(n)} == {"snapkv", "pyramidkv", "h2o",
                                                                                     "tova"}
    assert not strategies.attention_guided("no_longer_installed")


def test_query_window_follows_each_instance_parameters():
    small, default = strategies.build("snapkv", {"window_size": 8}), strategies.build("snapkv")
    assert (small.query_window, default.query_window) == (8, 32)
    assert strategies.build("compose", {"evict_params": {"window_size": 8}}).query_window == 8
    assert strategies.build("tiered", {"hot_heavy_tokens": 4, "observation_window": 8}).query_window == 8
    assert strategies.build("snapkv").query_window == 32  # the earlier instances changed nothing shared


# -- scoring helpers ----------------------------------------------------------------------------------------
def _dense_probs(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Naive reference: repeat K per query head, full causal softmax, queries at the last positions."""
    groups = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(groups, dim=1)
    logits = q @ kk.transpose(-1, -2) * scaling
    n, nq = k.shape[-2], q.shape[-2]
    future = torch.arange(n)[None, :] > (n - nq + torch.arange(nq))[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(-1)  # [B, Hq, Q, N]


@pytest.mark.parametrize("chunk", [1, 5, 256])
@pytest.mark.parametrize("nq", [30, 12])
def test_attention_column_sums_match_dense(chunk, nq):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, nq, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    dense = _dense_probs(q, k, 0.35).sum(-2).reshape(2, 3, 2, 30)
    got = attention_column_sums(q, k, 0.35, chunk=chunk)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention_probs(q, k, 0.35).sum(-2), dense, rtol=1e-5, atol=1e-5)


def test_select_keep_protects_sinks_and_recent():
    scores = torch.tensor([[[0.0, 0.0, 9.0, 1.0, 8.0, 0.0, 0.0, 0.0]]])
    assert select_keep(scores, (1, 1, 8), 5, sinks=1, recent=2).tolist() == [[[0, 2, 4, 6, 7]]]
    # Too small a budget: sinks first, then recent, no middle.
    assert select_keep(None, (1, 2, 8), 3, sinks=2, recent=4).tolist() == [[[0, 1, 7], [0, 1, 7]]]
    assert select_keep(scores, (1, 1, 8), 20).tolist() == [[list(range(8))]]


# -- exact kept indices on hand-built tensors ----------------------------------------------------------------
def test_knorm_keeps_lowest_norm_keys_per_head():
    norms = torch.tensor([[[5.0, 1.0, 4.0, 0.5, 3.0, 2.0], [0.1, 6.0, 0.2, 7.0, 8.0, 0.3]]])
    direction = torch.nn.functional.normalize(torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(1)),
                                              dim=-1)
    keys = direction * norms[..., None]
    values = torch.randn(1, 2, 6, 8)
    store = _store("knorm", {"budget_tokens": 3})
    store.prefill(keys, values, None)
    want = torch.tensor([[[1, 3, 5], [0, 2, 5]]])  # the three smallest norms per head, in order
    assert torch.equal(store.inner.keys, keys.gather(2, want[..., None].expand(-1, -1, -1, 8)))
    assert torch.equal(store.inner.values, values.gather(2, want[..., None].expand(-1, -1, -1, 8)))


def test_streaming_llm_keeps_sinks_and_window():
    keys = _tagged_keys(1, 2, 40, 8)
    store = _store("streaming_llm", {"budget_tokens": 10, "sink_tokens": 4})
    store.prefill(keys, keys.clone(), None)
    want = [0, 1, 2, 3, *range(34, 40)]
    assert _kept(store).tolist() == [[want, want]]
    # During decoding the oldest non-sink token leaves at every step.
    new = _tagged_keys(1, 2, 41, 8)[..., 40:, :]
    k_all, _ = store.append(new, new.clone())
    assert k_all.shape[-2] == 11  # this step attends to held + new
    want = [0, 1, 2, 3, *range(35, 41)]
    assert _kept(store).tolist() == [[want, want]]


def _log_probs_queries(rows: list[list[float]], n: int, extra: float = 1e-4) -> torch.Tensor:
    """Queries whose softmax over one-hot keys (``keys = I``) is ``rows`` (renormalised; others ``extra``)."""
    p = torch.full((len(rows), n), extra)
    for i, row in enumerate(rows):
        p[i, : len(row)] = torch.tensor(row).clamp_min(extra)
    return (p / p.sum(-1, keepdim=True)).log()


def test_tova_keeps_what_the_last_query_reads():
    n = 12
    keys = torch.eye(n)[None, None].repeat(1, 2, 1, 1)  # token i's key is e_i: logits are the query entries
    # 4 query heads on 2 KV heads; the layer-mean (paper) choice of 3 tokens is {2, 5, 9}.
    q = torch.stack([
        _log_probs_queries([[0, 0, 0.5, 0, 0, 0.2]], n)[0],
        _log_probs_queries([[0, 0, 0.4, 0, 0, 0, 0, 0, 0, 0.3]], n)[0],
        _log_probs_queries([[0, 0, 0, 0, 0, 0.6]], n)[0],
        _log_probs_queries([[0, 0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0.1]], n)[0],
    ])[None, :, None, :]
    store = _store("tova", {"budget_tokens": 3})
    store.prefill(keys, keys.clone(), _capture(q, 2))
    kept = store.inner.keys.argmax(-1)
    assert kept.tolist() == [[[2, 5, 9], [2, 5, 9]]]
    per_head = _store("tova", {"budget_tokens": 2, "per_head": True})
    per_head.prefill(keys, keys.clone(), _capture(q, 2))
    assert per_head.inner.keys.argmax(-1).tolist() == [[[2, 9], [5, 9]]]


def test_gqa_scores_are_the_mean_over_the_group():
    """KV head 0's two query heads disagree: token 1 wins on max (0.6) but token 3 on the mean (0.4 > 0.305)."""
    n = 8
    keys = torch.eye(n)[None, None].repeat(1, 2, 1, 1)
    rows = [[0, 0.6, 0, 0.3, 0, 0, 0.1], [0, 0.01, 0, 0.5, 0, 0, 0.49],
            [0, 0, 0, 0, 0, 0.7, 0.3], [0, 0, 0, 0, 0, 0.6, 0.4]]
    q = _log_probs_queries(rows, n)[None, :, None, :]
    store = _store("tova", {"budget_tokens": 1, "per_head": True})
    store.prefill(keys, keys.clone(), _capture(q, 2))
    assert store.inner.keys.argmax(-1).tolist() == [[[3], [5]]]


def _snap_inputs(n: int = 40, w: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.eye(64)[:n][None, None]  # one KV head, one-hot keys
    rows = [[0.0] * 10 + [0.5] + [0.0] * 9 + [0.2]] * w  # every window query reads token 10, a little 20
    q = _log_probs_queries(rows, 64)  # dims >= n meet no key
    return keys, q[None, None].repeat(1, 2, 1, 1)  # two query heads on the KV head


def test_snapkv_keeps_voted_tokens_and_window():
    keys, q = _snap_inputs()
    store = _store("snapkv", {"budget_tokens": 6, "window_size": 4, "kernel_size": 1})
    store.prefill(keys, keys.clone(), _capture(q, 2))
    assert store.inner.keys.argmax(-1).tolist() == [[[10, 20, 36, 37, 38, 39]]]
    # Pooling keeps the neighbours of a voted token: the cluster 9..11 beats token 20.
    pooled = _store("snapkv", {"budget_tokens": 7, "window_size": 4, "kernel_size": 3, "pooling": "max"})
    pooled.prefill(keys, keys.clone(), _capture(q, 2))
    assert pooled.inner.keys.argmax(-1).tolist() == [[[9, 10, 11, 36, 37, 38, 39]]]


def test_h2o_prefill_matches_dense_accumulated_attention():
    g = torch.Generator().manual_seed(3)
    keys, q = torch.randn(1, 2, 50, 8, generator=g), torch.randn(1, 4, 50, 8, generator=g)
    store = _store("h2o", {"budget_tokens": 20, "recent_fraction": 0.25})
    store.prefill(keys, keys.clone(), _capture(q, 2, scaling=0.3))
    acc = _dense_probs(q, keys, 0.3).sum(-2).reshape(1, 2, 2, 50).mean(2)  # [B, H, N]
    heavy = acc[..., :45].topk(15, dim=-1).indices
    want = torch.cat([heavy, torch.arange(45, 50).expand(1, 2, 5)], -1).sort(-1).values
    assert torch.equal(store.inner.keys, keys.gather(2, want[..., None].expand(-1, -1, -1, 8)))
    torch.testing.assert_close(store.policy.acc, acc.gather(-1, want))
    assert not torch.equal(want[0, 0], want[0, 1])  # heads keep different tokens


def test_h2o_refuses_a_partial_query_capture():
    keys = torch.randn(1, 2, 20, 8)
    store = _store("h2o", {"budget_tokens": 8})
    with pytest.raises(KVBenchError, match="all 20 prefix positions"):
        store.prefill(keys, keys, _capture(torch.randn(1, 4, 5, 8), 2))


def test_random_is_seeded_and_per_head():
    keys = _tagged_keys(1, 3, 64, 8)
    kept = []
    for seed in (0, 0, 1):
        store = _store("random", {"budget_tokens": 16, "seed": seed})
        store.prefill(keys, keys, None)
        kept.append(_kept(store))
    assert torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], kept[2])
    assert kept[0].shape == (1, 3, 16) and not torch.equal(kept[0][0, 0], kept[0][0, 1])


def test_attention_strategies_need_queries():
    keys = torch.randn(1, 2, 20, 8)
    with pytest.raises(KVBenchError, match="attach"):
        _store("snapkv").prefill(keys, keys, None)


# -- real memory -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", EVICTION)
def test_eviction_shrinks_tensors_and_leaves_inputs_alone(name):
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g)
    k0, v0 = keys.clone(), values.clone()
    cap = _capture(torch.randn(1, 4, 64, 16, generator=g), 2, 0.25)
    strategy = strategies.build(name, {"compression_ratio": 0.75})
    cache = KVBenchCache.from_capture(strategy, _cfg(1), [keys], [values], [cap])
    full = KVBenchCache.from_capture(strategies.build("full"), _cfg(1), [keys], [values], [cap])
    store = cache.layers[0].store
    assert torch.equal(keys, k0) and torch.equal(values, v0)
    held = [t for t in store.tensors() if t.dim() == 4]
    assert [t.shape for t in held] == [torch.Size([1, 2, 16, 16])] * 2
    assert all(t.untyped_storage().data_ptr() != keys.untyped_storage().data_ptr() for t in held)
    extra = 2 * 16 * 4 if name == "h2o" else 0  # H2O's running sums: one float32 per held token and head
    assert cache.kv_bytes() == full.kv_bytes() // 4 + extra
    assert cache.held_tokens() == [16] and cache.get_seq_length() == 64
    assert cache.stats()["kept_fraction"] == 0.25


def _cfg(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


def test_full_store_select_tokens_drops_rows_per_head():
    store = strategies.build("full").new_layer(0, 1)
    keys = _tagged_keys(1, 2, 10, 4)
    store.prefill(keys, keys.clone(), None)
    k_step, _ = store.append(keys[..., :1, :], keys[..., :1, :])  # what attention read this step
    seen = k_step.clone()
    store.select_tokens(torch.tensor([[[0, 3, 10], [1, 2, 5]]]))
    assert store.keys[..., 0].round().long().tolist() == [[[0, 3, 0], [1, 2, 5]]]  # token 10 is a copy of 0
    assert store.num_tokens() == 3 and store.values.shape == (1, 2, 3, 4)
    assert torch.equal(k_step, seen) and torch.equal(store.keys[0, 0, 2], keys[0, 0, 0])


def test_generate_with_an_attached_decode_evicting_cache(tiny_model, tiny_ids):
    cache = KVBenchCache(strategies.build("h2o", {"budget_tokens": 24}), tiny_model.config)
    with torch.inference_mode(), cache.attach(tiny_model):
        out = tiny_model.generate(tiny_ids[:, :64], cache=cache, max_new_tokens=20, do_sample=False)
    assert out.shape == (1, 84) and cache.held_tokens() == [24, 24] and cache.get_seq_length() == 83


# -- pyramid budgets -------------------------------------------------------------------------------------------
def test_pyramid_budgets_keep_the_mean_and_shrink_with_depth():
    # kvpress's schedule (tests/test_parity_eviction.py checks it against the formula at many ratios/depths).
    b = pyramid_budgets(1000, 100.0, 4, 30, 20.0)
    assert abs(sum(b) - 3000) <= 15 and b == sorted(b, reverse=True) and b[0] == 195 and b[-1] == 5
    capped = pyramid_budgets(100, 70.0, 8, 8, 20.0)  # layer 0 would want 136 > 100 - 8 tokens
    assert capped[0] == 92 and capped[-1] == 48 and capped == sorted(capped, reverse=True)
    assert pyramid_budgets(100, 40.0, 8, 1, 20.0) == [40]  # one layer: SnapKV's budget
    assert pyramid_budgets(1000, 100.0, 8, 4, 20.0) == [100] * 4  # top layer below the window: uniform
    s = strategies.build("pyramidkv", {"compression_ratio": 0.5, "window_size": 8})
    keeps = [s.prefill_keep(1000, i, 12) for i in range(12)]
    assert abs(sum(keeps) - 12 * 500) <= 6 and keeps[0] > keeps[-1] >= 8


def test_snapkv_presets_fill_only_what_the_user_left_unset():
    assert strategies.build("snapkv").params() == strategies.build("snapkv", {"preset": "kvcache_factory"}).params()
    kvpress = strategies.build("snapkv", {"preset": "kvpress"})
    assert (kvpress.window_size, kvpress.kernel_size, kvpress.pooling) == (64, 5, "avg")
    assert kvpress.query_window == 64
    repo = strategies.build("pyramidkv", {"preset": "snapkv"})
    assert (repo.window_size, repo.kernel_size, repo.pooling) == (32, 5, "avg")
    mixed = strategies.build("snapkv", {"preset": "kvpress", "window_size": 16})  # explicit value wins
    assert (mixed.window_size, mixed.kernel_size, mixed.pooling) == (16, 5, "avg")
    # Labels record what runs: an explicit spelling of a preset's values is the same configuration.
    spelled = strategies.build("snapkv", {"window_size": 64, "kernel_size": 5, "pooling": "avg"})
    assert spelled.label() == kvpress.label() and "preset" not in kvpress.params()
    with pytest.raises(KVBenchError, match="kvcache_factory, snapkv, kvpress"):
        strategies.build("snapkv", {"preset": "vllm"})


def test_preset_from_the_command_line_overrides_the_yaml():
    """``strategy.preset=kvpress`` works through Hydra: the YAML leaves the preset-governed fields null."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    for name in ("snapkv", "pyramidkv"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = OmegaConf.to_container(compose(name, overrides=["preset=kvpress"]), resolve=True)
        cfg.pop("name")
        built = strategies.build(name, cfg)
        assert (built.window_size, built.kernel_size, built.pooling) == (64, 5, "avg")


@pytest.mark.parametrize("name", ["h2o", "tova"])
def test_fixed_cache_keeps_the_prompt_budget_while_decoding(tiny_model, tiny_ids, name):
    """The papers' fixed-size cache: with a ratio the budget normally grows with every token seen."""
    held = {}
    for fixed in (False, True):
        cache = KVBenchCache(strategies.build(name, {"compression_ratio": 0.5, "fixed_cache": fixed}),
                             tiny_model.config)
        tok = tiny_ids[:, :40]
        with torch.inference_mode(), cache.attach(tiny_model):
            for _ in range(20):
                tok = tiny_model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        held[fixed] = cache.held_tokens()
    assert held[True] == [20, 20] and held[False] == [keep_count(59, 0.5, None)] * 2


def test_streaming_llm_rerotate_moves_keys_to_their_cache_positions(tiny_model):
    """The paper's code rotates keys by cache position: held key j must equal RoPE(k0, j + evicted so far)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = tiny_model.model.rotary_emb
    k0 = torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(0))  # pre-RoPE keys

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary(x, positions[None])
        return apply_rotary_pos_emb(x, x, cos, sin)[1]

    strategy = strategies.build("streaming_llm", {"budget_tokens": 8, "sink_tokens": 2, "rerotate": True})
    strategy.bind(RunContext(model=tiny_model))
    store = strategy.new_layer(0, 1)
    store.prefill(rope(k0[:, :, :24], torch.arange(24)), k0[:, :, :24].clone(), None)
    for seen in range(24, 31):
        kept = torch.tensor([0, 1, *range(seen - 6, seen)])  # sinks + window, original positions
        expected = rope(k0[:, :, kept], torch.arange(8) + (seen - 8))
        torch.testing.assert_close(store.inner.keys, expected, rtol=1e-5, atol=1e-5)
        if seen < 30:
            store.append(rope(k0[:, :, seen:seen + 1], torch.tensor([seen])), k0[:, :, seen:seen + 1].clone())
    plain = strategies.build("streaming_llm", {"budget_tokens": 8, "sink_tokens": 2}).new_layer(0, 1)
    plain.prefill(rope(k0[:, :, :24], torch.arange(24)), k0[:, :, :24].clone(), None)  # kvpress: no rotation
    torch.testing.assert_close(plain.inner.keys, rope(k0[:, :, [0, 1, *range(18, 24)]],
                                                      torch.tensor([0, 1, *range(18, 24)])))


def test_streaming_llm_rerotate_needs_the_model_and_a_full_store():
    store = strategies.build("streaming_llm", {"budget_tokens": 4, "rerotate": True}).new_layer(0, 1)
    with pytest.raises(KVBenchError, match="bind"):
        store.prefill(torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16), None)
    with pytest.raises(KVBenchError, match="rerotate"):
        strategies.build("compose", {"evict": "streaming_llm", "quantize": "int8", "evict_params": {"rerotate": True}})
    assert strategies.build("compose", {"evict": "streaming_llm", "quantize": "full",
                                        "evict_params": {"rerotate": True}}).new_layer(0, 1)


def test_tova_protect_last_always_keeps_the_newest_token():
    k = _tagged_keys(1, 2, 12, 8)
    q = torch.zeros(1, 4, 1, 8)
    q[..., 1] = 1.0
    k[..., -1, 1] = -50.0  # the last token gets (almost) no attention: TOVA's own code would evict it
    plain, kvpress = _store("tova", {"budget_tokens": 4}), _store("tova", {"budget_tokens": 4, "protect_last": True})
    for store in (plain, kvpress):
        store.prefill(k, k.clone(), _capture(q, 2))
    assert 11 not in _kept(plain)[0, 0].tolist() and 11 in _kept(kvpress)[0, 0].tolist()


# -- equivalence with a masked full cache -------------------------------------------------------------------
class _MaskedReference:
    """Eager attention in which each (layer, KV head) sees only the positions in ``visible``."""

    def __init__(self) -> None:
        self.visible: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        logits = query @ k.transpose(-1, -2) * (scaling if scaling is not None else module.scaling)
        n, nq = key.shape[-2], query.shape[-2]
        allowed = torch.arange(n)[None, :] <= (n - nq + torch.arange(nq))[:, None]
        vis = self.visible.get(module.layer_idx)
        if vis is not None:
            allowed = allowed & vis.repeat_interleave(groups, 1)[:, :, None, :n]
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        return (probs @ v).transpose(1, 2).contiguous(), None


_REFERENCE = _MaskedReference()
AttentionInterface.register("kvbench_masked_reference", _REFERENCE)


@pytest.fixture(scope="module")
def reference_model(_tiny_model_shared):
    ref = tiny_llama(seed=0, attn_implementation="kvbench_masked_reference")
    for a, b in zip(ref.state_dict().values(), _tiny_model_shared.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    return ref


class _Tracker:
    """Follows which original positions a store holds, by wrapping its prefill/append/_choose."""

    def __init__(self, store: EvictingStore) -> None:
        self.pos = torch.zeros(0, dtype=torch.long)
        self.before = self.pos
        prefill, append, choose = store.prefill, store.append, store._choose

        def _prefill(keys, values, capture):
            self.pos = torch.arange(keys.shape[-2]).expand(*keys.shape[:2], -1)
            return prefill(keys, values, capture)

        def _append(keys, values):
            start = store.seen
            new = torch.arange(start, start + keys.shape[-2]).expand(*keys.shape[:2], -1)
            self.pos = self.before = torch.cat([self.pos, new], -1)
            return append(keys, values)

        def _choose(scores, shape, keep, device):
            index = choose(scores, shape, keep, device)
            self.pos = self.pos.gather(-1, index)
            return index

        store.prefill, store.append, store._choose = _prefill, _append, _choose  # type: ignore[method-assign]

    def visible(self, total: int) -> torch.Tensor:
        vis = torch.zeros(*self.before.shape[:2], total, dtype=torch.bool)
        return vis.scatter(-1, self.before, True)


CASES = [
    ("streaming_llm", {"budget_tokens": 20}),
    ("h2o", {}),
    ("h2o", {"budget_tokens": 24, "recent_fraction": 0.25}),
    ("snapkv", {"window_size": 8, "kernel_size": 3}),
    ("pyramidkv", {"window_size": 4}),
    ("tova", {}),
    ("tova", {"per_head": True, "budget_tokens": 24}),
    ("knorm", {"compression_ratio": 0.6, "decode_evict": True}),
    ("random", {"decode_evict": True, "seed": 3}),
    ("compose", {"evict": "h2o", "quantize": "full"}),
]


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_full_cache_with_evicted_slots_masked(tiny_model, reference_model, tiny_ids, name, params):
    """Prefill 48 tokens, forward 8 at once (a question), then 16 single steps; every step's logits must equal
    a full cache whose attention masks exactly the (layer, head, position) slots the strategy evicted."""
    strategy = strategies.build(name, params)
    strategy.bind(RunContext(model=tiny_model))
    cache = KVBenchCache(strategy, tiny_model.config)
    trackers = [_Tracker(layer.store) for layer in cache.layers]
    ref_cache = DynamicCache(config=reference_model.config)
    _REFERENCE.visible = {}
    chunks = [tiny_ids[:, :48], tiny_ids[:, 48:56], *[tiny_ids[:, i:i + 1] for i in range(56, 72)]]
    total = 0
    with torch.inference_mode(), cache.attach(tiny_model):
        for step, ids in enumerate(chunks):
            got = tiny_model(input_ids=ids, cache=cache, use_cache=True).logits
            total += ids.shape[1]
            if step:
                _REFERENCE.visible = {i: t.visible(total) for i, t in enumerate(trackers)}
            want = reference_model(input_ids=ids, cache=ref_cache, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert cache.get_seq_length() == total  # logical length: new tokens get their true positions
    held = cache.held_tokens()
    assert max(held) < total
    if name == "pyramidkv":
        assert held[0] > held[1]  # deeper layer, smaller budget; the multi-token step needed per-layer masks


# -- decode-phase budgets ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", DECODE_EVICTING, ids=[n + str(p) for n, p in DECODE_EVICTING])
def test_budget_holds_at_every_decode_step(tiny_model, tiny_ids, name, params):
    for budget in ({"budget_tokens": 24}, {"compression_ratio": 0.75}):
        strategy = strategies.build(name, {**params, **budget})
        cache = KVBenchCache(strategy, tiny_model.config)
        tok = tiny_ids[:, :40]
        with torch.inference_mode(), cache.attach(tiny_model):
            for step in range(200):
                logits = tiny_model(input_ids=tok, cache=cache, use_cache=True).logits
                seen = 40 + step
                limit = min(seen, 24) if "budget_tokens" in budget else keep_count(seen, 0.75, None)
                assert cache.held_tokens() == [limit, limit], step
                for layer in cache.layers:
                    assert layer.store.inner.keys.shape == (1, 2, limit, 16)
                tok = logits[:, -1:].argmax(-1)
        assert cache.get_seq_length() == 239
        assert cache.kv_bytes() < cache.kv_bytes_fp16()


@pytest.mark.parametrize("name", ["snapkv", "knorm", "random", "pyramidkv"])
def test_prefill_only_strategies_let_new_tokens_accumulate(tiny_model, tiny_ids, name):
    cache = KVBenchCache(strategies.build(name, {"budget_tokens": 16, "window_size": 4}
                                          if name in ("snapkv", "pyramidkv") else {"budget_tokens": 16}),
                         tiny_model.config)
    with torch.inference_mode(), cache.attach(tiny_model):
        tiny_model(input_ids=tiny_ids[:, :40], cache=cache, use_cache=True)
        before = cache.held_tokens()
        tiny_model(input_ids=tiny_ids[:, 40:50], cache=cache, use_cache=True)
    assert [h + 10 for h in before] == cache.held_tokens()


# -- the engine's paths --------------------------------------------------------------------------------------
def _shared_prefill(model, ids, window):
    cache = KVBenchCache(strategies.build("full"), model.config)
    with torch.inference_mode(), QueryRecorder(model, window) as rec:
        model(input_ids=ids, cache=cache, use_cache=True)
    return [la.store.keys for la in cache.layers], [la.store.values for la in cache.layers], rec.captures


@pytest.mark.parametrize("name", EVICTION)
def test_shared_prefill_path_then_question_and_decoding(tiny_model, tiny_ids, name):
    keys, values, caps = _shared_prefill(tiny_model, tiny_ids[:, :64], None)
    snapshot = [k.clone() for k in keys]
    strategy = strategies.build(name, {"compression_ratio": 0.5})
    strategy.bind(RunContext(model=tiny_model))
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values, caps)
    reduction = 1 - cache.kv_bytes() / KVBenchCache.from_capture(
        strategies.build("full"), tiny_model.config, keys, values, caps).kv_bytes()
    assert reduction == pytest.approx(0.5, abs=0.02)
    with torch.inference_mode(), cache.attach(tiny_model):
        logits = tiny_model(input_ids=tiny_ids[:, 64:80], cache=cache, use_cache=True).logits
        for _ in range(4):
            logits = tiny_model(input_ids=logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 84
    assert all(torch.equal(a, b) for a, b in zip(keys, snapshot, strict=True))  # shared prefill untouched


def test_decoding_without_attach_is_refused(tiny_model, tiny_ids):
    keys, values, caps = _shared_prefill(tiny_model, tiny_ids[:, :64], None)
    cache = KVBenchCache.from_capture(strategies.build("h2o"), tiny_model.config, keys, values, caps)
    with torch.inference_mode(), pytest.raises(KVBenchError, match="cache.attach"):
        tiny_model(input_ids=tiny_ids[:, 64:65], cache=cache, use_cache=True)


@pytest.mark.parametrize("name", EVICTION)
def test_chunked_prefill_compacts_to_budget(tiny_model, tiny_ids, name):
    params = {"compression_ratio": 0.5, "window_size": 4} if name in ("snapkv", "pyramidkv") \
        else {"compression_ratio": 0.5}
    strategy = strategies.build(name, params)
    strategy.bind(RunContext(model=tiny_model))
    cache = KVBenchCache(strategy, tiny_model.config)
    with torch.inference_mode(), cache.attach(tiny_model):
        for start in range(0, 96, 24):
            tiny_model(input_ids=tiny_ids[:, start:start + 24], cache=cache, use_cache=True)
            for layer in cache.layers:
                layer.store.compact()
            seen = start + 24
            want = [strategy.prefill_keep(seen, i, 2) for i in range(2)]
            assert cache.held_tokens() == want


# -- the sweep script's table --------------------------------------------------------------------------------
def test_sweep_table_from_run_summaries(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import sweep_eviction
    finally:
        sys.path.pop(0)
    import pandas as pd

    rows = []
    for ratio, acc in ((0.5, 0.6), (0.75, 0.4)):
        run = tmp_path / f"run{ratio}"
        run.mkdir()
        pd.DataFrame([
            {"task": "legal", "strategy": "full", "accuracy": 0.8, "delta_pp": 0.0, "memory_reduction": 0.0,
             "ttft_s": 1.0, "decode_ms_per_token": 10.0, "kl": 0.0},
            {"task": "legal", "strategy": f"snapkv(compression_ratio={ratio})", "accuracy": acc,
             "delta_pp": 100 * (acc - 0.8), "memory_reduction": ratio, "ttft_s": 1.1,
             "decode_ms_per_token": 9.0, "kl": 0.1},
        ]).to_csv(run / "summary.csv", index=False)
        rows += sweep_eviction.rows_from_run(run, "snapkv", ratio)
    table = sweep_eviction.build_table(rows)
    assert list(table["ratio"]) == [0.5, 0.75]
    assert table["delta_pp"].tolist() == pytest.approx([-20.0, -40.0])
    assert table["memory_reduction"].tolist() == [0.5, 0.75]
    md = sweep_eviction.to_markdown(table)
    assert "snapkv" in md and "-40.0" in md and math.isfinite(table["baseline_accuracy"].iloc[0])


@pytest.mark.integration
def test_real_model_eviction_in_bf16(smollm):
    """SmolLM2 (30 layers, 9 query heads on 3 KV heads, bf16): every strategy from one shared prefill halves
    the measured bytes (pyramid's mean included), answers a question and decodes within its budget."""
    model, tok = smollm.model, smollm.tokenizer
    text = "Alice keeps the red key in the blue box under the old oak table in the kitchen. " * 16
    ids = torch.tensor([tok(text)["input_ids"][:256]])
    keys, values, caps = _shared_prefill(model, ids, None)
    for name in EVICTION:
        strategy = strategies.build(name, {"compression_ratio": 0.5})
        strategy.bind(RunContext(model=model))
        cache = KVBenchCache.from_capture(strategy, model.config, keys, values, caps)
        held = cache.held_tokens()
        assert sum(held) == 30 * 128 and cache.layers[0].store.inner.keys.dtype == torch.bfloat16
        expected = 0.5 - (0.5 * 4 / 256 if name == "h2o" else 0)  # H2O: 4-byte sums beside 256-byte K+V
        assert 1 - cache.kv_bytes() / cache.kv_bytes_fp16() == pytest.approx(expected, abs=1e-3)
        with torch.inference_mode(), cache.attach(model):
            logits = model(input_ids=ids[:, -6:], cache=cache, use_cache=True).logits
            for _ in range(3):
                logits = model(input_ids=logits[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
        assert torch.isfinite(logits.float()).all() and cache.get_seq_length() == 265
        if strategy.evicts_during_decode():  # type: ignore[attr-defined]
            assert cache.held_tokens() == [keep_count(265, 0.5, None)] * 30
        if name == "pyramidkv":
            assert held[0] > held[-1]
