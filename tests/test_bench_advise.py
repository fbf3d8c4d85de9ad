"""scripts/bench_advise.py's comparison (issue 54, item 2) on the committed measurement, without measuring: each
prediction is kvbench.advise over the run's own budget, each error |predicted − measured| / measured, and the page
reads agreement as agreement."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench import advise, calc
from kvbench.hardware import attention_flops

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "results" / "perf" / "advise_validation.csv"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_advise", ROOT / "scripts" / "bench_advise.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def raw() -> pd.DataFrame:
    return pd.read_csv(CSV)


@pytest.fixture(scope="module")
def measured() -> dict[str, advise.Measured]:
    return {m.name: m for m in advise.load_measured(ROOT / "results", "query-agnostic", 512)}


def test_predictions_are_calc_and_the_roofline_over_the_run_budget(bench, raw, measured):
    res = bench.compare(raw, "legal", ROOT / "results")
    served = raw[~raw["probe"]]  # `full` at int8's batch is the overflow probe, not a capacity to predict
    assert len(res) == served.groupby(["label", "context", "budget"]).ngroups >= 8
    arch = calc.preset("smollm2-135m")
    judged = 0
    for _, r in res.iterrows():
        m = measured[r["strategy"]]
        at = (served["strategy"] == r["strategy"]) & (served["context"] == r["context"])
        row = served[at & (abs(served["budget_bytes"] / 1e9 - r["budget_gb"]) < 1e-9)].iloc[0]
        bpe = m.bytes_per_element()
        # fits: what the run left for caches (the budget less the process as loaded and the templates it held),
        # over the projected KV of one sequence.
        kv = 2 * 30 * 3 * 64 * r["context"] * bpe
        left = row["budget_bytes"] - row["baseline_bytes"] - row["held_bytes"]
        assert r["pred_fits"] == max(0, math.floor(left / kv))
        if row["budget_status"] == "stopped":  # the batch tried did not hold: no capacity measured
            assert r["stopped"] and math.isnan(r["fits_err"]) and math.isnan(r["tps"])
            continue
        if not r["fits"]:
            continue
        judged += 1
        assert r["fits_err"] == pytest.approx(abs(r["pred_fits"] - r["fits"]) / r["fits"])
        # probed tokens/s: the measured batch's step over the run's own copy bandwidth and the FLOP/s of a decode
        # product at that batch.
        b = int(row["batch"])
        rate = row["decode_flops_per_s"]
        nbytes = 2 * arch.params + b * kv
        flops = b * (2 * arch.params + attention_flops(64, m.kept_fraction * r["context"] * 30, 9))
        step = max(nbytes / row["bandwidth_bytes_per_s"], flops / rate)
        assert r["probed_tps"] == pytest.approx(b / step)
        assert r["probed_bound"] == ("memory" if nbytes / row["bandwidth_bytes_per_s"] >= flops / rate
                                     else "compute")
        assert r["probed_tps_err"] == pytest.approx(abs(r["probed_tps"] - r["tps"]) / r["tps"])
    assert judged >= 8


def _cell(frame: pd.DataFrame, r: pd.Series) -> pd.Series:
    return ((frame["strategy"] == r["strategy"]) & (frame["context"] == r["context"])
            & (abs(frame["budget_bytes"] / 1e9 - r["budget_gb"]) < 1e-9))


def test_agreement_reads_as_agreement_and_a_miss_names_its_cause(bench, raw, tmp_path):
    res = bench.compare(raw, "legal", ROOT / "results")
    # A run that measured exactly what was predicted (every batch held): every error 0, and the page says fits is
    # within 25%.
    agree = raw[~raw["probe"]].assign(budget_status="fits")
    for _, r in res.iterrows():
        agree.loc[_cell(agree, r), "batch"] = r["pred_fits"]
    again = bench.compare(agree, "legal", ROOT / "results")
    for _, r in again.iterrows():
        agree.loc[_cell(agree, r), "tokens_per_s"] = r["probed_tps"]
    same = bench.compare(agree, "legal", ROOT / "results")
    timed = same.dropna(subset=["probed_tps_err"])
    assert len(timed) >= 8 and not same["stopped"].any()
    assert same["fits_err"].max() == 0 and timed["probed_tps_err"].max() == pytest.approx(0, abs=1e-9)
    text = bench.render(same, [agree], tmp_path / "agree.md")
    assert f"**Median error over {len(same)} cells**: fits 0%" in text and "over the profile, 0% over the same-run" \
        in text
    assert "`fits` is within 25%" in text and "Decode tokens/s misses" not in text and "stopped" not in text
    # Half the predicted speed measured: a 100% error, and the cause paragraph appears.
    half = agree.assign(tokens_per_s=agree["tokens_per_s"] / 2)
    slow = bench.compare(half, "legal", ROOT / "results").dropna(subset=["probed_tps_err"])
    assert slow["probed_tps_err"].tolist() == pytest.approx([1.0] * len(slow))
    assert "Decode tokens/s misses by a median 100%" in bench.render(slow, [half], tmp_path / "half.md")


def test_committed_page_is_the_render_of_the_committed_csvs(bench, tmp_path):
    """results/perf/advise_validation.md is scripts/bench_advise.py --render-only over the committed CSVs."""
    raws = [pd.read_csv(CSV)]
    res = pd.concat([bench.compare(r, "legal", ROOT / "results") for r in raws], ignore_index=True)
    committed = (ROOT / "results" / "perf" / "advise_validation.md").read_text()
    assert len(res) >= 8
    assert bench.render(res, raws, tmp_path / "page.md") == committed, "rerun scripts/bench_advise.py --render-only"
