"""The ``quant_recompute`` strategy: exact recomputation, byte and FLOP accounting by hand, costs, errors."""

from __future__ import annotations

import pytest
import torch
from kvbench.strategies.base import RunContext
from kvbench.strategies.quant_recompute import QuantRecomputeStore, recompute_flops

from kvbench import attention, strategies
from kvbench.cache import KVBenchCache
from kvbench.errors import KVBenchError
from kvbench.hardware import HardwareProfile
from kvbench.quantizers import quantize_asymmetric


def _bound(model, ids, params, hardware=None):
    strategy = strategies.build("quant_recompute", params)
    strategy.bind(RunContext(model=model, prefix_ids=ids, hardware=hardware))
    return strategy


def _prefill(model, ids):
    cache = KVBenchCache(strategies.build("full"), model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
    return [layer.store.keys for layer in cache.layers], [layer.store.values for layer in cache.layers]


def _question_logits(model, prefix, question, strategy, kv=None):
    keys, values = kv or _prefill(model, prefix)
    with torch.inference_mode():
        cache = KVBenchCache.from_capture(strategy, model.config, keys, values)
        return model(input_ids=question, cache=cache, use_cache=True).logits, cache


def test_whole_prefix_recomputed_generation_equals_full(tiny_model, tiny_ids):
    """recompute_tokens=-1 and a residual window longer than the answer: nothing is ever quantized."""
    kwargs = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.inference_mode():
        ref = tiny_model.generate(tiny_ids, cache=KVBenchCache(strategies.build("full"), tiny_model.config),
                                  **kwargs)
        strategy = _bound(tiny_model, tiny_ids, {"recompute_tokens": -1, "residual_tokens": 32, "group_size": 16})
        cache = KVBenchCache(strategy, tiny_model.config)
        out = tiny_model.generate(tiny_ids, cache=cache, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    st = cache.stats()
    # With the working copy (the default) the segment's rows are recomputed once and stay in it.
    assert st["recompute_fraction"] == 1.0 and st["measured_recomputes"] == 1 and st["measured_steps"] == 19
    assert cache.kv_bytes() < cache.kv_bytes_fp16()  # ids (4 B/token) + the exact residual window only


@pytest.mark.parametrize("impl", ["sdpa", "kvbench"])
def test_working_copy_recomputes_once_with_the_tokens_of_recomputing_every_step(tiny_model, tiny_ids, impl):
    """Without scratch the segment is recomputed at every step; with it (a dense reader's working copy, or kvbench
    attention's kept segment rows), once; the output is equal."""
    if impl == "kvbench":
        attention.use(tiny_model, "kvbench", "cpu")
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_logits=True)
    out, stats = {}, {}
    for working in (True, False):
        strategy = strategies.build("quant_recompute", {"recompute_tokens": 40, "residual_tokens": 8,
                                                        "group_size": 8})
        strategy.bind(RunContext(model=tiny_model, prefix_ids=tiny_ids, working_copy=working))
        cache = KVBenchCache(strategy, tiny_model.config)
        with torch.inference_mode():
            out[working] = tiny_model.generate(tiny_ids, cache=cache, **kwargs)
        stats[working] = cache.stats()
        assert (cache.scratch_bytes() > 0) == working
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(out[True].logits, out[False].logits, strict=True))
    assert stats[True]["measured_recomputes"] == 1 and stats[False]["measured_recomputes"] == 11
    assert stats[True]["measured_steps"] == stats[False]["measured_steps"] == 11


def test_capture_path_recompute_equals_full_and_frees_the_segment(tiny_model, tiny_ids):
    prefix, question = tiny_ids[:, :80], tiny_ids[:, 80:]
    want, _ = _question_logits(tiny_model, prefix, question, strategies.build("full"))
    strategy = _bound(tiny_model, prefix, {"recompute_tokens": -1, "residual_tokens": 0, "group_size": 16})
    got, cache = _question_logits(tiny_model, prefix, question, strategy)
    assert torch.equal(want, got)  # the question's own tokens are attended exactly in their step
    store: QuantRecomputeStore = cache.layers[0].store
    assert store.segment is not None and store.segment.pending == {}  # every layer took and dropped its K/V
    assert store.qk is not None and store.qk.num_tokens == 16  # then the question was quantized (residual 0)


