"""``attn_implementation="kvbench"`` (kvbench/attention.py) gives SDPA's records for every strategy in the registry.

Under ``kvbench`` every store attends over its own storage (``LayerStore.attend``: quantized stores read their codes
block by block); under SDPA the store's ``append`` returns dense K/V, dequantized, and SDPA attends over them. So this
is the registry-wide check that attention over the compressed store equals dequantize-then-attend.

Registry-wide, on tiny random models: a grouped-query Llama (4 query heads on 2 KV heads) and a Mistral with a
sliding window shorter than the context, four ragged rows per batch (per-row masks from ``RowsCache``), and
one row alone. Greedy tokens must be equal and log-probs within float32 matmul tolerance. Soft-capping
(Gemma 2), which SDPA refuses, is compared with eager attention.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch
from kvbench.strategies._quantstore import QuantizedStore
from kvbench.strategies.base import LayerStore

from kvbench import attention, blockattn, fused, strategies
from kvbench.engine import Engine, query_window_for
from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer, LoadedModel, tiny_llama
from kvbench.tasks.base import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks (and fused chunks) of 16 tokens: a 96-token context is read in several blocks, merged by the online
    softmax, and blocks straddle the stores' piece boundaries (quantized chunks, residuals, recomputed segments)."""
    monkeypatch.setattr(blockattn, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(fused, "CHUNK_TOKENS", 16)  # the fused reader's chunks too

TINY = {"group_size": 8, "residual_length": 8, "residual_tokens": 8, "recompute_tokens": 16, "block_size": 8,
        "quant_group_size": 8, "block_tokens": 16, "recent_tokens": 16, "decode_evict": True}
ROWS = [(b"Q?", b"ab", 5), (b"What is it?", b"xyzw", 7), (b"Hm", b"k", 6), (b"Go on:", b"tail", 4)]


def _tiny(name: str) -> strategies.Strategy:
    names = {f.name for f in dataclasses.fields(strategies.strategy_class(name))}
    return strategies.build(name, {k: v for k, v in TINY.items() if k in names})


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(3)
    return [Sample(sample_id=f"s{i}", prefix_ids=torch.randint(1, 255, (96,), generator=g).tolist(),
                   query_ids=list(q), gold_ids=list(a), answers=[a.decode()], metric="substring", metadata={},
                   max_new_tokens=n) for i, (q, a, n) in enumerate(ROWS)]


@cache
def _model(family: str) -> torch.nn.Module:
    if family == "llama":
        return tiny_llama(seed=0)
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        sliding_window=24, attn_implementation="sdpa")
    return MistralForCausalLM(cfg).eval()


def _records(family: str, impl: str, name: str, batch: bool) -> list:
    engine = Engine(LoadedModel("tiny", _model(family), ByteTokenizer()), attention=impl)
    assert engine.attention == impl and engine.model.config._attn_implementation == impl
    strategy, samples = _tiny(name), _samples()
    if not batch:
        samples = samples[1:2]
    pre = engine.prefill(samples, query_window_for([strategy]))
    return engine.evaluate_batch(strategy, samples, pre, [None] * len(samples))


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("name", strategies.available())
def test_kvbench_attention_gives_sdpa_records(family, name):
    # Batched rows on a sliding-window model are refused (kvbench.cache: the per-row masks do not apply the
    # window yet), so the windowed family is checked one sample at a time.
    for batch in (True, False) if family != "mistral" else (False,):
        ref, new = _records(family, "sdpa", name, batch), _records(family, "kvbench", name, batch)
        for a, b in zip(ref, new, strict=True):
            assert b.record["prediction"] == a.record["prediction"]
            assert b.record["kv_bytes"] == a.record["kv_bytes"]
            for key in ("kl", "gold_nll", "top1_agreement"):
                assert b.record[key] == pytest.approx(a.record[key], abs=1e-4), key
            torch.testing.assert_close(b.logp, a.logp, atol=1e-4, rtol=0)


def test_sliding_window_reaches_the_attention():
    """The window really masks: with it, the last position's logits differ from the same model without it."""
    model = _model("mistral")
    ids = torch.randint(1, 255, (1, 60), generator=torch.Generator().manual_seed(0))
    attention.use(model, "kvbench", "cpu")
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :59], cache=cache)
        step = model(input_ids=ids[:, 59:], cache=cache).logits[:, -1]
        model.config.sliding_window = None
        try:
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :59], cache=cache)
            unwindowed = model(input_ids=ids[:, 59:], cache=cache).logits[:, -1]
        finally:
            model.config.sliding_window = 24
    assert not torch.allclose(step, unwindowed, atol=1e-4)


def test_soft_capping_matches_eager():
    """Gemma 2 caps attention logits (``softcap``), which SDPA refuses; decode steps match eager attention."""
    from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                       attn_logit_softcapping=2.0, attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(1, 255, (1, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.inference_mode():
        for impl in ("eager", "kvbench"):
            attention.use(model, impl, "cpu") if impl == "kvbench" else model.set_attn_implementation("eager")
            cache = DynamicCache(config=model.config)
            model(input_ids=ids[:, :32], cache=cache)
            out[impl] = torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache).logits for i in range(32, 40)], 1)
    torch.testing.assert_close(out["kvbench"], out["eager"], atol=1e-5, rtol=1e-5)


