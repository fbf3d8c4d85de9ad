"""KVBenchCache inside transformers: generate integration, capture equivalence, byte accounting, positions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch
from kvbench.strategies._quantstore import TAIL_TOKENS
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy

from kvbench import strategies
from kvbench.cache import KVBenchCache, RowsCache
from kvbench.capture import QueryRecorder
from kvbench.errors import KVBenchError
from kvbench.quantizers import quantize_int8


def _prefill_capture(model, ids):
    cache = KVBenchCache(strategies.build("full"), model.config)
    with torch.inference_mode(), QueryRecorder(model, 8) as rec:
        model(input_ids=ids, cache=cache, use_cache=True)
    return ([layer.store.keys for layer in cache.layers], [layer.store.values for layer in cache.layers],
            rec.captures)


def test_full_cache_generate_matches_dynamic_cache(tiny_model, tiny_ids):
    with torch.inference_mode():
        ref = tiny_model.generate(tiny_ids, max_new_tokens=12, do_sample=False)
        cache = KVBenchCache(strategies.build("full"), tiny_model.config)
        out = tiny_model.generate(tiny_ids, max_new_tokens=12, do_sample=False, cache=cache)
    assert torch.equal(ref, out)
    assert cache.get_seq_length() == tiny_ids.shape[1] + 11


@pytest.mark.parametrize("name", ["full", "int8"])
def test_capture_path_equals_normal_forward(tiny_model, tiny_ids, name):
    """Prefill once, compress from the capture, continue: same logits as the strategy inside a forward."""
    prefix, question = tiny_ids[:, :80], tiny_ids[:, 80:]
    with torch.inference_mode():
        normal = KVBenchCache(strategies.build(name), tiny_model.config)
        tiny_model(input_ids=prefix, cache=normal, use_cache=True)
        want = tiny_model(input_ids=question, cache=normal, use_cache=True).logits
        keys, values, caps = _prefill_capture(tiny_model, prefix)
        captured = KVBenchCache.from_capture(strategies.build(name), tiny_model.config, keys, values, caps)
        got = tiny_model(input_ids=question, cache=captured, use_cache=True).logits
    assert torch.equal(want, got)
    assert captured.kv_bytes() == normal.kv_bytes()


def test_int8_generate_changes_little(tiny_model, tiny_ids):
    with torch.inference_mode():
        ref = tiny_model(input_ids=tiny_ids).logits[:, -1]
        cache = KVBenchCache(strategies.build("int8", {"group_size": 16}), tiny_model.config)
        tiny_model(input_ids=tiny_ids[:, :-1], cache=cache, use_cache=True)
        got = tiny_model(input_ids=tiny_ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
        out = tiny_model.generate(tiny_ids, max_new_tokens=5, do_sample=False,
                                  cache=KVBenchCache(strategies.build("int8"), tiny_model.config))
    assert out.shape[1] == tiny_ids.shape[1] + 5
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_int8_bytes_are_payload_plus_scales(tiny_model, tiny_ids):
    cfg = tiny_model.config
    with torch.inference_mode():
        cache = KVBenchCache(strategies.build("int8", {"group_size": 8}), cfg)
        tiny_model(input_ids=tiny_ids, cache=cache, use_cache=True)
        tiny_model(input_ids=tiny_ids[:, :3], cache=cache, use_cache=True)  # decode-time appends
    t = tiny_ids.shape[1] + 3
    h, d = cfg.num_key_value_heads, cfg.head_dim
    per_token = h * d * 1 + h * (d // 8) * 2  # int8 codes + one fp16 scale per group
    # K and V: every token, and the slots the decode-time append reserved past them (a ChunkList tail, counted
    # as full's reserve is: held memory)
    per_layer = 2 * per_token * (t + TAIL_TOKENS - 3)
    assert cache.kv_bytes() == cfg.num_hidden_layers * per_layer
    assert cache.kv_bytes_fp16() == cfg.num_hidden_layers * 2 * t * h * d * 2
    for layer in cache.layers:
        assert all(q.codes.dtype == torch.int8 for q in layer.store.k + layer.store.v)
    # 8 bits + 16/8 bits of scale per element, against 16 bits
    assert 1 - cache.kv_bytes() / cache.kv_bytes_fp16() == pytest.approx(1 - 10 / 16)


def test_int8_round_trip_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 64, generator=g) * 3
    q = quantize_int8(x, group_size=32)
    xh = q.dequantize(torch.float32)
    groups = x.reshape(2, 3, 50, 2, 32)
    bound = q.scales.float().reshape(2, 3, 50, 2, 1) / 2 * (1 + 1e-5) + 1e-7
    assert ((xh.reshape_as(groups) - groups).abs() <= bound).all()
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.float16
    assert xh.shape == x.shape


def test_int8_rejects_nan_and_bad_groups():
    with pytest.raises(KVBenchError, match="NaN"):
        quantize_int8(torch.tensor([[float("nan")] * 8]), group_size=8)
    with pytest.raises(KVBenchError, match="group_size"):
        strategies.build("int8", {"group_size": 3})
    with pytest.raises(KVBenchError, match="valid: group_size"):
        strategies.build("int8", {"bits": 4})
    with pytest.raises(KVBenchError, match="valid:"):
        strategies.build("nope")


# -- positions after eviction: a test-only strategy that drops fixed tokens at prefill -------------------
class _DropStore(LayerStore):
    keys: torch.Tensor
    values: torch.Tensor

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        keep = [i for i in range(keys.shape[-2]) if i not in self.strategy.dropped]
        self.keys, self.values = keys[:, :, keep].clone(), values[:, :, keep].clone()

    def append(self, keys, values):
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def tensors(self) -> Iterable[torch.Tensor]:
        return [self.keys, self.values]

    def num_tokens(self) -> int:
        return self.keys.shape[-2]


@dataclass
class _Drop(Strategy):
    family = "eviction"
    dropped: tuple[int, ...] = ()

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return _DropStore(self, layer_idx, num_layers)


def test_positions_after_eviction_match_masked_reference(tiny_model, tiny_ids):
    """Evicting tokens must equal attending with those tokens masked out, at their original positions."""
    dropped = (3, 4, 10, 40, 41, 42)
    prefix, rest = tiny_ids[:, :64], tiny_ids[:, 64:72]
    with torch.inference_mode():
        cache = KVBenchCache(_Drop(dropped=dropped), tiny_model.config)
        tiny_model(input_ids=prefix, cache=cache, use_cache=True)
        assert cache.get_seq_length() == 64 and cache.held_tokens()[0] == 64 - len(dropped)
        got = tiny_model(input_ids=rest, cache=cache, use_cache=True).logits  # 8 new tokens, causal among them
        step = tiny_model(input_ids=tiny_ids[:, 72:73], cache=cache, use_cache=True).logits

        # Reference: the full sequence with the dropped tokens masked for the *later* queries only.
        full_ids = tiny_ids[:, :73]
        n = full_ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        for i in dropped:
            mask[64:, i] = False
        bias = torch.zeros(1, 1, n, n).masked_fill(~mask, torch.finfo(torch.float32).min)
        ref = tiny_model(input_ids=full_ids, attention_mask=bias, position_ids=torch.arange(n)[None]).logits
    torch.testing.assert_close(got, ref[:, 64:72], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, ref[:, 72:73], rtol=1e-4, atol=1e-4)


# -- scratch memory and several rows ------------------------------------------------------------------------
class _ScratchStore(_DropStore):
    """Keeps an extra fp32 copy of its keys, the way a quantized store keeps a dequantized working copy."""

    def prefill(self, keys, values, capture):
        super().prefill(keys, values, capture)
        self.copy = self.keys.float().clone()

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        return [self.copy]


@dataclass
class _Scratch(_Drop):
    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return _ScratchStore(self, layer_idx, num_layers)


def test_scratch_bytes_count_working_copies_apart_from_kv_bytes(tiny_model, tiny_ids):
    with torch.inference_mode():
        plain = KVBenchCache(_Drop(), tiny_model.config)
        scratch = KVBenchCache(_Scratch(), tiny_model.config)
        for cache in (plain, scratch):
            tiny_model(input_ids=tiny_ids, cache=cache, use_cache=True)
    cfg = tiny_model.config
    assert plain.scratch_bytes() == 0
    assert scratch.scratch_bytes() == cfg.num_hidden_layers * cfg.num_key_value_heads * tiny_ids.shape[1] * 16 * 4
    assert scratch.kv_bytes() == plain.kv_bytes()


def test_rows_cache_equals_each_row_alone(tiny_model, tiny_ids):
    """Rows of different held lengths and different new-token counts in one left-padded forward: each row's
    logits are those of its own cache alone (the per-row masks line up padding, held and causal new tokens)."""
    prefixes = [tiny_ids[:, :64], tiny_ids[:, 10:70]]
    news = [tiny_ids[:, 80:85], tiny_ids[:, 70:72]]
    strategy = _Drop(dropped=(3, 4, 10))

    def built() -> list[KVBenchCache]:
        caches = []
        for p in prefixes:
            cache = KVBenchCache(strategy, tiny_model.config)
            tiny_model(input_ids=p, cache=cache, use_cache=True)
            caches.append(cache)
        return caches

    with torch.inference_mode():
        alone = [tiny_model(input_ids=n, cache=c, use_cache=True).logits[0] for n, c in zip(news, built(), strict=True)]
        rows = RowsCache(built())
        width = max(n.shape[1] for n in news)
        ids = torch.zeros(2, width, dtype=torch.long)
        pos = torch.zeros(2, width, dtype=torch.long)
        for i, n in enumerate(news):
            ids[i, width - n.shape[1]:] = n[0]
            start = rows.seen(i)
            pos[i] = torch.arange(start + n.shape[1] - width, start + n.shape[1]).clamp(min=start)
        rows.lengths = [n.shape[1] for n in news]
        with rows.masks(tiny_model):
            together = tiny_model(input_ids=ids, position_ids=pos, cache=rows, use_cache=True).logits
    for i, (n, want) in enumerate(zip(news, alone, strict=True)):
        torch.testing.assert_close(together[i, width - n.shape[1]:], want, rtol=1e-4, atol=1e-4)
    assert [c.held_tokens()[0] for c in rows.caches] == [64 - 3 + 5, 60 - 3 + 2]


def test_full_store_grows_in_place_without_touching_what_it_handed_out():
    """``FullStore.append`` writes into a reserve instead of concatenating: the held tokens equal the
    concatenation at every step, a tensor handed out earlier (to attention, or the shared capture it was
    built from) never changes, and ``compact`` (after a chunked-prefill chunk) drops the reserve."""
    from kvbench.strategies.full import RESERVE_TOKENS, FullStore

    g = torch.Generator().manual_seed(0)
    shared_k, shared_v = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 4, generator=g)
    capture_k, capture_v = shared_k.clone(), shared_v.clone()
    store = FullStore(strategies.build("full"), 0, 1)
    store.prefill(shared_k, shared_v, None)
    ref_k, ref_v, handed = shared_k, shared_v, []
    for m in (3, 1, 1, 1):
        k, v = torch.randn(1, 2, m, 4, generator=g), torch.randn(1, 2, m, 4, generator=g)
        ref_k, ref_v = torch.cat([ref_k, k], dim=-2), torch.cat([ref_v, v], dim=-2)
        out_k, out_v = store.append(k, v)
        assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
        handed.append((out_k, out_k.clone()))
    assert torch.equal(shared_k, capture_k) and torch.equal(shared_v, capture_v)
    assert all(torch.equal(view, snapshot) for view, snapshot in handed)
    assert handed[1][0].data_ptr() == handed[-1][0].data_ptr()  # steps after the first wrote in place
    # one buffer, sized at the first growth (10 + 3 tokens) plus the reserve
    assert store.keys.untyped_storage().nbytes() == (13 + RESERVE_TOKENS) * 2 * 4 * 4
    store.compact()
    assert torch.equal(store.keys, ref_k) and store.keys.untyped_storage().nbytes() == 16 * 2 * 4 * 4