@pytest.mark.parametrize("n", [40, 96])
def test_recomputed_kv_is_the_prefill_kv(tiny_model, tiny_ids, n):
    """Bit-identical for the whole prefix (the same kernels on the same shapes); for a shorter segment
    the matmuls run on fewer rows and may round differently in the last bit (float32 here)."""
    keys, values = _prefill(tiny_model, tiny_ids)
    strategy = _bound(tiny_model, tiny_ids, {"recompute_tokens": n, "group_size": 16})
    with torch.inference_mode():
        cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
        seg = cache.layers[0].store.segment
        for layer in range(2):
            k, v = seg.kv(layer, step=0)
            if n == 96:
                assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])
            torch.testing.assert_close(k, keys[layer][:, :, :n], rtol=0, atol=1e-6)
            torch.testing.assert_close(v, values[layer][:, :, :n], rtol=0, atol=1e-6)


def test_recompute_tokens_trade_error(tiny_model, tiny_ids):
    """At 2 bits, recomputing the leading tokens brings the logits closer to full (and -1 makes them equal)."""
    prefix, question = tiny_ids[:, :80], tiny_ids[:, 80:]
    kv = _prefill(tiny_model, prefix)
    want, _ = _question_logits(tiny_model, prefix, question, strategies.build("full"), kv)
    err = {}
    for n in (0, 40, -1):
        strategy = _bound(tiny_model, prefix, {"bits": 2, "group_size": 8, "recompute_tokens": n,
                                               "residual_tokens": 0})
        got, cache = _question_logits(tiny_model, prefix, question, strategy, kv)
        err[n] = float((got - want).abs().max())
        st = cache.stats()
        if n == 40:
            assert st["quant_rel_error_k"] > 0.1 and st["segment_quant_rel_error_k"] > 0.1
    assert err[0] > err[40] > err[-1] == 0.0


