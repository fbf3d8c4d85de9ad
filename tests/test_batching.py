"""Batched evaluation: every strategy in the registry gives the records of batch 1 when samples share a batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench import strategies
from kvbench.engine import Engine, query_window_for
from kvbench.errors import KVBenchError
from kvbench.loop import batches, run_samples
from kvbench.models import ByteTokenizer, LoadedModel
from kvbench.tasks.base import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# Parameters that fit the tiny model (head_dim 16, 120-token prefixes) and exercise what batching could break:
# quantization groups that flush mid-decode, recomputed segments, tiers, eviction after every decode step.
TINY = {"group_size": 8, "residual_length": 8, "residual_tokens": 8, "recompute_tokens": 16, "block_size": 8,
        "quant_group_size": 8, "block_tokens": 16, "recent_tokens": 16, "decode_evict": True}
# Ragged on purpose: question and answer lengths, decode limits and metrics differ from row to row.
ROWS = [(b"Q?", b"ab", 5, "substring"), (b"What is it?", b"xyzw", 7, "substring"), (b"Hm", b"k", 6, "substring"),
        (b"Go on:", b"tail", 4, "token_accuracy")]


def _tiny(name: str) -> strategies.Strategy:
    names = {f.name for f in dataclasses.fields(strategies.strategy_class(name))}
    return strategies.build(name, {k: v for k, v in TINY.items() if k in names})


def _samples(prefix_len: int = 120) -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    return [Sample(sample_id=f"s{i}", prefix_ids=torch.randint(1, 255, (prefix_len,), generator=g).tolist(),
                   query_ids=list(q), gold_ids=list(a), answers=[a.decode()], metric=metric, metadata={},
                   max_new_tokens=n) for i, (q, a, n, metric) in enumerate(ROWS)]


@pytest.fixture
def engine(tiny_model):
    return Engine(LoadedModel("tiny-llama", tiny_model, ByteTokenizer()), run_fields={"task": "unit"})


def _comparable(record: dict) -> dict:
    """A record without what legitimately depends on the batch: timings, peak memory, the batch size."""
    drop = ("_s", "_ms_per_token", "peak_bytes", "batch_size")
    out = {k: v for k, v in record.items() if not any(d in k for d in drop)}
    out["stats"] = {k: v for k, v in record["stats"].items() if "seconds" not in k}
    return out


@pytest.mark.parametrize("name", strategies.available())
def test_batch_gives_the_records_of_batch_one(engine, name):
    strategy, samples = _tiny(name), _samples()
    window = query_window_for([strategy])
    alone = [engine.evaluate(strategy, s, engine.prefill(s, window), None) for s in samples]
    together = engine.evaluate_batch(strategy, samples, engine.prefill(samples, window), [None] * len(samples))
    for a, b in zip(alone, together, strict=True):
        assert b.record["batch_size"] == len(samples) and a.record["batch_size"] == 1
        ra, rb = _comparable(a.record), _comparable(b.record)
        for key in ("kl", "gold_nll", "top1_agreement", "gold_token_accuracy"):
            assert rb.pop(key) == pytest.approx(ra.pop(key), abs=1e-4), key
        assert ra == rb  # greedy tokens, prediction, score, bytes, held tokens, store statistics
        torch.testing.assert_close(b.logp, a.logp, atol=1e-4, rtol=0)


def test_run_samples_batched_writes_what_batch_one_writes(engine, tmp_path):
    built = [strategies.build("full"), _tiny("int4"), _tiny("h2o")]
    one, four = [], []
    run_samples(engine, _samples(), built, set(), one.extend, batch_size=1)
    run_samples(engine, _samples(), built, set(), four.extend, batch_size=3)  # a batch of 3, then one of 1
    assert [(r["sample_id"], r["strategy_name"]) for r in one] == [(r["sample_id"], r["strategy_name"]) for r in four]
    assert [r["batch_size"] for r in four if r["strategy_name"] == "full"] == [3, 3, 3, 1]
    for a, b in zip(one, four, strict=True):
        assert a["prediction"] == b["prediction"] and a["kv_bytes"] == b["kv_bytes"]
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-4)


def test_batches_group_equal_context_lengths_in_order():
    short, long = _samples(40), _samples(60)
    got = batches([short[0], short[1], long[0], short[2], short[3]], 2)
    assert [len(b) for b in got] == [2, 1, 2]
    assert [len(b[0].prefix_ids) for b in got] == [40, 60, 40]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_batch_size_must_be_a_positive_integer(engine, bad):
    with pytest.raises(KVBenchError, match="engine.batch_size must be an integer >= 1"):
        run_samples(engine, _samples(), [strategies.build("full")], set(), lambda r: None, batch_size=bad)


def test_progress_advances_per_sample_and_strategy(engine):
    calls: list[tuple[int, str]] = []
    built = [strategies.build("full"), strategies.build("int8", {"group_size": 8})]
    run_samples(engine, _samples(), built, {"s0"}, lambda r: None, progress=lambda n, s: calls.append((n, s)),
                batch_size=2)
    assert calls[0] == (2, "")  # the resumed sample's two evaluations
    assert sum(n for n, _ in calls) == 4 * 2
    assert [s for n, s in calls if n == 0] == ["full", "int8", "full", "int8"]  # announced before each runs


@pytest.mark.parametrize("batch_size", [1, 3])
def test_max_new_evaluates_the_first_not_yet_done_samples_and_no_more(engine, batch_size):
    built = [strategies.build("full")]
    asked: list[str] = []

    class Done(set):  # records which samples were asked about: asking is claiming in a real run
        def __contains__(self, sid):
            asked.append(sid)
            return super().__contains__(sid)

    out: list[dict] = []
    run_samples(engine, _samples(), built, Done({"s1"}), out.extend, batch_size=batch_size, max_new=2)
    assert [r["sample_id"] for r in out] == ["s0", "s2"]
    assert asked == ["s0", "s1", "s2"]  # s3 was never claimed
    rest: list[dict] = []
    run_samples(engine, _samples(), built, {"s0", "s1", "s2"}, rest.extend, batch_size=batch_size, max_new=2)
    assert [r["sample_id"] for r in rest] == ["s3"]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_max_new_must_be_a_non_negative_integer(engine, bad):
    with pytest.raises(KVBenchError, match="engine.max_new_samples must be an integer >= 0"):
        run_samples(engine, _samples(), [strategies.build("full")], set(), lambda r: None, max_new=bad)
