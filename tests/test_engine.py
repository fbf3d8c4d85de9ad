"""The shared-prefill engine on the tiny model: records, fidelity, resume and baseline reuse."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from kvbench.strategies.base import RunContext

from kvbench import strategies
from kvbench.engine import Engine, query_window_for
from kvbench.loop import run_samples
from kvbench.models import ByteTokenizer, LoadedModel
from kvbench.record import FIELDS, MEASURED_FIELDS, Record
from kvbench.results import RunStore
from kvbench.tasks.base import Sample


def _samples(n: int = 3) -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        prefix = torch.randint(1, 255, (120,), generator=g).tolist()
        out.append(Sample(sample_id=f"s{i}", prefix_ids=prefix, query_ids=list(b"Q?"), gold_ids=list(b"ab"),
                          answers=["ab"], metric="substring", metadata={"depth": 0.5}, max_new_tokens=4))
    return out


@pytest.fixture
def engine(tiny_model):
    return Engine(LoadedModel("tiny-llama", tiny_model, ByteTokenizer()),
                  run_fields={"task": "unit", "model": "tiny-llama", "hardware": "cpu", "config_hash": "h"})


def _strategies():
    return [strategies.build("full"), strategies.build("int8", {"group_size": 8})]


def test_records_cover_every_sample_and_strategy(engine, tmp_path):
    store = RunStore(tmp_path, "run")
    run_samples(engine, _samples(), _strategies(), set(), store.append)
    recs = store.load_records()
    assert len(recs) == 6
    full = [r for r in recs if r["strategy_name"] == "full"]
    int8 = [r for r in recs if r["strategy_name"] == "int8"]
    assert all(r["kl"] == 0.0 and r["top1_agreement"] == 1.0 for r in full)
    # tiny model is float32: saved against its own float32 cache, with the 16-bit figure beside it
    assert all(r["memory_reduction"] == 0.0 and r["memory_reduction_fp16"] == pytest.approx(-1.0) for r in full)
    assert all(r["kv_bytes_dense"] == 2 * r["kv_bytes_fp16"] == r["kv_bytes"] for r in full)
    assert all(r["memory_reduction"] == pytest.approx(1 - 10 / 32) for r in int8)
    assert all(r["memory_reduction_fp16"] == pytest.approx(1 - 10 / 16) for r in int8)
    assert all(r["kl"] >= 0 and r["generated_tokens"] >= 1 for r in int8)
    assert all(r["context_tokens"] == 120 and r["spec_version"] for r in recs)
    assert all(r["decode_ms_per_token"] > 0 for r in recs)
    assert all(r["batch_size"] == 1 for r in recs)
    # int8 attends over its codes (kvbench attention on CPU): no working copy, a measured working set below full's
    assert all(r["scratch_bytes"] == 0 for r in full + int8)
    assert all(r["peak_bytes_decode_excl_scratch"] == r["peak_bytes_decode"] for r in full + int8)
    assert all(r["working_set_bytes"] >= r["kv_bytes"] for r in full)
    assert max(r["working_set_bytes"] for r in int8) < min(r["working_set_bytes"] for r in full)


def test_records_are_the_schema_in_order(engine):
    """The engine writes exactly :class:`Record`: the run's fields, then every schema field in order."""
    got = []
    run_samples(engine, _samples(1), _strategies(), set(), got.extend)
    assert got
    for rec in got:
        assert list(rec) == [*engine.run_fields, *FIELDS]
        rebuilt = Record(run=engine.run_fields, **{k: rec[k] for k in FIELDS}).to_dict()
        assert json.dumps(rebuilt) == json.dumps(rec)
        # the measured fields are what another harness's imports fill with NaN: all numbers
        assert all(isinstance(rec[k], int | float) and not isinstance(rec[k], bool) for k in MEASURED_FIELDS)


def test_every_record_field_is_documented_and_grouped():
    from kvbench.record import GROUPS

    for f in dataclasses.fields(Record):
        assert f.metadata["group"] in GROUPS and f.metadata["doc"] and "\n" not in f.metadata["doc"], f.name


def test_scratch_is_recorded_and_taken_off_the_decode_peak(engine, monkeypatch):
    from kvbench.cache import KVBenchCache

    monkeypatch.setattr(KVBenchCache, "scratch_bytes", lambda self: 1000)
    rec = engine.evaluate(strategies.build("full"), _samples(1)[0], engine.prefill(_samples(1)[0], 0), None).record
    assert rec["scratch_bytes"] == 1000
    assert rec["peak_bytes_decode_excl_scratch"] == max(0, rec["peak_bytes_decode"] - 1000)


@pytest.mark.skipif("working_copy" not in {f.name for f in dataclasses.fields(RunContext)},
                    reason="RunContext.working_copy arrives with the quantized stores' working copies")
@pytest.mark.parametrize("enabled", [True, False])
def test_working_copy_setting_reaches_the_strategy(engine, enabled):
    engine.working_copy = enabled
    strategy, sample = strategies.build("int8", {"group_size": 8}), _samples(1)[0]
    engine.evaluate(strategy, sample, engine.prefill(sample, 0), None)
    assert strategy.context.working_copy is enabled


def test_resume_skips_finished_samples_and_survives_a_torn_line(engine, tmp_path, monkeypatch):
    store = RunStore(tmp_path, "run")
    samples = _samples()
    calls: list[str] = []

    def crash_after_first(records):
        store.append(records)
        raise KeyboardInterrupt  # the process is killed after one sample landed

    with pytest.raises(KeyboardInterrupt):
        run_samples(engine, samples, _strategies(), set(), crash_after_first)
    with store.records_path.open("a") as fh:
        fh.write('{"sample_id": "s1", "strat')  # a torn write from the kill
    done = {r["sample_id"] for r in store.load_records()}
    assert done == {"s0"}

    original = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda s, w: calls.append(s.sample_id) or original(s, w))
    run_samples(engine, samples, _strategies(), done, store.append)
    assert calls == ["s1", "s2"]
    lines = store.records_path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn line was dropped, not glued to the next record
    assert len(lines) == 6


def test_baseline_reuse_gives_identical_fidelity(engine, tmp_path):
    samples = _samples(2)
    key = lambda s: f"k-{s.sample_id}"  # noqa: E731
    first, second = RunStore(tmp_path, "a"), RunStore(tmp_path, "b")
    run_samples(engine, samples, _strategies(), set(), first.append, tmp_path / "base", key)
    run_samples(engine, samples, _strategies(), set(), second.append, tmp_path / "base", key)
    a = {(r["sample_id"], r["strategy_name"]): r for r in first.load_records()}
    b = {(r["sample_id"], r["strategy_name"]): r for r in second.load_records()}
    assert all(b[(s.sample_id, "full")].get("baseline_reused") for s in samples)
    for s in samples:
        assert a[(s.sample_id, "int8")]["kl"] == b[(s.sample_id, "int8")]["kl"]


def test_query_window_is_the_widest_requested():
    full, int8 = strategies.build("full"), strategies.build("int8")
    assert query_window_for([full, int8]) == 0
