"""Process memory per phase of one benchmark sample, in a fresh process (issue 41, item 3).

    PYTHONPATH=. python scripts/bench_phases.py                       # 4,096 tokens: full, int8, snapkv, h2o
    PYTHONPATH=. python scripts/bench_phases.py --context 8192 --strategies full,int8 --out /tmp/phases

A worker process (fresh, so nothing earlier hides a phase's peak) runs the phases of one sample in the engine's
order and reports, per phase, the peak RSS (sampled every 2 ms, :class:`kvbench.spec.PeakMemory`), the RSS after
it, and the peak bytes of the tensors the phase allocated and held at once (:class:`kvbench.footprint.LiveBytes`),
next to the sizes that explain them (weights, float32 linear copies, the captured K/V and queries, each cache's
stored and scratch bytes):

* **imports** — torch, transformers, kvbench and the strategies;
* **model load** — the embedded model in bf16 (``load_model``);
* **engine** — ``engine.linear`` (float32 copies of the 16-bit linear weights, :mod:`kvbench.linear`) and warm-up;
* **prefill** — the shared full-attention capture of the context (K/V of every layer, the queries the strategies
  ask for);
* **compression** and **decode**, per strategy — its cache built from the capture, then an 8-token question and 8
  greedy tokens (the decode peak includes the cache).

A second worker runs the same sample ``--samples`` times in one process (every strategy on each) and reports
the RSS after each, to show whether the process grows from sample to sample. Writes
``<out>/memory_phases.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def worker(context: int, names: list[str], samples: int) -> dict:
    import gc

    from kvbench.footprint import LiveBytes
    from kvbench.spec import PeakMemory, bound_heap_growth, release_freed_memory

    bound_heap_growth()  # as the CLI does: what a kvbench run holds
    phases: list[dict] = []
    before = _rss()

    def phase(name: str, fn, note: str = "", track: bool = True):  # noqa: ANN001, ANN202
        nonlocal before
        release_freed_memory()  # what earlier phases freed is not this phase's (PeakMemory trims too)
        before = _rss()
        live = LiveBytes() if track else None
        with PeakMemory("cpu") as peak:
            if live is not None:
                with live:
                    out = fn()
            else:
                out = fn()
        after = _rss()
        phases.append({"phase": name, "rss_before": before, "peak_rss": peak.peak_bytes, "rss_after": after,
                       "tensor_peak": live.peak if live is not None else None, "note": note})
        before = after
        return out

    def imports() -> None:
        from kvbench import (  # noqa: F401
            engine,
            models,
            strategies,  # noqa: F401
        )

    phase("imports", imports, "transformers, kvbench, strategies (torch was loaded before)", track=False)
    import torch

    from kvbench import strategies as registry
    from kvbench.engine import Engine, attached, query_window_for
    from kvbench.footprint import unique_bytes, weight_bytes
    from kvbench.models import load_model

    lm = phase("model load", lambda: load_model("smollm2-135m", dtype="bfloat16"), track=False)
    params = unique_bytes([*lm.model.parameters(), *lm.model.buffers()])
    phases[-1]["note"] = f"weights {params / MIB:.0f} MiB (bf16)"

    def make_engine() -> Engine:
        e = Engine(lm)
        e.warmup()
        return e

    engine = phase("engine (linear copies, warm-up)", make_engine)
    copies = weight_bytes(lm.model) - params
    phases[-1]["note"] = f"engine.linear={engine.linear}: float32 copies {copies / MIB:.0f} MiB"
    built = [registry.build(n, {}) for n in names]
    window = query_window_for(built)
    ids = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    pre = phase(f"prefill ({context} tokens)", lambda: engine.capture(torch.tensor([ids]), window))
    kv = unique_bytes(pre.keys + pre.values)
    q = unique_bytes(c.queries for c in pre.captures)
    phases[-1]["note"] = (f"captured K/V {kv / MIB:.0f} MiB, queries {q / MIB:.0f} MiB "
                          f"(query window {'all' if window is None else window})")
    question = torch.randint(100, 40000, (8,), generator=torch.Generator().manual_seed(1))
    for s in built:
        engine.bind(s, ids)
        cache = phase(f"compression: {s.name}", lambda s=s: engine._cache(s, pre.rows[0])[0])
        phases[-1]["note"] = (f"stored {cache.kv_bytes() / MIB:.1f} MiB, scratch {cache.scratch_bytes() / MIB:.1f} MiB")

        def decode(cache=cache, s=s) -> None:  # noqa: ANN001
            with torch.inference_mode(), attached(cache, engine.model, s):
                engine.greedy(cache, question, 8)

        phase(f"decode: {s.name}", decode, "8-token question, 8 greedy tokens")
        del cache
        gc.collect()
    growth = []
    for i in range(samples - 1):
        ids = torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(2 + i)).tolist()
        again = engine.capture(torch.tensor([ids]), window)
        for s in built:
            engine.bind(s, ids)
            cache = engine._cache(s, again.rows[0])[0]
            with torch.inference_mode(), attached(cache, engine.model, s):
                engine.greedy(cache, question, 8)
            del cache
        del again
        gc.collect()
        release_freed_memory()
        growth.append(_rss())
    return {"phases": phases, "growth": growth}


def write(result: dict, args: argparse.Namespace, out: Path) -> None:
    import pandas as pd

    df = pd.DataFrame(result["phases"])
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "memory_phases.csv", index=False)
    peak = int(df["peak_rss"].max())
    lines = [
        "# Process memory per phase, one sample in a fresh process (measured by `scripts/bench_phases.py`)", "",
        f"SmolLM2-135M-Instruct, bf16, CPU, {args.context:,} context tokens, strategies {args.strategies}. "
        "Command: `PYTHONPATH=. python scripts/bench_phases.py " + " ".join(sys.argv[1:]) + "`. "
        "Peak RSS sampled every 2 ms (the phase's own peak; the process's own lifetime peak is the largest). "
        "'tensor peak' is the most bytes of tensors the phase allocated and held at once (ATen outputs, tracked "
        "op by op; a kernel's internal workspace is not seen). Sizes, not times, are the point. Load average "
        f"(1 min) at the end: {os.getloadavg()[0]:.1f}.", "",
        f"**Process peak: {peak / MIB:,.0f} MiB ({peak / 1e9:.2f} GB).**", "",
        "| phase | RSS before MiB | peak RSS MiB | RSS after MiB | tensor peak MiB | what it holds |",
        "|---|---:|---:|---:|---:|---|"]
    for r in result["phases"]:
        t = r["tensor_peak"]
        tp = "" if t is None or t != t else f"{t / MIB:,.1f}"
        lines.append(f"| {r['phase']} | {r['rss_before'] / MIB:,.0f} | {r['peak_rss'] / MIB:,.0f} | "
                     f"{r['rss_after'] / MIB:,.0f} | {tp} | {r['note']} |")
    if result["growth"]:
        lines += ["", "RSS after each further sample in the same process (every strategy on each): "
                  + ", ".join(f"{g / MIB:,.0f}" for g in result["growth"]) + " MiB."]
    (out / "memory_phases.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--strategies", default="full,int8,snapkv,h2o")
    ap.add_argument("--samples", type=int, default=3, help="samples in the growth check (1: none)")
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = [n for n in args.strategies.split(",") if n]
    if args.worker:
        print(json.dumps(worker(args.context, names, args.samples)))
        return
    proc = subprocess.run([sys.executable, __file__, "--worker", "--context", str(args.context), "--strategies",
                           ",".join(names), "--samples", str(args.samples)], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    if proc.returncode:
        sys.exit(f"bench_phases: the worker failed:\n{proc.stderr[-4000:]}")
    write(json.loads(proc.stdout.strip().splitlines()[-1]), args, Path(args.out))


if __name__ == "__main__":
    main()
