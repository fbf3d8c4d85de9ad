"""``kvbench advise``'s predictions checked against ``kvbench throughput`` measured in the same run (issue 54, item 2).

    PYTHONPATH=. nice -n 10 python scripts/bench_advise.py                 # measure, predict, compare
    PYTHONPATH=. python scripts/bench_advise.py --render-only              # compare the committed CSV again
    PYTHONPATH=. python scripts/bench_advise.py --hardware server-gpu-80g --budget process+8GB \\
        --contexts 8192,16384 --tag gpu                                     # the same on a CUDA machine

Runs ``kvbench throughput`` once (``results/perf/advise_validation[_<tag>].csv``: every (strategy, context,
budget), ``full`` included; budgets are the whole process's, ``process+X``) and, per cell, what
:mod:`kvbench.advise` predicts for the same model, context and memory (as the device's memory: what the run left
for caches — the budget less the process as loaded and the templates the harness held — plus the 2-byte weights
advise takes off again; no reserve): ``fits`` from the store's bytes per token through :mod:`kvbench.calc`, and
decode tokens/s and prefill seconds from the roofline of :mod:`kvbench.hardware` — at the batch the measurement
ran, so the speed model is judged apart from the capacity model. The roofline is evaluated twice: over the
hardware profile's figures (what ``kvbench advise`` prints), and over figures ``kvbench throughput`` measured in the
same run (the copy bandwidth; for a decode step the FLOP/s of its MLP product at that batch, for the prefill the
square matmul's, each in the dtype the linear layers compute in). A batch the run stopped (its peak RSS past the
budget) measured no capacity and is left out of the medians. Writes ``results/perf/advise_validation[_<tag>].md``:
predicted, measured and the relative error per cell, and the median error per column.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "results" / "perf"
sys.path.insert(0, str(ROOT))

from kvbench.hardware import load_profile  # noqa: E402
from kvbench.throughput import step_flops_rate  # noqa: E402

DEFAULTS = {"model": "smollm2-135m", "hardware": "cpu", "strategies": "int8,int4,snapkv",
            "contexts": "1024,2048", "budget": "[process+0.1GB,process+0.3GB]", "linear": "auto", "task": "legal",
            "steps": 4, "repeats": 1}


def measure(args: argparse.Namespace, csv: Path) -> str:
    overrides = [f"model={args.model}", f"hardware={args.hardware}", "prefill=shared", f"linear={args.linear}",
                 f"strategies=[{args.strategies}]", f"contexts=[{args.contexts}]", f"budget={args.budget}",
                 f"steps={args.steps}", f"repeats={args.repeats}", f"out={csv}"]
    cmd = [sys.executable, "-m", "kvbench", "throughput", *overrides]
    print("+ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return "kvbench throughput " + " ".join(overrides)


def device_memory(row: pd.Series, arch) -> int:
    """The memory ``kvbench advise`` is given for a measured row: what the run left for caches (the budget less the
    process as loaded — the harness's overhead and float32 weight copies included — and the templates the harness
    holds while a batch decodes), plus the 2-byte weights advise takes off again. CSVs written before the process
    was measured (``baseline_bytes``) give the budget as it is."""
    loaded = row.get("baseline_bytes", float("nan"))
    if loaded != loaded:
        return int(row["budget_bytes"])
    return int(row["budget_bytes"] - loaded - row.get("held_bytes", 0) + 2 * arch.params)


def _err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas else float("nan")


def compare(df: pd.DataFrame, task: str, results_root: Path) -> pd.DataFrame:
    """One row per (strategy, context, budget): predicted and measured fits, tokens/s and prefill seconds."""
    from kvbench import advise, calc

    first = df.iloc[0]
    arch = calc.resolve_model(str(first["model"]).removesuffix("-random"))
    profile = load_profile(str(first["hardware"]))
    measured = {m.name: m for m in advise.load_measured(results_root, "query-agnostic", int(first["context"]))}
    out = []
    if "probe" in df:  # `full` at int8's batch, refused or stopped on purpose: no capacity to predict
        df = df[~df["probe"].astype(bool)]
    for (_label, context, _budget), g in df.groupby(["label", "context", "budget"], sort=False):
        row = g.iloc[0]
        name = str(row["strategy"])
        m = measured.get(name)
        if m is None:
            continue
        budget_bytes = int(row["budget_bytes"])
        memory = device_memory(row, arch)
        bandwidth = float(row["bandwidth_bytes_per_s"]) / 1e9
        probed = replace(profile, device_mem_bw_gbps=bandwidth, peak_flops=float(row["flops_per_s"]))
        # A decode step's products at the measured batch, at the rate measured for that shape in the same run.
        probed_step = replace(probed, peak_flops=step_flops_rate(row))
        res = {"strategy": name, "context": int(context), "budget_gb": budget_bytes / 1e9}
        for tag, hw, step_hw in (("profile", profile, profile), ("probed", probed, probed_step)):
            d = advise.Deployment(arch=arch, hardware=replace(hw, memory_bytes=memory), context=int(context),
                                  task=task, reserve=0.0)
            r = advise.project(d, m)
            batch = int(row["batch"])
            step, bound = advise.decode_step(replace(d, hardware=replace(step_hw, memory_bytes=memory)),
                                             r.bytes_per_element, m.kept_fraction, max(batch, 1))
            res[f"{tag}_tps"] = batch / step if batch else float("nan")
            res[f"{tag}_bound"] = bound
            res[f"{tag}_prefill_s"] = advise.prefill(d)[0]
            res["pred_fits"] = r.fits
        res["pred_kv_mb"] = r.kv_bytes_per_seq / 1e6
        res["kv_mb"] = float(row["seq_kv_bytes"]) / 1e6
        res["ws_mb"] = float(row["seq_working_set_bytes"]) / 1e6
        res["fits"] = int(row["batch"])
        # A batch the run stopped (its peak RSS past the budget) did not fit: the capacity lies below it, unknown.
        res["stopped"] = bool((g.get("budget_status", pd.Series(dtype=str)) == "stopped").any())
        res["tps"] = float(g["tokens_per_s"].median()) if res["fits"] and not res["stopped"] else float("nan")
        res["prefill_s"] = float(g["prefill_s"].median())
        res["load_1m"] = float(g["load_1m"].mean()) if "load_1m" in g else float("nan")
        res["fits_err"] = float("nan") if res["stopped"] else _err(res["pred_fits"], res["fits"])
        for tag in ("profile", "probed"):
            res[f"{tag}_tps_err"] = _err(res[f"{tag}_tps"], res["tps"])
            res[f"{tag}_prefill_err"] = _err(res[f"{tag}_prefill_s"], res["prefill_s"])
        out.append(res)
    return pd.DataFrame(out)


def _decode_rates(raw: pd.DataFrame) -> str:
    """The decode products' FLOP/s per batch measured in the run (absent from CSVs written before them)."""
    if "decode_flops_per_s" not in raw or raw["decode_flops_per_s"].isna().all():
        return ""
    rates = raw.dropna(subset=["decode_flops_per_s"]).groupby("batch")["decode_flops_per_s"].median()
    return "; a decode step's MLP product " + ", ".join(f"{v / 1e9:.1f} GFLOP/s at {int(b)} rows"
                                                         for b, v in rates.items())


