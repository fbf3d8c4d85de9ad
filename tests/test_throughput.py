"""``kvbench throughput`` (kvbench/throughput.py) and the working-set measurement (kvbench/footprint.py), on the
tiny random Llama."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from kvbench import throughput
from kvbench.errors import KVBenchError
from kvbench.footprint import LiveBytes, weight_bytes


@pytest.mark.parametrize(("text", "weights", "expected"), [
    ("123", 0, 123), ("1.5GB", 0, 1_500_000_000), ("2GiB", 0, 2 * 2**30), ("512 MB", 0, 512_000_000),
    ("weights+1MB", 7, 1_000_007), (1024, 0, 1024), ("process+1KB", 7, 1_000 + 500)])
def test_parse_size(text, weights, expected):
    assert throughput.parse_size(text, weights, 500) == expected


@pytest.mark.parametrize("bad", ["3XB", "GB", "-1GB", "0", "weights+", "process+", "1.5.2GB"])
def test_parse_size_rejects(bad):
    with pytest.raises(KVBenchError, match="valid|positive"):
        throughput.parse_size(bad)


@pytest.mark.parametrize("overrides", [["bogus=1"], ["budget=3XB"], ["prefill=dense"], ["steps=0"], ["reader=fast"],
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
        # The need counts the step's temporaries beside the attention's: at least the working set, at least
        # every tensor the step allocated.
        assert single["need_bytes"] >= single["working_set_bytes"]
        assert single["need_bytes"] >= single["kv_bytes"] + single["step_temp_bytes"]
        available = 4 * single["need_bytes"]
        rows, ws = b.capacity(one, available, single)
        assert 1 <= rows <= int(cfg.max_batch)
        assert ws["need_bytes"] <= available
        if rows < int(cfg.max_batch):
            assert b.working_set(one, rows + 1)["need_bytes"] > available
        assert b.capacity(one, single["need_bytes"] // 2, single)[0] == 0


def test_run_writes_one_row_per_strategy_budget_context_and_round(tmp_path, capsys):
    """The budget is the whole process's: the process as loaded (weights + the harness's measured overhead) and
    the templates held come off it before any batch; every row served is checked against its measured peak; and
    ``full`` at int8's batch is refused before it starts, with one line."""
    import pandas as pd

    out = tmp_path / "t.csv"
    assert throughput.main(["model=tiny-llama", "strategies=[int8]", "contexts=[64]",
                            "budget=[process+200KB,weights+200KB]", "steps=2", "repeats=2", "question_tokens=4",
                            f"out={out}"]) == 0
    df = pd.read_csv(out)
    first = df.iloc[0]
    assert first["overhead_bytes"] > 0 and first["baseline_bytes"] == first["weights_bytes"] + first["overhead_bytes"]
    served = df[~df["probe"]]
    assert len(served) == 2 * 2 * 2  # full and int8, two budgets, two rounds
    assert set(df["strategy"]) == {"full", "int8"}
    # weights + 200 KB is far below the process as loaded: with the overhead counted, nothing fits.
    assert (df[df["budget"] == "weights+200KB"]["batch"] == 0).all()
    fitted = served[served["batch"] > 0]
    assert set(fitted["budget"]) == {"process+200KB"}
    assert (fitted["predicted_bytes"] == fitted["baseline_bytes"] + fitted["held_bytes"]
            + fitted["batch_need_bytes"]).all()
    assert (fitted["predicted_bytes"] <= fitted["budget_bytes"]).all()
    assert (fitted["held_bytes"] > 0).all()  # prefill=shared keeps every strategy's template
    # A fit is a measured one: the peak RSS within the budget's tolerance.
    assert (fitted["budget_status"] == "fits").all()
    assert (fitted["peak_rss_bytes"] <= fitted["budget_bytes"] * (1 + throughput.TOLERANCE)).all()
    assert (fitted["tokens_per_s"] > 0).all() and (fitted["kv_read_bytes"] > 0).all()
    # The batch served is the one the process kept: at most what the accounting admitted, its last try a fit.
    assert (fitted["batch"] <= fitted["accounted_batch"]).all()
    assert all(t.split("; ")[-1] == f"{n} fits" for t, n in zip(fitted["keep_tries"], fitted["batch"], strict=True))
    # The roofline's compute rate: a decode step's product measured at each served batch (one figure per batch).
    assert (fitted["decode_flops_per_s"] > 0).all()
    assert fitted.groupby("batch")["decode_flops_per_s"].nunique().max() == 1
    assert throughput.step_flops_rate(fitted.iloc[0]) == fitted.iloc[0]["decode_flops_per_s"]
    assert throughput.step_flops_rate(fitted.iloc[0].drop("decode_flops_per_s")) == first["flops_per_s"]
    batch = fitted.groupby("strategy")["batch"].first()
    assert batch["int8"] > batch["full"] >= 1
    probe = df[df["probe"]]
    assert len(probe) == 1
    p = probe.iloc[0]
    assert p["strategy"] == "full" and p["batch"] == batch["int8"] and p["budget_status"] == "refused"
    assert p["predicted_bytes"] > p["budget_bytes"] and pd.isna(p.get("tokens_per_s"))
    refused = [line for line in capsys.readouterr().out.splitlines() if "refused" in line]
    assert len(refused) == 1 and f"full x {batch['int8']}: refused" in refused[0]


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