def test_grouped_function_equals_sdpa_with_a_ragged_boolean_mask():
    """The function alone: 9 query heads on 3 KV heads, 5 queries, per-row boolean masks with padding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h, n in ((9, 5), (3, 50), (3, 50)))
    mask = torch.ones(2, 1, 5, 50, dtype=torch.bool).tril(diagonal=45)
    mask[1, :, :, :7] = False  # row 1 is left-padded
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    ref, _ = sdpa_attention_forward(module.eval(), q, k, v, mask, scaling=0.3)
    out, _ = attention.kvbench_attention_forward(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 5])
def test_values_narrower_than_queries(q_len):
    """Value heads narrower than query/key heads (MiMo-V2-Flash's and DeepSeek-V3's 192/128, here 24/16): the
    attention function, blockattn's SDPA path over one dense tensor and its blocks over int8 codes all return
    the value width, equal to SDPA's (which takes any value width)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvbench import blockattn
    from kvbench.quantizers import quantize_int8

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h, n, d in ((6, q_len, 24), (2, 40, 24), (2, 40, 16)))
    mask = torch.ones(1, 1, q_len, 40, dtype=torch.bool).tril(diagonal=40 - q_len)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    ref, _ = sdpa_attention_forward(module.eval(), q, k, v, mask, scaling=0.3)  # [b, q, heads, 16]
    out, _ = attention.kvbench_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert out.shape == ref.shape == (1, q_len, 6, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    run = blockattn.TokenRun
    dense = blockattn.attend(q, run([blockattn.Dense(k)], 2), run([blockattn.Dense(v)], 2), mask, 0.3)
    torch.testing.assert_close(dense.transpose(1, 2), ref, atol=1e-5, rtol=1e-5)
    kq, vq = quantize_int8(k, 8, "token"), quantize_int8(v, 8, "token")
    coded = blockattn.attend(q, run([kq], 2), run([vq], 2), mask, 0.3, block=16)
    ref_q, _ = sdpa_attention_forward(module, q, kq.dequantize(torch.float32), vq.dequantize(torch.float32), mask,
                                      scaling=0.3)
    torch.testing.assert_close(coded.transpose(1, 2), ref_q, atol=1e-5, rtol=1e-5)


def test_auto_picks_by_device_and_bad_choice_names_the_valid_ones():
    assert attention.resolve("auto", "cpu") == "kvbench"
    assert attention.resolve("auto", "cuda:0") == "sdpa"
    with pytest.raises(KVBenchError, match="valid: auto, sdpa, kvbench"):
        attention.resolve("flash", "cpu")


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_an_uncompressed_store_gives_sdpa_exactly(name, monkeypatch):
    """Where the fused reader does not run (``KVBENCH_FUSED=0``, no compiler, long queries) a store held as one
    dense tensor goes to SDPA's kernel as transformers calls it, so one sample's records under kvbench attention
    equal SDPA's to the bit. (With the fused reader, decode steps agree within float32 rounding, and ragged
    batches attend row by row: the registry-wide test above.)"""
    monkeypatch.setenv("KVBENCH_FUSED", "0")
    ref, new = _records("llama", "sdpa", name, False), _records("llama", "kvbench", name, False)
    for a, b in zip(ref, new, strict=True):
        assert b.record["prediction"] == a.record["prediction"]
        assert torch.equal(b.logp, a.logp)


@pytest.mark.parametrize("name", strategies.available())
def test_rows_read_together_give_each_rows_records(name, monkeypatch):
    """A batch's decode step read in one kernel call per layer (``LayerStore.attend_rows``: the vector reader's
    ``attend_rows``) gives every row's records bit for bit as reading each row on its own does, for every strategy
    (stores of other classes take the default, row by row); the one call runs for the quantized stores."""
    fused.choose("simd")
    try:
        if not fused.available():
            pytest.skip("the simd kernel could not be built here")
        calls = []
        real = fused.attend_rows

        def counted(*a):
            out = real(*a)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(fused, "attend_rows", counted)
        together = _records("llama", "kvbench", name, True)
        monkeypatch.setattr(fused, "attend_rows", lambda *a: None)  # blockattn then reads each row on its own
        alone = _records("llama", "kvbench", name, True)
    finally:
        fused.choose("auto")
    for a, b in zip(alone, together, strict=True):
        assert b.record["prediction"] == a.record["prediction"]
        assert b.record["kv_bytes"] == a.record["kv_bytes"]
        assert torch.equal(b.logp, a.logp)
    store = _tiny(name).new_layer(0, 1)
    if isinstance(store, QuantizedStore) or type(store).attend is LayerStore.attend:
        assert any(calls), "the rows were not read together"