def test_bytes_by_hand(tiny_model, tiny_ids):
    """96 tokens: 32 recomputed (ids only), 48 at 4 bits, the last 16 exact (float32 here)."""
    keys, values = _prefill(tiny_model, tiny_ids)
    h, d, layers = 2, 16, 2
    for bits, per_token_head in ((4, 16 * 4 // 8 + 2 * 2), (2, 16 * 2 // 8 + 2 * 2), (8, 16 + 2)):
        strategy = _bound(tiny_model, tiny_ids, {"bits": bits, "group_size": 16, "recompute_tokens": 32,
                                                 "residual_tokens": 16})
        cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
        quant = 2 * h * 48 * per_token_head  # K and V codes + fp16 scale (and minimum below 8 bits)
        residual = 2 * h * 16 * d * 4
        ids = 32 * 4  # int32 token ids, one copy shared by every layer
        assert cache.kv_bytes() == layers * (quant + residual) + ids
        st = cache.stats()
        assert st["quant_bytes"] == layers * quant and st["residual_bytes"] == layers * residual
        assert st["ids_bytes"] == ids
        assert st["segment_fp16_bytes"] == layers * 2 * h * 32 * d * 2
        assert st["segment_quant_bytes"] == layers * 2 * h * 32 * per_token_head
        assert st["recompute_bytes_saved"] == st["segment_fp16_bytes"] - ids
        assert cache.held_tokens() == [96, 96]
    assert cache.layers[0].store.qk.codes.dtype == torch.int8  # the last loop ran 8 bits


def test_packed_codes_are_really_packed(tiny_model, tiny_ids):
    keys, values = _prefill(tiny_model, tiny_ids)
    strategy = _bound(tiny_model, tiny_ids, {"bits": 2, "group_size": 8, "recompute_tokens": 0,
                                             "residual_tokens": 0})
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    q = cache.layers[0].store.qk
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (1, 2, 96, 16 // 4)


def test_flops_by_hand(tiny_model):
    # Per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate/up 64x128, down 128x64 = 36864 weights.
    linear = 2 * 36864
    for n in (1, 32, 96):
        attention = 2 * 2 * 4 * 16 * n * (n + 1)  # 2 FLOPs x (QK^T + AV) over n(n+1)/2 pairs, 4 heads x 16 dims
        assert recompute_flops(tiny_model, n) == 2 * linear * n + attention
    assert recompute_flops(tiny_model, 32, batch=3) == 3 * recompute_flops(tiny_model, 32)


def test_cost_figures_measured_and_modelled(tiny_model, tiny_ids):
    profile = HardwareProfile(name="gpu-test", device="cuda", dtype="float16", memory_bytes=1 << 30,
                              device_mem_bw_gbps=1000.0, host_link_bw_gbps=20.0, disk_bw_gbps=2.0,
                              peak_flops=2e12)
    keys, values = _prefill(tiny_model, tiny_ids)
    strategy = _bound(tiny_model, tiny_ids, {"recompute_tokens": 32, "group_size": 16}, hardware=profile)
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    st = cache.stats()
    flops = recompute_flops(tiny_model, 32)
    assert st["recompute_flops_per_step"] == flops
    assert st["modelled_recompute_seconds_per_step"] == pytest.approx(flops / 2e12)
    assert st["modelled_load_seconds_per_step"] == pytest.approx(st["segment_fp16_bytes"] / 20e9)
    assert st["measured_recomputes"] == 0 and "measured_recompute_seconds_per_step" not in st
    with torch.inference_mode():
        for i in range(3):
            tiny_model(input_ids=tiny_ids[:, i:i + 1], cache=cache, use_cache=True)
    st = cache.stats()
    assert st["measured_recomputes"] == 1 and st["measured_steps"] == 3  # once: its rows stay in the working copy
    assert 0 < st["measured_recompute_seconds_per_step"] < 5.0
    assert st["peak_transient_bytes"] == 2 * 2 * 2 * 32 * 16 * 4  # layers x (K, V) x heads x tokens x dims x fp32


def test_needs_bound_ids_and_model(tiny_model, tiny_ids):
    keys, values = _prefill(tiny_model, tiny_ids)
    unbound = strategies.build("quant_recompute", {"group_size": 16})
    with pytest.raises(KVBenchError, match=r"strategy.bind\(RunContext\(model=..., prefix_ids=...\)\)"):
        KVBenchCache.from_capture(unbound, tiny_model.config, keys, values)
    wrong = _bound(tiny_model, tiny_ids[:, :50], {"group_size": 16})
    with pytest.raises(KVBenchError, match="hold 50 tokens but the cache prefix has 96"):
        KVBenchCache.from_capture(wrong, tiny_model.config, keys, values)
    # Nothing to recompute: no context needed.
    plain = strategies.build("quant_recompute", {"group_size": 16, "recompute_tokens": 0})
    assert KVBenchCache.from_capture(plain, tiny_model.config, keys, values).held_tokens() == [96, 96]


@pytest.mark.parametrize("params, message", [
    ({"bits": 3}, "bits must be one of 8, 4, 2"),
    ({"group_size": 48}, "group_size must be one of 8, 16, 32"),
    ({"recompute_tokens": -2}, "recompute_tokens must be an integer >= 0, or -1"),
    ({"residual_tokens": -1}, "residual_tokens must be an integer >= 0"),
])
def test_bad_parameters_name_valid_values(params, message):
    with pytest.raises(KVBenchError, match=message):
        strategies.build("quant_recompute", params)


def test_group_size_must_divide_head_dim(tiny_model, tiny_ids):
    keys, values = _prefill(tiny_model, tiny_ids)
    with pytest.raises(KVBenchError, match="group_size=32 must divide head_dim=16"):
        KVBenchCache.from_capture(_bound(tiny_model, tiny_ids, {}), tiny_model.config, keys, values)


@pytest.mark.integration
def test_smollm_whole_prefix_recompute_equals_full(smollm):
    """bf16 SmolLM2, 128-token prefix recomputed each step: the same logits as the full cache."""
    model = smollm.model
    ids = torch.randint(10, 5000, (1, 136), generator=torch.Generator().manual_seed(0))
    prefix, question = ids[:, :128], ids[:, 128:]
    kv = _prefill(model, prefix)
    want, _ = _question_logits(model, prefix, question, strategies.build("full"), kv)
    strategy = _bound(model, prefix, {"recompute_tokens": -1, "residual_tokens": 8})
    got, cache = _question_logits(model, prefix, question, strategy, kv)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    st = cache.stats()
    assert st["recompute_flops_per_step"] == recompute_flops(model, 128)
    assert cache.kv_bytes() == 128 * 4 + 30 * 2 * 3 * 8 * 64 * 2  # the ids, and the question in the residual


def test_yaml_lists_every_parameter_with_its_default():
    from kvbench.config import compose_config  # the config is generated from the dataclass

    cfg = dict(compose_config(["strategy=quant_recompute"]).strategy)
    assert cfg.pop("name") == "quant_recompute"
    assert cfg == strategies.build("quant_recompute").params()


def test_keys_are_quantized_per_channel_values_per_token(tiny_model, tiny_ids):
    """KIVI's format (issue 15): key groups run along tokens within a channel (a scale per channel per group of
    G tokens), value groups along channels within a token. Tokens that do not fill a key group wait exact."""
    keys, values = _prefill(tiny_model, tiny_ids)
    strategy = _bound(tiny_model, tiny_ids, {"bits": 4, "group_size": 8, "recompute_tokens": 32,
                                             "residual_tokens": 10})
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    store: QuantRecomputeStore = cache.layers[0].store
    # 96 - 32 recomputed = 64 stored; values: 54 quantized + 10 exact; keys: 48 (6 whole groups) + 16 exact
    assert store.qk.axis == "channel" and store.qk.scale.shape == (1, 2, 6, 1, 16)
    assert store.qv.axis == "token" and store.qv.scale.shape == (1, 2, 54, 2, 1)
    assert store.residual[0].shape[-2] == 16 and store.residual[1].shape[-2] == 10
    want = quantize_asymmetric(keys[0][:, :, 32:80], 4, 8, "channel").dequantize(keys[0].dtype)
    assert torch.equal(store.qk.dequantize(keys[0].dtype), want)
    # outlier channels: per-channel key groups beat per-token ones on the same tokens
    k = keys[0][:, :, 32:80].clone()
    k[..., ::4] *= 20
    per_channel = quantize_asymmetric(k, 4, 8, "channel").dequantize(k.dtype)
    per_token = quantize_asymmetric(k, 4, 8, "token").dequantize(k.dtype)
    assert (per_channel - k).pow(2).mean() < (per_token - k).pow(2).mean()
    # decoding: keys flush a whole group at a time, values one token at a time
    with torch.inference_mode():
        for i in range(5):
            tiny_model(input_ids=tiny_ids[:, i:i + 1], cache=cache, use_cache=True)
    assert store.qk.num_tokens == 56 and store.residual[0].shape[-2] == 13
    assert store.qv.num_tokens == 59 and store.residual[1].shape[-2] == 10


def test_working_copy_bit_identical_and_outside_kv_bytes(tiny_model, tiny_ids):
    """Issue 14 for quant_recompute: the same logits with and without the working copy; kv_bytes unchanged."""
    keys, values = _prefill(tiny_model, tiny_ids)
    runs = []
    for working in (True, False):
        strategy = strategies.build("quant_recompute", {"group_size": 8, "residual_tokens": 4})
        strategy.bind(RunContext(model=tiny_model, prefix_ids=tiny_ids, working_copy=working))
        cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
        with torch.inference_mode():
            logits = [tiny_model(input_ids=tiny_ids[:, i:i + 2], cache=cache, use_cache=True).logits
                      for i in range(0, 20, 2)]
        scratch = [t for layer in cache.layers for t in layer.store.scratch_tensors()]
        runs.append((logits, cache.kv_bytes(), scratch))
    (a, bytes_a, scratch_a), (b, bytes_b, scratch_b) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert bytes_a == bytes_b and scratch_a and not scratch_b
