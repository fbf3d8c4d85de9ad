"""kvbench.generate: the kvpress-like one-call helper, on the tiny random Llama (milliseconds)."""

from __future__ import annotations

import pytest
import torch

import kvbench
from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CONTEXT = "The lighthouse at Kelvin Reach was designed by Margit Sole in 1887. " * 6
QUESTION = " Who designed it?"


@pytest.mark.parametrize("name", ["snapkv", "h2o", "int8", "full"])
def test_generate_equals_the_four_lines_it_stands_for(tiny_model, name):
    tok = ByteTokenizer()
    got = kvbench.generate(tiny_model, tok, CONTEXT, QUESTION, strategy=name, max_new_tokens=6)
    # The README's four lines, by hand: build, cache, attach, prefill the context, generate after the question.
    ctx = torch.tensor([tok(CONTEXT)["input_ids"]])
    ids = torch.cat([ctx, torch.tensor([tok(QUESTION)["input_ids"]])], dim=1)
    cache = KVBenchCache(strategies.build(name), tiny_model.config)
    with torch.inference_mode(), cache.attach(tiny_model):
        tiny_model(input_ids=ctx, cache=cache, use_cache=True)
        out = tiny_model.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got == tok.decode(out[0, ids.shape[1]:].tolist())
    if name != "full":  # the cache really holds less than the dense one would
        dense = KVBenchCache(strategies.build("full"), tiny_model.config)
        with torch.inference_mode():
            tiny_model(input_ids=ids, cache=dense, use_cache=True)
        assert cache.kv_bytes() < dense.kv_bytes()


def test_generate_checks_parameters_like_the_cli(tiny_model):
    with pytest.raises(KVBenchError, match="has no parameter 'ratio'"):
        kvbench.generate(tiny_model, ByteTokenizer(), CONTEXT, QUESTION, strategy="snapkv", ratio=0.5)
    with pytest.raises(KVBenchError, match="compression_ratio"):
        kvbench.generate(tiny_model, ByteTokenizer(), CONTEXT, QUESTION, strategy="snapkv", compression_ratio=2.0)
