"""The ``tiered`` strategy: exactness against ``full``, tier placement and bytes, disk persistence, prefetch."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from kvbench.strategies.base import RunContext
from kvbench.strategies.tiered import TieredStore, attention_mass

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.hardware import HardwareProfile


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    """Spill files go under this test's own directory, so the test can see exactly what is left behind."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "kvcache"))


def _tier_files(tmp_path) -> list:
    root = tmp_path / "kvcache" / "tiers"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _generate(model, ids, strategy, new_tokens: int = 24, attach: bool = False):
    cache = KVBenchCache(strategy, model.config)
    with torch.inference_mode():
        if attach:
            with cache.attach(model):
                out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                                     return_dict_in_generate=True, output_logits=True)
        else:
            out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                                 return_dict_in_generate=True, output_logits=True)
    return out, cache


def _prefill_capture(model, ids, window: int = 8):
    cache = KVBenchCache(strategies.build("full"), model.config)
    with torch.inference_mode(), QueryRecorder(model, window) as rec:
        model(input_ids=ids, cache=cache, use_cache=True)
    return ([layer.store.keys for layer in cache.layers], [layer.store.values for layer in cache.layers],
            rec.captures)


@pytest.mark.parametrize("params", [
    {"sink_tokens": 4, "recent_tokens": 8, "block_tokens": 16},  # recent window slides: blocks demoted
    {"sink_tokens": 4, "recent_tokens": 8, "block_tokens": 16, "prefetch": False},
    {"sink_tokens": 0, "recent_tokens": 0, "block_tokens": 7, "host_fraction": 0.0},  # everything on disk
    {"sink_tokens": 2, "recent_tokens": 4, "hot_heavy_tokens": 10, "block_tokens": 16, "observation_window": 8},
])
def test_generation_equals_full_bit_for_bit(tiny_model, tiny_ids, params):
    ref, _ = _generate(tiny_model, tiny_ids, strategies.build("full"))
    out, cache = _generate(tiny_model, tiny_ids, strategies.build("tiered", params),
                           attach=bool(params.get("hot_heavy_tokens")))
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    st = cache.stats()
    assert st["host_bytes"] + st["disk_bytes"] > 0  # the test really read cold tiers
    assert st["measured_steps"] == 23 and st["measured_read_bytes_per_step"] > 0


def test_capture_path_with_heavy_tokens_equals_full(tiny_model, tiny_ids):
    """The engine's path: build from a shared prefill (queries captured), then forward the question."""
    prefix, question = tiny_ids[:, :80], tiny_ids[:, 80:]
    keys, values, caps = _prefill_capture(tiny_model, prefix)
    originals = [k.clone() for k in keys]
    with torch.inference_mode():
        full = KVBenchCache.from_capture(strategies.build("full"), tiny_model.config, keys, values, caps)
        want = tiny_model(input_ids=question, cache=full, use_cache=True).logits
        strategy = strategies.build("tiered", {"hot_heavy_tokens": 12, "recent_tokens": 8, "block_tokens": 10,
                                               "observation_window": 8})
        tiered = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values, caps)
        got = tiny_model(input_ids=question, cache=tiered, use_cache=True).logits
    assert torch.equal(want, got)
    assert all(torch.equal(a, b) for a, b in zip(keys, originals, strict=True))  # prefill left untouched
    assert strategy.query_window == 8 and strategies.build("tiered").query_window == 0


def test_heavy_tokens_are_the_most_attended(tiny_ids):
    """attention_mass against the eager attention weights the model itself computes."""
    from kvbench.models import tiny_llama

    model = tiny_llama(seed=0, attn_implementation="eager")
    window, ids = 8, tiny_ids[:, :64]
    with torch.inference_mode(), QueryRecorder(model, window) as rec:
        cache = KVBenchCache(strategies.build("full"), model.config)
        out = model(input_ids=ids, cache=cache, use_cache=True, output_attentions=True)
    for layer, weights in enumerate(out.attentions):  # [1, q_heads, T, T]
        want = weights[:, :, -window:].sum(dim=2).reshape(1, 2, 2, -1).sum(dim=2)  # 2 q-heads per KV head
        got = attention_mass(cache.layers[layer].store.keys, rec.captures[layer], window)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    keys, values, caps = _prefill_capture(model, ids, window)
    strategy = strategies.build("tiered", {"sink_tokens": 4, "recent_tokens": 4, "hot_heavy_tokens": 6,
                                           "observation_window": window})
    with torch.inference_mode():
        tiered = KVBenchCache.from_capture(strategy, model.config, keys, values, caps)
    store = tiered.layers[1].store
    mass = attention_mass(keys[1], caps[1], window)[..., 4:60]
    expected = (mass.topk(6, dim=-1).indices + 4).sort(dim=-1).values
    assert torch.equal(store.heavy[2].long(), expected)
    assert torch.equal(store.heavy[0], keys[1].gather(2, expected[..., None].expand(-1, -1, -1, 16)))


