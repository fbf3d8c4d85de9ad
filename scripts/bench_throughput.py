"""Capacity and decode throughput at a fixed memory budget, with a roofline (issue 41, items 4 and 5).

    PYTHONPATH=. python scripts/bench_throughput.py                  # runs both parts below, then renders
    PYTHONPATH=. python scripts/bench_throughput.py --render-only    # the table and plot from the CSVs only

Runs ``kvbench throughput`` (:mod:`kvbench.throughput`) twice, each into its own CSV under ``results/perf/``:

* ``throughput_embedded.csv`` — the embedded SmolLM2-135M at 4,096 and 8,192 tokens (its limit), shared prefill;
* ``throughput_random.csv`` — Llama-3.2-1B's geometry with random weights at 16,384 and 32,768 tokens, K/V
  streamed into each store in chunks (``prefill=synthetic``): **random weights: memory and speed only**.

and writes ``results/perf/throughput.md`` and ``throughput.png`` (decode tokens/s against the budget, one line per
strategy, one panel per model and context). Per row, the roofline: one decode step of the batch reads the linear
weights (as the engine runs them) and every sequence's KV (the bytes attention reads), and computes 2 FLOPs per
weight per sequence plus the attention's products; its time is the larger of bytes over the copy bandwidth and
the FLOPs' time — the linear layers' over the FLOP/s of the step's MLP product at that batch (in the dtype they
compute in, on a weight that stays in the caches), attention's over the better of that and the square matmul's
FLOP/s — all measured in the same run (``kvbench.throughput``). The same bytes and FLOPs over the
``server-gpu-80g`` profile's datasheet figures are what the table predicts for a GPU.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "results" / "perf"
# Budgets are the whole process's (kvbench.throughput): ``process+X`` is the process as loaded (weights and the
# harness's overhead, measured) plus X for caches and the step's temporaries. ``linear=upcast``: float32 products
# without held float32 copies of the weights (513 MiB for SmolLM2-135M, kvbench/linear.py): on a CPU without bf16
# instructions the native bf16 product of a batched decode step runs at about a third of float32's (an AVX2 EPYC,
# one thread, 576 -> 1,536 at 6 rows: bf16 9.6 GFLOP/s, upcast 17.9, float32 copies 32.5), so native would time
# the GEMM more than the cache; upcast converts each weight at each call, a few MB at a time.
# ``reader=simd``: the vector reader (kvbench/fused.py), whose int8 path takes about half bf16's time per token
# (results/perf/simd/reader.md); ``auto`` stays the first kernel, which the confirmatory study runs on.
PARTS = {
    "embedded": ["model=smollm2-135m", "prefill=synthetic", "contexts=[4096,8176]", "strategies=[int8]",
                 "budget=[process+0.3GB,process+0.6GB]", "linear=upcast", "reader=simd"],
    "random": ["model=llama-3.2-1b-random", "prefill=synthetic", "contexts=[16384,32768]",
               "strategies=[int8]", "budget=[process+1.2GB]", "linear=upcast", "reader=simd"],
}
TOLERANCE = 0.05  # kvbench.throughput.TOLERANCE, for CSVs written before it was a column
GPU_PROFILE = "server-gpu-80g"


def run_part(name: str, steps: int, repeats: int, extra: list[str], where: Path) -> None:
    out = where / f"throughput_{name}.csv"
    cmd = [sys.executable, "-m", "kvbench", "throughput", *PARTS[name], f"steps={steps}", f"repeats={repeats}",
           f"out={out}", *extra]
    print("+ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def gain_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round ratios and its 95% t-interval (on the log scale); NaN bounds for one round."""
    from scipy import stats

    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    mean = sum(logs) / len(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    sd = (sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)) ** 0.5
    half = stats.t.ppf(0.975, len(logs) - 1) * sd / len(logs) ** 0.5
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def budget_status(df: pd.DataFrame) -> pd.Series:
    """Each row's status: as recorded, or, in a CSV written before the process's budget was kept, from its
    measured peak RSS against the budget (the same tolerance)."""
    derived = ["none" if not b else "over" if p > t * (1 + TOLERANCE) else "fits"
               for b, p, t in zip(df["batch"], df.get("peak_rss_bytes", pd.Series(0, index=df.index)).fillna(0),
                                  df["budget_bytes"], strict=True)]
    if "budget_status" not in df:
        return pd.Series(derived, index=df.index)
    return df["budget_status"].fillna(pd.Series(derived, index=df.index))


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    from kvbench.hardware import load_profile, profile_roofline, roofline_seconds
    from kvbench.throughput import step_flops_rate

    gpu = load_profile(GPU_PROFILE)
    df = df.assign(probe=df["probe"].fillna(False).astype(bool) if "probe" in df else False,
                   budget_status=budget_status(df))
    out = []
    keys = ["model", "context", "budget"]
    for (model, context, budget), g in df.groupby(keys, sort=False):
        full = g[(g["strategy"] == "full") & ~g["probe"]].set_index("round")
        for label, s in g.groupby("label", sort=False):
            s = s.set_index("round")
            first = s.iloc[0]
            statuses = set(s["budget_status"])
            row = {"model": model, "context": context, "budget": budget, "budget_bytes": first["budget_bytes"],
                   "strategy": first["strategy"], "label": label, "batch": int(first["batch"]),
                   "probe": bool(first["probe"]),
                   "accounted_batch": first.get("accounted_batch", float("nan")),
                   "keep_tries": first.get("keep_tries", ""),
                   # A row fits only if every round's measured peak did.
                   "status": next((x for x in ("refused", "stopped", "over") if x in statuses), first["budget_status"]),
                   "predicted_bytes": first.get("predicted_bytes", float("nan")),
                   "seq_kv_bytes": first["seq_kv_bytes"], "seq_scratch_bytes": first["seq_scratch_bytes"],
                   "seq_ws_bytes": first.get("seq_need_bytes", first["seq_working_set_bytes"]),
                   "batch_ws_bytes": first["batch_working_set_bytes"],
                   "weights_bytes": first["weights_bytes"], "rounds": len(s)}
            if "peak_rss_bytes" in s and s["peak_rss_bytes"].notna().any():
                row["peak_rss_bytes"] = s["peak_rss_bytes"].max()
            if row["batch"] and row["status"] in ("fits", "over"):
                row.update({"tokens_per_s": s["tokens_per_s"].median(), "ms_per_step": s["ms_per_step"].median(),
                            "ttft_s": s["ttft_s"].median()})
                # The larger of the bytes' time and the FLOPs' time. The linear layers' FLOPs run at the rate of the
                # step's products at this batch; attention's at the better of that and the square matmul's: the
                # products' rate at one or two rows is mostly per-call work (upcast converts each weight at each
                # call), and charged to attention's FLOPs too it put the roofline under the measured tokens/s (32K,
                # random weights). CSVs written before attention's FLOPs were recorded apart time them all at the
                # products' rate.
                weights_kv = first["weight_read_bytes"] + first["kv_read_bytes"]
                rate = step_flops_rate(first)
                attn = first.get("attn_flops", 0.0)
                attn = 0.0 if attn != attn else float(attn)
                comp_s = (first["flops"] - attn) / rate + attn / max(rate, first["flops_per_s"])
                mem_s = weights_kv / first["bandwidth_bytes_per_s"]
                seconds, bound = roofline_seconds(weights_kv, comp_s, first["bandwidth_bytes_per_s"], 1.0)  # in s
                row.update({"roof_tps": row["batch"] / seconds, "bound": bound, "roof_mem_s": mem_s,
                            "roof_comp_s": comp_s})
                gpu_s, _ = profile_roofline(gpu, first["weight_native_read_bytes"] + first["kv_read_bytes"],
                                            first["flops"])
                row["gpu_tps"] = row["batch"] / gpu_s
                if not full.empty and int(full.iloc[0]["batch"]):
                    common = s.index.intersection(full.index)
                    ratios = [s.loc[r, "tokens_per_s"] / full.loc[r, "tokens_per_s"] for r in common]
                    row["gain"], row["gain_lo"], row["gain_hi"] = gain_interval(ratios)
            out.append(row)
    res = pd.DataFrame(out)
    base_rows = res[(res["strategy"] == "full") & ~res["probe"]].set_index(keys)
    for col in ("roof_tps", "gpu_tps"):
        if col in res:
            base = base_rows[col]
            res[col.replace("tps", "gain")] = [r[col] / base.get(tuple(r[k] for k in keys), float("nan"))
                                               for _, r in res.iterrows()]
    base_b = base_rows["batch"]
    res["capacity_ratio"] = [r["batch"] / base_b.get(tuple(r[k] for k in keys), float("nan"))
                             if base_b.get(tuple(r[k] for k in keys), 0) else float("nan") for _, r in res.iterrows()]
    return res