def _held(r0: pd.Series) -> str:
    held = r0.get("baseline_bytes", float("nan"))
    return "" if held != held else f"; process as loaded (before any cache) {held / 1e9:.3f} GB"


def _num(x: float) -> str:
    return "—" if x != x else f"{x:.1f}"


def _fits(r: pd.Series) -> str:
    return f"< {r['fits']} (stopped)" if r.get("stopped", False) else str(r["fits"])


def _pct(x: float) -> str:
    return "—" if x != x else f"{100 * x:.0f}%"


def _median(s: pd.Series) -> float:
    vals = [v for v in s if v == v]
    return statistics.median(vals) if vals else float("nan")


def render(res: pd.DataFrame, raws: list[pd.DataFrame], out: Path) -> str:
    first = raws[0].iloc[0]
    med = {c: _median(res[c]) for c in ("fits_err", "profile_tps_err", "probed_tps_err", "profile_prefill_err",
                                        "probed_prefill_err")}
    lines = ["# `kvbench advise` checked against `kvbench throughput` (measured by `scripts/bench_advise.py`)", ""]
    for raw in raws:
        r0 = raw.iloc[0]
        lines += [f"Measured: `{r0.get('command', '')}` (commit {r0.get('commit', '')}); {r0['model']} in "
                  f"{r0['dtype']} on {r0['device']}, {int(r0['threads'])} threads, engine.linear={r0['linear']}; "
                  f"copy bandwidth "
                  f"{r0['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s and {r0.get('flops_dtype', 'float32')} matmul "
                  f"{r0['flops_per_s'] / 1e9:.1f} GFLOP/s measured at its start{_decode_rates(raw)}{_held(r0)}; "
                  f"load average (1 min) {raw['load_1m'].min():.1f}–{raw['load_1m'].max():.1f} while it ran.", ""]
    lines += [
        "Predicted by `kvbench.advise` for the same model, context and memory (as the device's memory: what the run "
        "left for caches — the budget less the process as loaded and the templates it held — plus the 2-byte "
        "weights advise takes off again; reserve 0), from the committed store's "
        "bytes per token (`results/**/leaderboard.csv`, query-agnostic). Speed predictions are at the batch the "
        f"measurement ran (so the speed model is judged apart from `fits`): over the `{first['hardware']}` profile's "
        "figures (\"profile\") and over the figures measured in the same run (\"probed\": the copy bandwidth; "
        "for a decode step the FLOP/s of its MLP product at that batch, for the prefill the square matmul's, each in "
        "the dtype the linear layers compute in). "
        "Error = |predicted − measured| / measured.", "",
        "| strategy | context | budget GB | KV MB/seq predicted | KV MB/seq stored | working set MB/seq | "
        "fits predicted | fits measured | fits error | tokens/s measured | "
        "tokens/s profile (bound) | error | tokens/s probed (bound) | error | prefill s measured | prefill s "
        "profile | error | prefill s probed | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for _, r in res.iterrows():
        lines.append(
            f"| {r['strategy']} | {r['context']:,} | {r['budget_gb']:.3f} | {r['pred_kv_mb']:.2f} | {r['kv_mb']:.2f} | "
            f"{r['ws_mb']:.2f} | {r['pred_fits']} | {_fits(r)} | "
            f"{_pct(r['fits_err'])} | {_num(r['tps'])} | {r['profile_tps']:.1f} ({r['profile_bound']}) | "
            f"{_pct(r['profile_tps_err'])} | {r['probed_tps']:.1f} ({r['probed_bound']}) | "
            f"{_pct(r['probed_tps_err'])} | {r['prefill_s']:.2f} | {r['profile_prefill_s']:.2f} | "
            f"{_pct(r['profile_prefill_err'])} | {r['probed_prefill_s']:.2f} | {_pct(r['probed_prefill_err'])} |")
    lines += ["", f"**Median error over {len(res)} cells**: fits {_pct(med['fits_err'])}; decode tokens/s "
              f"{_pct(med['profile_tps_err'])} over the profile, {_pct(med['probed_tps_err'])} over the same-run "
              f"figures; prefill {_pct(med['profile_prefill_err'])} over the profile, "
              f"{_pct(med['probed_prefill_err'])} over the same-run figures.", ""]
    lines += cause_lines(res, med, raws)
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def cause_lines(res: pd.DataFrame, med: dict[str, float], raws: list[pd.DataFrame]) -> list[str]:
    """What the errors above 25% come from, stated from the figures (a reader checks them against the table)."""
    lines = []
    if med["fits_err"] <= 0.25:
        lines.append(f"`fits` is within 25% (median {_pct(med['fits_err'])}): the store's bytes per token, "
                     "projected by `kvbench.calc`, are the bytes a sequence holds here.")
    else:
        lines.append(f"`fits` misses by a median {_pct(med['fits_err'])}: the projection counts the stored bytes "
                     "(the KV columns: predicted against stored), while a sequence here holds its measured working set "
                     "(stored bytes + the dequantized working copy kept as scratch by default + the step's "
                     "temporaries, `kvbench/footprint.py`), which a deployment's reserve must cover.")
    stopped = res[res.get("stopped", pd.Series(False, index=res.index)).astype(bool)]
    if len(stopped):
        lines.append(f"{len(stopped)} of {len(res)} cells were stopped (`< n (stopped)`): the batch the run's own "
                     "accounting admitted took the process's peak RSS past the budget (+5%) before its decode steps "
                     "finished, so the capacity there is below the batch tried and unknown; they are left out of "
                     "the `fits` and tokens/s medians.")
    stored = _median(res["kv_mb"] / res["pred_kv_mb"])
    if stored > 1.1:
        lines.append(f"The stored bytes themselves exceed the projection (median ×{stored:.2f}, the KV columns): the "
                     "projection uses each strategy's bytes per token measured at the store's 4,096-token contexts, "
                     "and at these short contexts a store holds more per context token (the question's tokens, "
                     "buffer headroom, and an eviction window that a 4K context dilutes).")
    timed = res.dropna(subset=["tps"])
    over = (timed["probed_tps"] > timed["tps"]).mean() if len(timed) else float("nan")
    if med["probed_tps_err"] > 0.25:
        share = _median(timed["tps"] / timed["probed_tps"])
        lines.append(f"Decode tokens/s misses by a median {_pct(med['probed_tps_err'])} even over the same-run "
                     f"figures, the roofline above the measurement in {over:.0%} of the {len(timed)} timed cells: "
                     f"the bytes and FLOPs it counts, at the rates measured for them, take a median {_pct(share)} of "
                     "a measured step. The rest is what a roofline does not count: the model's other operators "
                     "(norms, rotary embeddings, the activation, residual adds, each a dispatch per layer), the "
                     "harness's cache bookkeeping and the reader's own instructions (`results/perf/reader.md`; "
                     "`results/perf/decode.md` measures the model's products alone at under half of a step).")
    if max(med["profile_tps_err"], med["profile_prefill_err"]) > 0.25:
        first = raws[-1].iloc[0]
        hw = load_profile(str(first["hardware"]))
        rates = raws[-1].get("decode_flops_per_s", pd.Series(dtype=float)).dropna()
        decode = (f"{rates.min() / 1e9:.1f}–{rates.max() / 1e9:.1f} GFLOP/s at the decode batches and "
                  if len(rates) else "")
        where = "; ".join(hw.sources) or "no source recorded"
        lines.append(f"Over the `{hw.name}` profile's figures decode misses by a median "
                     f"{_pct(med['profile_tps_err'])} and prefill by {_pct(med['profile_prefill_err'])}: the profile's "
                     f"{hw.peak_flops / 1e9:,.0f} GFLOP/s ({hw.dtype}) and {hw.device_mem_bw_gbps:g} GB/s describe the "
                     f"machine it was probed on ({where}), while here the products the model computes reached "
                     f"{decode}{first['flops_per_s'] / 1e9:.1f} GFLOP/s as a square "
                     f"{first.get('flops_dtype', 'float32')} matmul (the same-run columns). A profile describes one "
                     "machine: `kvbench hardware probe` writes this one's, and `kvbench advise hardware=<it>` "
                     "predicts from it.")
    if med["probed_prefill_err"] > 0.25:
        lines.append(f"Prefill misses by a median {_pct(med['probed_prefill_err'])} over the same-run figures: "
                     "a prefill's products (a few hundred rows each) run below the square matmul measured at the "
                     "start, and the prefill also computes attention and captures every layer's keys and values "
                     "for the strategies to compress (`prefill=shared`), which the roofline does not count.")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in DEFAULTS.items():
        ap.add_argument(f"--{key}", default=value, type=type(value))
    ap.add_argument("--tag", default="", help="suffix of the output files (e.g. gpu)")
    ap.add_argument("--out", default=str(PERF))
    ap.add_argument("--results-root", default=str(ROOT / "results"))
    ap.add_argument("--render-only", action="store_true", help="compare the committed CSV(s) again, measuring nothing")
    ap.add_argument("--also", nargs="*", default=[], help="further advise_validation CSVs (earlier runs) to include")
    args = ap.parse_args()
    stem = "advise_validation" + (f"_{args.tag}" if args.tag else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv = out / f"{stem}.csv"
    if not args.render_only:
        measure(args, csv)
    raws = [pd.read_csv(p) for p in [*map(Path, args.also), csv] if p.is_file()]
    if not raws:
        sys.exit(f"bench_advise: no {csv} to compare; run without --render-only")
    res = pd.concat([compare(raw, args.task, Path(args.results_root)) for raw in raws], ignore_index=True)
    print(render(res, raws, out / f"{stem}.md"))


if __name__ == "__main__":
    main()