def test_tier_placement_and_bytes_by_hand(tiny_model, tiny_ids):
    """96 tokens, 4 sinks, 12 recent: 80 cold, a quarter (the newest 20) in host memory, 60 on disk."""
    keys, values, _ = _prefill_capture(tiny_model, tiny_ids)
    strategy = strategies.build("tiered", {"sink_tokens": 4, "recent_tokens": 12, "host_fraction": 0.25,
                                           "block_tokens": 16})
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    h, d, f32 = 2, 16, 4
    layers = tiny_model.config.num_hidden_layers
    assert cache.kv_bytes() == layers * 2 * h * (4 + 12) * d * f32  # device-resident: the hot tier only
    assert cache.kv_bytes_fp16() == layers * 2 * h * 96 * d * 2
    st = cache.stats()
    assert st["host_bytes"] == layers * 2 * h * 20 * d * f32
    assert st["disk_bytes"] == layers * 2 * h * 60 * d * f32
    assert st["hot_bytes"] == cache.kv_bytes()
    assert st["total_held_bytes"] == layers * 2 * h * 96 * d * f32
    assert st["step_read_bytes"] == st["host_bytes"] + st["disk_bytes"]
    assert st["hot_token_fraction"] == pytest.approx(16 / 96)
    assert st["disk_token_fraction"] == pytest.approx(60 / 96)
    assert st["measured_steps"] == 0 and "measured_read_seconds_per_step" not in st
    store: TieredStore = cache.layers[0].store
    # Disk holds the oldest cold positions 4..63 in blocks of 16 (the last one partial), host 64..83.
    assert [(b.packet.tier, b.start, b.tokens) for b in store.blocks] == [
        ("disk", 4, 16), ("disk", 20, 16), ("disk", 36, 16), ("disk", 52, 12), ("host", 64, 16), ("host", 80, 4)]
    assert store.num_tokens() == 96 and cache.held_tokens() == [96, 96]