def _f(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _loaded(first: pd.Series) -> str:
    if "baseline_bytes" not in first or not math.isfinite(first["baseline_bytes"]):
        return ""
    return (f", process as loaded {first['baseline_bytes'] / 1e9:.3f} GB (harness overhead "
            f"{first['overhead_bytes'] / 1e9:.3f} GB)")


def _reader(first: pd.Series) -> str:
    """The reader the rows ran with (kvbench.fused.READERS), where the CSV records it."""
    reader = first.get("reader")
    return f", reader {reader}" if isinstance(reader, str) and reader else ""


def _fits(r: pd.Series) -> str:
    """The batch, and unless it fits, why not: over (measured peak past the budget), stopped, refused."""
    n, status = int(r["batch"]), r["status"]
    accounted = r.get("accounted_batch", float("nan"))
    if status in ("fits", "none"):
        # Where the process kept fewer than the accounting admitted (kvbench.throughput.Bench.keep), both.
        if isinstance(accounted, float) and math.isfinite(accounted) and int(accounted) != n:
            return f"{n} (accounting {int(accounted)}: {r['keep_tries']})"
        return str(n)
    if status == "refused":
        return f"{n}: refused (predicted {r['predicted_bytes'] / 1e9:.2f} GB)"
    return f"{n}: {status} (peak {_f(r.get('peak_rss_bytes', float('nan')) / 1e9, '.2f')} GB)"


def _processor(first: pd.Series) -> str:
    """`` (the CPU or GPU)`` where the CSV names it (rows written since 2026-12-07)."""
    p = first.get("processor")
    return f" ({p})" if isinstance(p, str) and p else ""


def render(frames: dict[str, pd.DataFrame], out: Path) -> None:
    lines = ["# Capacity and decode throughput at a fixed memory budget (measured by `scripts/bench_throughput.py`)",
             ""]
    for name, df in frames.items():
        first = df.iloc[0]
        command = first.get("command", "kvbench throughput " + " ".join(PARTS[name]))
        commit = first.get("commit", "")
        commit = "" if not isinstance(commit, str) or not commit else f" (commit {commit})"
        lines += [f"Part `{name}`{commit}: `{command}`; "
                  f"{first['model']} in {first['dtype']} on {first['device']}{_processor(first)}, "
                  f"{int(first['threads'])} threads, "
                  f"engine.linear={first['linear']}, attention={first['attention']}{_reader(first)}; weights as held "
                  f"{first['weights_bytes'] / 1e9:.3f} GB{_loaded(first)}; measured at the start: copy bandwidth "
                  f"{first['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, {first.get('flops_dtype', 'float32')} matmul "
                  f"{first['flops_per_s'] / 1e9:.1f} GFLOP/s.", ""]
    loads = [f"`{n}` {df['load_1m'].min():.1f}–{df['load_1m'].max():.1f}" for n, df in frames.items()
             if "load_1m" in df and df["load_1m"].notna().any()]
    if loads:  # measured beside every row: how many processes wanted the CPUs while it ran
        lines += [f"Load average (1 min) while the rows ran, on {int(first['threads'])} threads: {'; '.join(loads)}. "
                  "On a shared machine absolute tokens/s, bandwidth and FLOP/s depend on it; the gains are ratios "
                  "within each round.", ""]
    lines += [
        "Gains are ratios within each round (strategies take turns), and the interval is a 95% t-interval over "
        "the rounds' log ratios.", "",
        "The budget is what the whole process may hold: the process as loaded (weights as held + the harness's "
        "overhead, measured as the RSS before any cache minus the weights), the templates the harness keeps, "
        "and the batch's need (stored bytes + scratch + the step's temporaries, `kvbench/throughput.py`). The "
        "accounting admits the largest batch whose predicted total is within the budget; that batch then runs "
        "once with the process's RSS checked between decode steps and, stopped or over, is shrunk by its excess "
        "until the process keeps it: `fits` is the batch kept (\"accounting N\" and the tries where it admitted "
        f"more). It counts only when every round's measured peak RSS stays within the budget (+{TOLERANCE:.0%}): "
        "a row past it is marked `over`, not a fit; a batch past the limit between steps is `stopped`. "
        "`full (at int8's batch)` is `full` given the batch int8 fits: predicted over the budget, it is "
        "`refused` before it starts — an overflow stops inference. (Rows whose CSV predates this accounting "
        "sized batches by the budget minus the weights only; their status is read from their peak RSS.) "
        "TTFT = prefill of "
        "one sequence + its compression + the batch's question pass. Roofline: (weights + KV read per step) / "
        "bandwidth vs FLOPs / FLOP/s; `GPU` is the same bytes and FLOPs over the "
        f"`{GPU_PROFILE}` profile's datasheet figures (bf16 weights), at the same batch.", "",
        "| model | context | budget | strategy | KV MB/seq | need MB/seq | fits | × full | ms/step | "
        "tokens/s | gain vs full [95% CI] | TTFT s | peak RSS GB | roofline tok/s (bound) | roofline gain | "
        "GPU gain |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, df in frames.items():
        res = summarize(df)
        label = " (random weights: memory and speed only)" if name == "random" else ""
        for _, r in res.iterrows():
            gain = "—" if r["strategy"] == "full" or not math.isfinite(r.get("gain", float("nan"))) else \
                f"{r['gain']:.2f}× [{_f(r['gain_lo'], '.2f')}, {_f(r['gain_hi'], '.2f')}]"
            fits = _fits(r)
            bound = r['bound'] if isinstance(r.get('bound'), str) else '—'
            strategy = f"{r['strategy']} (at int8's batch)" if r["probe"] else r["strategy"]
            lines.append(
                f"| {r['model']}{label} | {int(r['context']):,} | {r['budget']} ({r['budget_bytes'] / 1e9:.2f} GB) | "
                f"{strategy} | {r['seq_kv_bytes'] / 1e6:.1f} | {r['seq_ws_bytes'] / 1e6:.1f} | {fits} | "
                f"{'—' if r['probe'] else _f(r['capacity_ratio'], '.2f')} | {_f(r.get('ms_per_step'), '.0f')} | "
                f"{_f(r.get('tokens_per_s'), '.1f')} | {gain} | {_f(r.get('ttft_s'), '.1f')} | "
                f"{_f(r.get('peak_rss_bytes', float('nan')) / 1e9, '.2f')} | "
                f"{_f(r.get('roof_tps'), '.1f')} ({bound}) | {_f(r.get('roof_gain'), '.2f')} | "
                f"{_f(r.get('gpu_gain'), '.2f')} |")
    (out / "throughput.md").write_text("\n".join(lines) + "\n")
    plot(frames, out / "throughput.png")
    print("\n".join(lines))


def plot(frames: dict[str, pd.DataFrame], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, m, c, summarize(df)) for name, df in frames.items()
              for (m, c), _ in df.groupby(["model", "context"])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (name, model, context, res) in zip(axes[0], panels, strict=True):
        sub = res[(res["model"] == model) & (res["context"] == context) & ~res["probe"]]
        for label, s in sub.groupby("strategy", sort=False):
            s = s.sort_values("budget_bytes")
            # A row that does not fit its budget serves nothing at it.
            tps = s.get("tokens_per_s", pd.Series(0.0, index=s.index)).where(s["status"] == "fits", 0).fillna(0)
            ax.plot(s["budget_bytes"] / 1e9, tps, marker="o", label=label)
        title = f"{model}, {context:,} tokens" + ("\nrandom weights: memory and speed only" if name == "random" else "")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("memory budget (GB)")
        ax.set_ylabel("decode tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--render-only", action="store_true", help="only render the committed CSVs")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"parts to run: {', '.join(PARTS)}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(PERF))
    ap.add_argument("extra", nargs="*", help="further kvbench throughput overrides for every part")
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        sys.exit(f"bench_throughput: unknown part(s) {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    if not args.render_only:
        for name in parts:
            run_part(name, args.steps, args.repeats, args.extra, Path(args.out))
    where = Path(args.out)
    frames = {n: pd.read_csv(where / f"throughput_{n}.csv") for n in PARTS if (where / f"throughput_{n}.csv").is_file()}
    if not frames:
        sys.exit(f"bench_throughput: no throughput_*.csv in {where} to render; run without --render-only")
    render(frames, Path(args.out))


if __name__ == "__main__":
    main()
