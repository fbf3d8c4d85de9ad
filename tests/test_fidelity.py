"""Fidelity metrics see the cache decoding actually uses, including evictions made while decoding (issue 13)."""

from __future__ import annotations

import pytest
import torch

import kvbench.engine as engine_module
from kvbench import strategies
from kvbench.engine import Engine, changes_cache_while_decoding, query_window_for
from kvbench.models import ByteTokenizer, LoadedModel
from kvbench.tasks.base import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")

DECODE_EVICTING = [("knorm", {"decode_evict": True}), ("random", {"decode_evict": True}), ("h2o", {}),
                   ("tova", {}), ("streaming_llm", {}),
                   ("compose", {"evict": "tova", "evict_params": {"budget_tokens": 6}, "quantize": "int8",
                 "quantize_params": {"group_size": 8}})]


@pytest.fixture
def engine(tiny_model):
    return Engine(LoadedModel("tiny-llama", tiny_model, ByteTokenizer()), run_fields={"task": "unit"})


def _sample(gold: list[int], metric: str = "substring") -> Sample:
    g = torch.Generator().manual_seed(3)
    return Sample(sample_id="s", prefix_ids=torch.randint(1, 255, (64,), generator=g).tolist(),
                  query_ids=list(b"Q?"), gold_ids=gold, answers=["x"], metric=metric, metadata={},
                  max_new_tokens=len(gold))


def _run(engine: Engine, strategy: strategies.Strategy, sample: Sample):
    return engine.evaluate(strategy, sample, engine.prefill(sample, query_window_for([strategy])), None)


def test_decode_eviction_changes_teacher_forced_metrics(engine):
    """knorm with a 4-token budget: evicting after every gold token must show in the log-probs (it did not)."""
    sample = _sample(list(b"a long gold answer"))
    kept = _run(engine, strategies.build("knorm", {"budget_tokens": 4}), sample)
    evicted = _run(engine, strategies.build("knorm", {"budget_tokens": 4, "decode_evict": True}), sample)
    # the first answer token follows the same (prefill-evicted) cache either way
    torch.testing.assert_close(kept.logp[0], evicted.logp[0])
    assert not torch.allclose(kept.logp[1:], evicted.logp[1:], atol=1e-4)
    assert kept.record["gold_nll"] != pytest.approx(evicted.record["gold_nll"], abs=1e-6)


@pytest.mark.parametrize("name,params", DECODE_EVICTING, ids=[n for n, _ in DECODE_EVICTING])
def test_teacher_forcing_follows_the_decoding_cache(engine, name, params, monkeypatch):
    """Teacher-forcing the strategy's own greedy answer reproduces it token for token, with the log-probs the
    greedy decode saw: the fidelity pass and the decode hold the same cache at every step."""
    strategy = strategies.build(name, params if name == "compose" else {**params, "budget_tokens": 6})
    assert changes_cache_while_decoding(strategy)
    monkeypatch.setattr(engine_module, "eos_ids", lambda lm: set())  # the random model may emit EOS at once
    decoded, greedy_fn = [], engine.greedy
    monkeypatch.setattr(engine, "greedy", lambda *a, **k: decoded.append(out := greedy_fn(*a, **k)) or out)
    _run(engine, strategy, _sample([1] * 12))
    tokens = decoded[0][0].tokens
    assert len(tokens) == 12
    forced = _run(engine, strategy, _sample(tokens, metric="token_accuracy"))
    assert forced.record["gold_token_accuracy"] == 1.0


def test_strategies_without_decode_eviction_keep_one_forward(engine):
    assert not changes_cache_while_decoding(strategies.build("knorm"))
    assert not changes_cache_while_decoding(strategies.build("snapkv"))
    assert not changes_cache_while_decoding(strategies.build("int8"))
