"""``kvbench throughput`` (kvbench/throughput.py) and the working-set measurement (kvbench/footprint.py), on the
tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from kvbench import throughput
from kvbench.errors import KVBenchError
from kvbench.footprint import LiveBytes, weight_bytes


@pytest.mark.parametrize(("text", "weights", "expected"), [
    ("123", 0, 123), ("1.5GB", 0, 1_500_000_000), ("2GiB", 0, 2 * 2**30), ("512 MB", 0, 512_000_000),
    ("weights+1MB", 7, 1_000_007), (1024, 0, 1024)])
def test_parse_size(text, weights, expected):
    assert throughput.parse_size(text, weights) == expected


@pytest.mark.parametrize("bad", ["3XB", "GB", "-1GB", "0", "weights+", "1.5.2GB"])
def test_parse_size_rejects(bad):
    with pytest.raises(KVBenchError, match="valid|positive"):
        throughput.parse_size(bad)


@pytest.mark.parametrize("overrides", [["bogus=1"], ["budget=3XB"], ["prefill=dense"], ["steps=0"],
                                       ["strategies=[nope]"],
                                       ["model=tiny-llama", "prefill=synthetic", "strategies=[snapkv]"]])
def test_bad_input_is_one_line_and_status_2(overrides, capsys):
    assert throughput.main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench throughput: error:")


def test_live_bytes_counts_new_storages_once_and_frees_them():
    x = torch.ones(100)
    with LiveBytes() as live:
        a = torch.empty(1000)          # 4,000 bytes
        b = a[:10]                     # a view: no new storage
        c = x.add_(1)                  # in place on a tensor held before: not new
        d = a * 2                      # 4,000 more
        del a, b, c
        peak_two = live.peak
        del d
    assert peak_two == 8000
    assert live.live == 0


def test_weight_bytes_count_float32_linear_copies():
    from kvbench import linear
    from kvbench.models import tiny_llama

    model = tiny_llama().to(torch.bfloat16)
    plain = weight_bytes(model)
    assert plain == sum(p.numel() * 2 for p in model.parameters()) + sum(b.numel() * b.element_size()
                                                                          for b in model.buffers())
    linear.use(model, "float32", "cpu")
    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert weight_bytes(model) == plain + 4 * lin


@pytest.fixture(scope="module")
def bench():
    cfg = throughput.compose(["model=tiny-llama", "strategies=[int8,streaming_llm]", "contexts=[64]",
                              "steps=2", "repeats=2", "question_tokens=4", "max_batch=12"])
    from kvbench.hardware import HardwareProfile

    return cfg, throughput.Bench(cfg, HardwareProfile.from_config(cfg.hardware))


def test_working_set_is_stored_plus_scratch_plus_measured_attention_peak(bench):
    cfg, b = bench
    strategies = throughput.check(cfg)
    built, _ = b.build(strategies, 64)
    for one in built:
        ws = b.working_set(one, 1)
        assert ws["working_set_bytes"] >= ws["kv_bytes"] + ws["scratch_bytes"]
        assert ws["temp_bytes"] > 0  # at least the attention's scores
        two = b.working_set(one, 2)
        assert two["kv_bytes"] > ws["kv_bytes"]  # two sequences hold two caches


def test_capacity_is_the_largest_batch_that_fits(bench):
    cfg, b = bench
    built, _ = b.build(throughput.check(cfg), 64)
    for one in built:
        single = b.working_set(one, 1)
        available = 4 * single["working_set_bytes"]
        rows, ws = b.capacity(one, available, single)
        assert 1 <= rows <= int(cfg.max_batch)
        assert ws["working_set_bytes"] <= available
        if rows < int(cfg.max_batch):
            assert b.working_set(one, rows + 1)["working_set_bytes"] > available
        assert b.capacity(one, single["working_set_bytes"] // 2, single)[0] == 0


def test_run_writes_one_row_per_strategy_budget_context_and_round(tmp_path):
    import pandas as pd

    out = tmp_path / "t.csv"
    assert throughput.main(["model=tiny-llama", "strategies=[int8]", "contexts=[48]", "budget=[weights+300KB]",
                            "steps=2", "repeats=2", "question_tokens=4", f"out={out}"]) == 0
    df = pd.read_csv(out)
    assert len(df) == 2 * 2  # full and int8, two rounds
    assert set(df["strategy"]) == {"full", "int8"}
    fitted = df[df["batch"] > 0]
    assert not fitted.empty
    assert (fitted["batch_working_set_bytes"] <= fitted["budget_bytes"] - fitted["weights_bytes"]).all()
    assert (fitted["tokens_per_s"] > 0).all() and (fitted["kv_read_bytes"] > 0).all()


@pytest.mark.parametrize("impl", ["sdpa", "kvbench"])
def test_synthetic_prefill_fills_each_store_with_the_whole_context(impl):
    """Under kvbench's attention (the CPU default) a cache defers appends to the attention that reads them: K/V
    appended with no attention never reached the store, and a 4K "context" held only its last 1,024-token chunk."""
    from kvbench import attention, strategies
    from kvbench.models import tiny_llama

    model = tiny_llama()
    attention.use(model, impl, "cpu")
    for name in ("full", "int8"):
        cache = throughput.synthetic_cache(strategies.build(name), model.config, 100, 32, torch.float32, "cpu", 0)
        assert cache.held_tokens() == [100] * model.config.num_hidden_layers
        assert cache.seen_tokens() == 100