def test_a_row_over_its_budget_is_not_a_fit(bench, monkeypatch):
    """The measured peak decides: a batch whose peak RSS passes the budget (+5%) is "over", not a fit; with the
    check between steps on, it is stopped at once with one line."""
    cfg, b = bench
    built, _ = b.build(throughput.check(cfg), 64)
    one = built[1]
    rss = throughput.process_bytes("cpu")
    fits = b.decode(one, 2, budget=2 * rss)
    assert fits["budget_status"] == "fits" and fits["steps_done"] == int(cfg.steps)
    stopped = b.decode(one, 2, budget=rss // 2)
    assert stopped["budget_status"] == "stopped" and stopped["steps_done"] == 0
    assert "tokens_per_s" not in stopped and len(stopped["stop_line"].splitlines()) == 1
    assert "stopped before decode step 1" in stopped["stop_line"]
    # With the check between steps blind, the sampled peak still marks the row.
    monkeypatch.setattr(throughput, "process_bytes", lambda device: 0)
    over = b.decode(one, 2, budget=rss // 2)
    assert over["budget_status"] == "over" and over["peak_rss_bytes"] > rss // 2 * (1 + throughput.TOLERANCE)


def test_synthetic_templates_are_not_held_while_a_batch_decodes(tmp_path):
    """Under prefill=synthetic a template is drawn again when needed and a batch's last row is the template
    itself: the harness holds nothing of its own, and the redrawn cache is the same."""
    cfg = throughput.compose(["model=tiny-llama", "strategies=[int8]", "contexts=[64]", "prefill=synthetic",
                              "steps=2", "repeats=1", "question_tokens=4", "max_batch=4"])
    from kvbench.hardware import HardwareProfile

    b = throughput.Bench(cfg, HardwareProfile.from_config(cfg.hardware))
    built, _ = b.build(throughput.check(cfg), 64)
    before = [one.cache.kv_bytes() for one in built]
    for one in built:
        b.working_set(one, 2)
        assert one.cache is None
    assert throughput.Bench.held(built) == 0
    _, caches, _, _ = b.batch(built[0], 1)
    assert caches[0].kv_bytes() >= before[0] and built[0].cache is None


def test_the_decode_products_rate_is_measured_on_a_weight_that_stays_in_the_caches(monkeypatch):
    """The roofline's memory term reads every weight; its compute term's FLOP/s is the products' with the weight at
    hand. Measured on a weight streamed from memory (Llama-3.2-1B's 2048 x 8192 MLP weight at one or two rows) it
    counted those bytes twice and, in a noisy window, put the roofline under the measured tokens/s. A model whose
    MLP weight is larger than ``RATE_WEIGHT_BYTES`` is measured on a slice of its columns; a small one whole."""
    from kvbench import hardware_probe
    from kvbench.hardware import HardwareProfile

    shapes = []
    monkeypatch.setattr(hardware_probe, "measure_linear_flops",
                        lambda rows, i, o, dtype, **kw: shapes.append((rows, i, o)) or 1e9)
    cfg = throughput.compose(["model=tiny-llama", "strategies=[int8]", "contexts=[64]", "dtype=bfloat16"])
    b = throughput.Bench(cfg, HardwareProfile.from_config(cfg.hardware))
    hidden = int(b.lm.config.hidden_size)
    cap = throughput.RATE_WEIGHT_BYTES // (hidden * 2)  # bf16 columns that fit the bytes
    assert cap > 64
    for inner in (64, 1 << 20):
        b.lm.config.intermediate_size = inner
        b._decode_flops.clear()
        assert b.decode_flops(2) == 1e9
        assert shapes[-1] == (2, hidden, min(inner, cap))


@pytest.mark.parametrize("linear, expected", [("native", "bfloat16"), ("float32", "float32"), ("upcast", "float32")])
def test_the_matmul_rate_is_measured_in_the_dtype_the_linear_layers_compute_in(linear, expected):
    """A bf16 model whose linear layers run natively is timed in bf16 (on a CPU without bf16 instructions its GEMMs
    run tens of times below float32's, so a float32 figure put the roofline far above the run); with float32
    copies, in float32. A one-row decode product stays native either way (kvbench.linear.MIN_ROWS)."""
    from kvbench.hardware import HardwareProfile
    from kvbench.linear import MIN_ROWS

    cfg = throughput.compose(["model=tiny-llama", "strategies=[int8]", "contexts=[64]", "dtype=bfloat16",
                              f"linear={linear}"])
    b = throughput.Bench(cfg, HardwareProfile.from_config(cfg.hardware))
    assert b.dtype == torch.bfloat16 and b.engine.linear.startswith(linear) and b.flops_dtype == expected
    assert b.flops > 0 and b.decode_flops(MIN_ROWS) > 0 and b.decode_flops(1) > 0
    assert b.decode_flops(MIN_ROWS) is b.decode_flops(MIN_ROWS)  # measured once per batch size


def test_a_batch_the_process_does_not_keep_is_shrunk_until_it_does(bench, monkeypatch):
    """The accounting admits a batch; the process may still cross the budget (pages, allocator slack). The batch
    that crossed is shrunk by its excess, in sequences of one sequence's need, and run again until it fits."""
    cfg, b = bench
    built, _ = b.build(throughput.check(cfg), 64)
    one = built[1]
    per = b.working_set(one, 1)["need_bytes"]
    budget = 10 * per
    limit = b.limit(budget)

    def decode(built, rows, budget=None):  # a process that holds 2 sequences' worth more than the accounting
        peak = limit + (rows - 6) * per if rows > 6 else limit
        return {"budget_status": "stopped" if rows > 6 else "fits", "peak_rss_bytes": peak}

    monkeypatch.setattr(b, "decode", decode)
    assert b.keep(one, 9, budget) == (6, ["9 stopped", "6 fits"])  # 3 sequences over: 3 fewer
    assert b.keep(one, 6, budget) == (6, ["6 fits"])
    monkeypatch.setattr(b, "decode", lambda built, rows, budget=None: {"budget_status": "over",
                                                                        "peak_rss_bytes": limit + 1})
    assert b.keep(one, 2, budget) == (0, ["2 over", "1 over"])  # at least one fewer a try; none kept


def test_a_batch_the_process_stops_keeping_in_a_round_is_kept_again_and_the_rounds_restart(tmp_path, monkeypatch):
    """A batch kept once can cross the budget in a later round (the heap grows with the batches run since): it is
    kept again, smaller, and every round starts again, so every round serves the same batches and each round's
    gain is still a ratio within one stretch of time."""
    import pandas as pd

    real = throughput.Bench.decode
    calls: dict[tuple[str, int], int] = {}
    stopped: list[int] = []

    def decode(self, built, rows, budget=None):
        key = (built.strategy.name, rows)
        calls[key] = calls.get(key, 0) + 1
        out = real(self, built, rows, budget)
        if built.strategy.name == "int8" and calls[key] == 2 and rows > 1 and not stopped:  # first timed round
            stopped.append(rows)
            out = {**out, "budget_status": "stopped", "steps_done": 0, "stop_line": "int8: stopped (test)",
                   "peak_rss_bytes": self.limit(budget) + 1}
        return out

    monkeypatch.setattr(throughput.Bench, "decode", decode)
    out = tmp_path / "t.csv"
    assert throughput.main(["model=tiny-llama", "strategies=[int8]", "contexts=[64]", "budget=process+200KB",
                            "steps=2", "repeats=2", "question_tokens=4", f"out={out}"]) == 0
    df = pd.read_csv(out)
    served = df[~df["probe"]]
    int8 = served[served["strategy"] == "int8"]
    assert sorted(served["round"]) == [0, 0, 1, 1] and int8["batch"].nunique() == 1
    first = int(int8["accounted_batch"].iloc[0])
    assert int(int8["batch"].iloc[0]) < first
    assert f"{first} stopped in round 1" in int8["keep_tries"].iloc[0]
    assert (served["budget_status"] == "fits").all()


def test_the_roofline_times_attention_at_the_matmul_rate_and_the_linear_layers_at_the_step_products():
    """scripts/bench_throughput.py's roofline: the larger of the bytes' time and the FLOPs' time, the linear
    layers' FLOPs at the rate of the step's products at that batch and attention's at the better of that and the
    square matmul's. Timed all at the products' rate (a rate that at one or two rows is mostly per-call work) it
    fell under the measured tokens/s at 32K; a CSV without ``attn_flops`` keeps that older reading."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("bench_throughput", root / "scripts" / "bench_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    df = pd.read_csv(root / "results" / "perf" / "avx512" / "throughput_random.csv")
    df = df[df["context"] == df["context"].iloc[0]].copy()
    df["bandwidth_bytes_per_s"] = 1e30  # bytes take no time: the FLOPs bound
    df["flops"], df["decode_flops_per_s"], df["flops_per_s"] = 10.0, 2.0, 4.0
    split = bench.summarize(df.assign(attn_flops=4.0))
    older = bench.summarize(df.drop(columns="attn_flops", errors="ignore"))
    faster = bench.summarize(df.assign(attn_flops=4.0, decode_flops_per_s=8.0))  # the products' rate the better
    for res, seconds in ((split, 6 / 2 + 4 / 4), (older, 10 / 2), (faster, 10 / 8)):
        fitted = res[res["roof_tps"].notna()]
        assert len(fitted) == 2 and (fitted["bound"] == "compute").all()
        assert fitted["roof_comp_s"].tolist() == [seconds] * 2
        assert (fitted["roof_tps"] == fitted["batch"] / seconds).all()
