"""``compose``: eviction then quantization — measured bytes multiply, kept tokens match plain eviction,
decode-time eviction works on quantized stores, and bad combinations are refused up front."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from kvbench.strategies._eviction import EvictingStore, keep_count
from kvbench.strategies.base import LayerCapture, LayerStore, RunContext, Strategy

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.errors import KVBenchError

CONF = Path(__file__).resolve().parents[1] / "conf"


# Tiny-model steps are dominated by thread hand-offs; every test here runs on one torch thread.
pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _cfg(layers: int = 1):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)


def _prefix(n: int = 128, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
    cap = LayerCapture(layer_idx=0, num_kv_groups=2, scaling=d ** -0.5, queries=torch.randn(1, 4, n, d, generator=g))
    return keys, values, cap


def _cache(name: str, params: dict, keys, values, cap) -> KVBenchCache:
    return KVBenchCache.from_capture(strategies.build(name, params), _cfg(), [keys], [values], [cap])


def test_snapkv_half_then_int8_holds_the_product_of_both_savings():
    keys, values, cap = _prefix()
    cache = _cache("compose", {"evict": "snapkv", "evict_params": {"compression_ratio": 0.5}, "quantize": "int8"},
                   keys, values, cap)
    fp16 = cache.kv_bytes_fp16()
    assert fp16 == 2 * 2 * 128 * 64 * 2
    # int8 with one float16 scale per 64 channels: 8.25 bits per element; half the tokens kept.
    assert cache.kv_bytes() == pytest.approx(0.5 * 8.25 / 16 * fp16, rel=1e-3)
    assert 1 - cache.kv_bytes() / fp16 == pytest.approx(1 - 0.5 * 8.25 / 16, abs=1e-3)
    int8_only = _cache("int8", {}, keys, values, cap)
    snap_only = _cache("snapkv", {"compression_ratio": 0.5}, keys, values, cap)
    assert cache.kv_bytes() == pytest.approx(0.5 * int8_only.kv_bytes(), rel=1e-3)
    assert cache.held_tokens() == snap_only.held_tokens() == [64]


QUANTIZERS = [("int8", {}), ("int4", {"residual_length": 0}), ("int2", {"residual_length": 0}), ("fp8", {}),
              ("bfp", {})]


@pytest.mark.parametrize("quant,qparams", QUANTIZERS, ids=[q for q, _ in QUANTIZERS])
def test_every_quantizer_stacks_under_eviction(quant, qparams):
    keys, values, cap = _prefix()
    alone = _cache(quant, qparams, keys, values, cap)
    stacked = _cache("compose", {"evict": "knorm", "evict_params": {"compression_ratio": 0.5},
                                 "quantize": quant, "quantize_params": qparams}, keys, values, cap)
    assert stacked.kv_bytes() == pytest.approx(0.5 * alone.kv_bytes(), rel=0.02)
    assert stacked.kv_bytes() < 0.5 * stacked.kv_bytes_fp16()


def test_kept_tokens_are_the_plain_strategys_and_inputs_untouched():
    keys, values, cap = _prefix()
    k0 = keys.clone()
    plain = _cache("snapkv", {"compression_ratio": 0.75}, keys, values, cap).layers[0].store
    on_full = _cache("compose", {"evict": "snapkv", "evict_params": {"compression_ratio": 0.75},
                                 "quantize": "full"}, keys, values, cap).layers[0].store
    on_int8 = _cache("compose", {"evict": "snapkv", "evict_params": {"compression_ratio": 0.75},
                                 "quantize": "int8"}, keys, values, cap).layers[0].store
    assert isinstance(on_int8, EvictingStore) and isinstance(on_int8.strategy, Strategy)
    assert on_int8.strategy.name == "compose"  # a reset layer is rebuilt by compose, quantizer included
    assert torch.equal(plain.inner.keys, on_full.inner.keys)
    k8, _ = on_int8.inner.materialize()
    assert k8.shape == plain.inner.keys.shape
    assert (k8 - plain.inner.keys).abs().max() <= plain.inner.keys.abs().max() / 127
    assert torch.equal(keys, k0)


@pytest.mark.parametrize("evict,quant,qparams", [
    ("h2o", "int8", {"group_size": 16}),
    ("streaming_llm", "fp8", {}),
    ("tova", "int4", {"residual_length": 8, "group_size": 16}),
])
def test_decode_eviction_on_a_quantized_store(tiny_model, tiny_ids, evict, quant, qparams):
    strategy = strategies.build("compose", {"evict": evict, "evict_params": {"budget_tokens": 24},
                                            "quantize": quant, "quantize_params": qparams})
    strategy.bind(RunContext(model=tiny_model))
    cache = KVBenchCache(strategy, tiny_model.config)
    plain = KVBenchCache(strategies.build(evict, {"budget_tokens": 24}), tiny_model.config)
    tok = tiny_ids[:, :40]
    with torch.inference_mode(), cache.attach(tiny_model):
        for step in range(60):
            logits = tiny_model(input_ids=tok, cache=cache, use_cache=True).logits
            assert cache.held_tokens() == [24, 24], step
            tok = logits[:, -1:].argmax(-1)
    with torch.inference_mode(), plain.attach(tiny_model):
        tiny_model(input_ids=tiny_ids[:, :40], cache=plain, use_cache=True)
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 99
    assert cache.kv_bytes() < plain.kv_bytes()
    assert cache.stats()["decode_evicted_tokens"] == 99 - 24 - (40 - 24)


@pytest.mark.parametrize("params,needle", [
    ({"evict": "int8"}, "valid: h2o, knorm, pyramidkv, random, snapkv, streaming_llm, tova"),
    ({"quantize": "snapkv"}, "compose.quantize must be a quantizer"),
    ({"evict_params": {"bogus": 1}}, "has no parameter bogus"),
    ({"evict_params": "half"}, "must be a mapping"),
    ({"evict_params": {"compression_ratio": 0.5, "budget_tokens": 8}}, "not both"),
    ({"quantize_params": {"group_size": 7}}, "group_size"),
])
def test_bad_compositions_are_refused(params, needle):
    with pytest.raises(KVBenchError, match=needle.replace("(", r"\(")):
        strategies.build("compose", params)


class _BlockStore(LayerStore):
    """A store whose encoding spans tokens and so cannot drop single ones."""

    def prefill(self, keys, values, capture):
        self.k = keys

    def append(self, keys, values):
        return keys, values

    def tensors(self):
        return [self.k]

    def num_tokens(self):
        return self.k.shape[-2]


@dataclass
class _BlockQuant(Strategy):
    name = "blockquant"
    family = "quantization"

    def new_layer(self, layer_idx, num_layers):
        return _BlockStore(self, layer_idx, num_layers)


def test_decode_eviction_needs_a_store_that_drops_tokens(monkeypatch):
    strategies.available()
    monkeypatch.setitem(strategies._REGISTRY, "blockquant", _BlockQuant)
    with pytest.raises(KVBenchError, match="select_tokens"):
        strategies.build("compose", {"evict": "h2o", "quantize": "blockquant"})
    # Prefill-only eviction never drops tokens from the quantized store, so it is allowed.
    assert strategies.build("compose", {"evict": "snapkv", "quantize": "blockquant"}).quantize == "blockquant"


def test_query_window_and_labels():
    assert strategies.build("compose", {"evict": "h2o"}).query_window is None
    assert strategies.build("compose", {"evict": "knorm"}).query_window == 0
    assert strategies.build("compose", {"evict_params": {"window_size": 16}}).query_window == 16
    from omegaconf import OmegaConf

    from kvbench.config import compose_config  # the config node is generated from the dataclass

    cfg = OmegaConf.to_container(compose_config(["strategy=compose"]).strategy)
    cfg.pop("name")
    assert strategies.build("compose", cfg).label() == strategies.build("compose").label()
    assert "compression_ratio': 0.25" in strategies.build(
        "compose", {"evict_params": {"compression_ratio": 0.25, "budget_tokens": None}}).label()


def test_yaml_overrides_reach_the_inner_strategies():
    from kvbench.config import compose_config

    cfg = compose_config(["strategy=compose", "strategy.evict=h2o", "strategy.evict_params.compression_ratio=0.25",
                          "+strategy.evict_params.recent_fraction=0.25", "strategy.quantize=int4",
                          "+strategy.quantize_params.residual_length=0"]).strategy
    from omegaconf import OmegaConf

    params = OmegaConf.to_container(cfg, resolve=True)
    params.pop("name")
    built = strategies.build("compose", params)
    assert built.evictor.compression_ratio == 0.25 and built.evictor.recent_fraction == 0.25
    assert built.quantizer.residual_length == 0
    n = 1000
    assert built.evictor.prefill_keep(n, 0, 1) == keep_count(n, 0.25, None) == 750


@pytest.mark.integration
def test_real_model_compose_bytes_and_decoding(smollm):
    """SmolLM2 (head_dim 64, bf16): SnapKV 50% + int8 holds 0.5 x 8.25/16 of the 16-bit cache, and decodes."""
    from kvbench.capture import QueryRecorder

    model, tok = smollm.model, smollm.tokenizer
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 20
    ids = torch.tensor([tok(text)["input_ids"][:256]])
    full = KVBenchCache(strategies.build("full"), model.config)
    with torch.inference_mode(), QueryRecorder(model, 32) as rec:
        model(input_ids=ids, cache=full, use_cache=True)
    keys = [la.store.keys for la in full.layers]
    values = [la.store.values for la in full.layers]
    strategy = strategies.build("compose", {"evict_params": {"compression_ratio": 0.5}})
    cache = KVBenchCache.from_capture(strategy, model.config, keys, values, rec.captures)
    assert cache.kv_bytes_fp16() == full.kv_bytes()
    assert cache.kv_bytes() == pytest.approx(0.5 * 8.25 / 16 * cache.kv_bytes_fp16(), rel=1e-3)
    with torch.inference_mode():
        logits = model(input_ids=ids[:, -8:], cache=cache, use_cache=True).logits
    assert torch.isfinite(logits.float()).all() and cache.get_seq_length() == 264
    assert cache.layers[0].store.inner.materialize()[0].dtype == torch.bfloat16