def test_int8_cold_tier_bytes_and_accuracy(tiny_model, tiny_ids):
    params = {"sink_tokens": 4, "recent_tokens": 12, "host_fraction": 0.25, "block_tokens": 16}
    keys, values, _ = _prefill_capture(tiny_model, tiny_ids[:, :80])
    question = tiny_ids[:, 80:]
    with torch.inference_mode():
        full = KVBenchCache.from_capture(strategies.build("full"), tiny_model.config, keys, values)
        want = tiny_model(input_ids=question, cache=full, use_cache=True).logits
        q8 = KVBenchCache.from_capture(strategies.build("tiered", {**params, "cold_quant": "int8",
                                                                   "quant_group_size": 8}),
                                       tiny_model.config, keys, values)
        st = q8.stats()  # before the forward: 64 cold tokens, 16 on host
        got = tiny_model(input_ids=question, cache=q8, use_cache=True).logits
    layers, h = 2, 2
    per_token_head = 16 * 1 + (16 // 8) * 2  # int8 codes + one fp16 scale per 8 channels
    assert st["host_bytes"] == layers * 2 * h * 16 * per_token_head
    assert st["disk_bytes"] == layers * 2 * h * 48 * per_token_head
    assert not torch.equal(want, got)
    assert (want - got).abs().max() < 0.02 * want.abs().max()
    with pytest.raises(KVBenchError, match="quant_group_size=64 must divide head_dim=16"):
        KVBenchCache.from_capture(strategies.build("tiered", {"cold_quant": "int8", "recent_tokens": 4}),
                                  tiny_model.config, keys, values)


def test_disk_tier_persists_bit_exactly_and_is_removed(tiny_model, tiny_ids, tmp_path):
    keys, values, _ = _prefill_capture(tiny_model, tiny_ids)
    strategy = strategies.build("tiered", {"sink_tokens": 0, "recent_tokens": 0, "host_fraction": 0.0,
                                           "block_tokens": 32})
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    files = _tier_files(tmp_path)
    assert len(files) == 2 * 3  # 2 layers x 96 tokens in blocks of 32, one file per block
    store: TieredStore = cache.layers[1].store
    for block in store.blocks:
        raw = np.fromfile(block.packet.path, dtype=np.uint8)  # read the file itself, not the mapping
        k_ref = keys[1][:, :, block.start:block.start + 32].contiguous()
        v_ref = values[1][:, :, block.start:block.start + 32].contiguous()
        k_bytes = k_ref.view(torch.uint8).numpy().ravel()
        v_off = -(-k_bytes.size // 64) * 64  # tensors start at 64-byte boundaries
        assert np.array_equal(raw[:k_bytes.size], k_bytes)
        assert np.array_equal(raw[v_off:v_off + k_bytes.size], v_ref.view(torch.uint8).numpy().ravel())
    assert cache.stats()["disk_bytes"] == sum(f.stat().st_size for f in files)  # 8 KiB blocks: no padding

    store.close()  # explicit close removes this layer's files and directory at once
    assert len(_tier_files(tmp_path)) == 3
    assert store.dir.path is None and not store.blocks
    del cache, store
    gc.collect()  # the other layer's files go when its store is freed
    assert _tier_files(tmp_path) == []
    assert list((tmp_path / "kvcache" / "tiers").iterdir()) == []


def test_demoted_blocks_keep_the_host_share(tiny_model, tiny_ids):
    strategy = strategies.build("tiered", {"sink_tokens": 4, "recent_tokens": 8, "block_tokens": 8,
                                           "host_fraction": 0.5})
    _, cache = _generate(tiny_model, tiny_ids, strategy, new_tokens=41)
    store: TieredStore = cache.layers[0].store
    total = 96 + 40
    assert store.num_tokens() == total
    tt = store.tier_tokens()
    assert sum(tt.values()) == total
    assert 8 <= store.recent[0].shape[-2] < 16 and store.recent_start + store.recent[0].shape[-2] == total
    assert abs(tt["host"] - 0.5 * (tt["host"] + tt["disk"])) <= 8  # within one block of the target share
    demoted = [b for b in store.blocks if b.start is not None and b.start >= 96 - 8]
    assert len(demoted) >= 4 and {b.packet.tier for b in demoted} == {"host", "disk"}


def test_modelled_and_measured_figures_stay_apart(tiny_model, tiny_ids):
    profile = HardwareProfile(name="gpu-test", device="cuda", dtype="float16", memory_bytes=1 << 30,
                              device_mem_bw_gbps=1000.0, host_link_bw_gbps=10.0, disk_bw_gbps=2.0,
                              peak_flops=1e12)
    strategy = strategies.build("tiered", {"sink_tokens": 4, "recent_tokens": 12, "host_fraction": 0.25,
                                           "block_tokens": 16})
    strategy.bind(RunContext(hardware=profile))
    keys, values, _ = _prefill_capture(tiny_model, tiny_ids)
    cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
    st = cache.stats()
    host, disk = st["host_bytes"], st["disk_bytes"]
    # host blocks cross PCIe once; disk blocks are read from NVMe and then cross PCIe
    assert st["modelled_step_read_seconds"] == pytest.approx(host / 10e9 + disk / 2e9 + disk / 10e9)
    assert st["modelled_offload_write_seconds"] == pytest.approx(st["modelled_step_read_seconds"])
    with torch.inference_mode():
        tiny_model(input_ids=tiny_ids[:, :1], cache=cache, use_cache=True)
        tiny_model(input_ids=tiny_ids[:, 1:2], cache=cache, use_cache=True)
    st = cache.stats()
    assert st["measured_steps"] == 2
    assert st["measured_read_bytes_per_step"] == host + disk
    assert 0 < st["measured_read_seconds_per_step"] < 1.0 and st["measured_stall_seconds_per_step"] >= 0
    assert st["measured_offload_write_seconds"] > 0


@pytest.mark.parametrize("cold_quant", ["none", "int8"])
def test_working_copy_reads_each_block_once_with_the_tokens_of_reading_every_step(tiny_model, tiny_ids, cold_quant):
    """``working_copy=False`` reads every cold block at every step; the working copy (default) reads each block
    once, the prefilled ones at the first step and the demoted ones at the step after their demotion, and keeps
    the dequantized int8 values attention read. Tokens and logits are equal; the copy is reported as scratch."""
    params = {"sink_tokens": 4, "recent_tokens": 8, "block_tokens": 8, "cold_quant": cold_quant,
              "quant_group_size": 8}
    out, stores = {}, {}
    for working in (True, False):
        strategy = strategies.build("tiered", params)
        strategy.bind(RunContext(working_copy=working))
        out[working], cache = _generate(tiny_model, tiny_ids, strategy, new_tokens=20)
        stores[working] = cache.layers[0].store
        assert (cache.scratch_bytes() > 0) == working
    assert torch.equal(out[True].sequences, out[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(out[True].logits, out[False].logits, strict=True))
    once, every = stores[True], stores[False]
    assert len(once.blocks) == len(every.blocks) > 96 // 8  # blocks were demoted while decoding
    assert sum(once.read_bytes.values()) == sum(b.packet.nbytes for b in once.blocks)
    assert sum(every.read_bytes.values()) > 10 * sum(b.packet.nbytes for b in every.blocks) // 2
    st = once.stats()
    assert st["measured_read_bytes_per_step"] == 2 * sum(b.packet.nbytes for b in once.blocks)  # 2 layers
    assert st["measured_read_seconds_per_step"] > 0


@pytest.mark.parametrize("params, message", [
    ({"host_fraction": 1.5}, "host_fraction must be a number in"),
    ({"cold_quant": "int4"}, "cold_quant must be one of none, int8"),
    ({"quant_group_size": 12}, "quant_group_size must be one of 8, 16"),
    ({"block_tokens": 0}, "block_tokens must be an integer >= 1"),
    ({"recent_tokens": -1}, "recent_tokens must be an integer >= 0"),
    ({"prefetch": "yes"}, "prefetch must be true or false"),
])
def test_bad_parameters_name_valid_values(params, message):
    with pytest.raises(KVBenchError, match=message):
        strategies.build("tiered", params)


def test_heavy_tokens_need_captured_queries(tiny_model, tiny_ids):
    cache = KVBenchCache(strategies.build("tiered", {"hot_heavy_tokens": 4, "recent_tokens": 4}), tiny_model.config)
    with torch.inference_mode(), pytest.raises(KVBenchError, match="needs the captured queries"):
        tiny_model(input_ids=tiny_ids, cache=cache, use_cache=True)


@pytest.mark.integration
def test_smollm_tiered_equals_full(smollm):
    """bf16 SmolLM2 at 192 context: every cold block read back from host and disk, output unchanged."""
    model = smollm.model
    ids = torch.randint(10, 5000, (1, 192), generator=torch.Generator().manual_seed(0))
    ref, _ = _generate(model, ids, strategies.build("full"), new_tokens=4)
    out, cache = _generate(model, ids, strategies.build("tiered", {"recent_tokens": 32, "block_tokens": 64}),
                           new_tokens=4)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    st = cache.stats()
    assert st["disk_bytes"] > 0 and st["host_bytes"] > 0
    assert cache.kv_bytes() < 0.25 * cache.kv_bytes_fp16()  # 39 of 195 tokens on the device


def _filesystem(path) -> str:
    """Type of the file system holding ``path`` (longest mount-point prefix in /proc/mounts)."""
    best, kind = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            mount, fstype = line.split()[1], line.split()[2]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def test_disk_tier_leaves_the_page_cache(tiny_model, tiny_ids, tmp_path):
    """With drop_page_cache the spill files are not resident after the build nor after a step's reads."""
    from kvbench.hardware_probe import _resident_fraction

    if not hasattr(os, "posix_fadvise") or _filesystem(tmp_path) in ("", "tmpfs", "ramfs"):
        pytest.skip("page-cache eviction needs posix_fadvise on a disk-backed file system")
    keys, values, _ = _prefill_capture(tiny_model, tiny_ids)
    for drop in (True, False):
        strategy = strategies.build("tiered", {"host_fraction": 0.0, "recent_tokens": 8, "block_tokens": 32,
                                               "drop_page_cache": drop})
        cache = KVBenchCache.from_capture(strategy, tiny_model.config, keys, values)
        with torch.inference_mode():
            tiny_model(input_ids=tiny_ids[:, :1], cache=cache, use_cache=True)
        resident = [_resident_fraction(b.packet.path) for b in cache.layers[0].store.blocks]
        # Evicted when asked; freshly written and read pages otherwise stay cached.
        assert all((r == 0.0) if drop else (r is not None and r > 0) for r in resident), (drop, resident)


def test_yaml_lists_every_parameter_with_its_default():
    from kvbench.config import compose_config  # the config is generated from the dataclass

    cfg = dict(compose_config(["strategy=tiered"]).strategy)
    assert cfg.pop("name") == "tiered"
    assert cfg == strategies.build("tiered").params()
