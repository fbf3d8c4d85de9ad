"""What bounds the fused reader on this machine: time per decode step of one layer, per storage format, in one run.

    PYTHONPATH=. python scripts/bench_reader.py [--reader simd] [--tokens 4096,8192] [--threads 2] [--layers 30]
                                                [--out results/perf]

One layer of SmolLM2-135M's geometry (3 KV heads of 64 channels, 9 query heads, one query token) over a cache of
random keys and values stored as each format holds it (dense bfloat16 as ``full`` does, int8 / KIVI int4 and int2 /
FP8 / 8-bit BFP as their strategies' quantizers give, in 1,024-token pieces as the stores' chunk lists hold them),
read by the chosen kernel (``kvbench.fused``: ``--reader`` as ``engine.reader=auto`` resolves, the first kernel
``fused`` today, or ``simd``, the vector one). Each repeat times every format in turn, so load from other
processes falls on all alike. Per format: the median time of a layer's step (after a warm-up; the minimum beside
it), the bytes the step reads (codes, scales, zero points), the bytes per second that makes against the copy
bandwidth measured at the start, and the time per token and KV head. A reader bound by memory would take time in
proportion to the bytes; one bound by its instructions (decoding a row and its products) takes about the same time
per token whatever the bytes. Written to ``results/perf/reader.md`` and ``reader.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.strategies.base import held_bytes  # noqa: E402

from kvbench import blockattn, fused, kernels  # noqa: E402
from kvbench.hardware_probe import measure_copy_bandwidth  # noqa: E402
from kvbench.quantizers import (  # noqa: E402
    fp8_scale,
    quantize_asymmetric,
    quantize_bfp,
    quantize_fp8,
    quantize_int8,
)
from kvbench.results import atomic_write_text  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM, PIECE = 3, 3, 64, 1024


def formats(ref: torch.Tensor) -> dict:
    """Each format as its strategy's defaults store it: (keys encoder, values encoder)."""
    def kivi(bits: int):  # keys by channel, values by token, groups of 32 (int4 / int2 defaults)
        return (lambda x: quantize_asymmetric(x, bits, 32, "channel"),
                lambda x: quantize_asymmetric(x, bits, 32, "token"))

    return {
        "dense bf16 (full)": (blockattn.Dense, blockattn.Dense),
        "int8": (lambda x: quantize_int8(x, HEAD_DIM, "token"),) * 2,
        "int4 (KIVI)": kivi(4),
        "int2 (KIVI)": kivi(2),
        "fp8 (e4m3, per tensor)": (lambda x: quantize_fp8(x, "e4m3", fp8_scale(ref, "e4m3", "tensor"))[0],) * 2,
        "bfp (8-bit, blocks of 32)": (lambda x: quantize_bfp(x, 8, 32),) * 2,
    }


def run(tokens: int, bandwidth: float, repeats: int, layers: int = 1) -> list[dict]:
    """Per format, ``layers`` layers of random keys and values (the first drawn as before, so ``layers=1`` times
    what it always did); each timed step reads the next layer in turn, so with enough layers every step's store
    comes from memory rather than the caches, as a decode step's does (30 layers of SmolLM2 at 4K: 92 MB in bf16)."""
    g = torch.Generator().manual_seed(tokens)
    k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(2))
    qg = torch.randn(1, KV_HEADS, GROUP, HEAD_DIM, generator=g)
    kvs = [(k, v)] + [tuple(torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g).to(torch.bfloat16)
                            for _ in range(2)) for _ in range(layers - 1)]
    cases = {}
    for name, (enc_k, enc_v) in formats(k).items():
        stack = []
        for lk, lv in kvs:
            runs = [blockattn.TokenRun([enc(x[..., i:i + PIECE, :]) for i in range(0, tokens, PIECE)], KV_HEADS)
                    for enc, x in ((enc_k, lk), (enc_v, lv))]
            stored = held_bytes(t for r in runs for p in r.parts
                                for t in (p.tensors() if hasattr(p, "tensors") else [p.x]))
            stack.append([r.fused() for r in runs])
        cases[name] = (stack, stored)
        fused.attend(qg, *stack[0], None, 1, HEAD_DIM ** -0.5)  # warm-up
    # Every repeat times each format in turn: load from other processes on a shared machine falls on all alike,
    # so the ratios between formats hold within the run even when the absolute times move.
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats):
        for name, (stack, _) in cases.items():
            parts = stack[i % layers]
            t0 = time.perf_counter()
            fused.attend(qg, parts[0], parts[1], None, 1, HEAD_DIM ** -0.5)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, (_, stored) in cases.items():
        med = statistics.median(times[name])
        rows.append({"tokens": tokens, "format": name, "threads": torch.get_num_threads(), "layers": layers,
                     "bytes": stored,
                     "median_ms": 1e3 * med, "min_ms": 1e3 * min(times[name]), "gb_per_s": stored / med / 1e9,
                     "bandwidth_gb_per_s": bandwidth / 1e9, "ns_per_token_head": 1e9 * med / (tokens * KV_HEADS)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reader", default=fused.DEFAULT_READER, choices=[r for r in fused.READERS if r != "blocks"])
    ap.add_argument("--tokens", default="4096,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1,
                    help="layers per format, read in turn (enough of them and each step reads from memory)")
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    args = ap.parse_args()
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: a positive number of layers (1: one layer read again and again)")
    fused.choose(args.reader)
    if not fused.available():
        raise SystemExit("the fused kernel could not be built here (a C++ compiler and ninja are needed)")
    isa = fused._kernel().isa() if args.reader == "simd" else "compiler's choice (-march=native)"
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    bandwidth = measure_copy_bandwidth(256 * 2**20, repeats=5) * 1e9  # GB/s -> bytes/s
    rows = [r for t in args.tokens.split(",") for r in run(int(t), bandwidth, args.repeats, args.layers)]
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "reader.csv", index=False)
    lines = [f"# The `{fused.reader()}` reader per storage format (measured by `scripts/bench_reader.py "
             f"--reader {args.reader}`)", "",
             f"CPU: {kernels.cpu_description()}; the kernel's integer path built for: {isa}. "
             f"One attention layer of SmolLM2-135M's geometry ({KV_HEADS} KV heads x {HEAD_DIM} channels, {GROUP} "
             f"query heads per KV head, one query token)"
             + (f", {args.layers} such layers per format read in turn (each step a different layer's store: read "
                "from memory once the layers outgrow the caches, as in a decode step)" if args.layers > 1 else "")
             + f", CPU, {args.threads} torch threads, {args.repeats} timed "
             f"steps per row after a warm-up, the formats timed in turn within each repeat (one run). Copy bandwidth "
             f"measured at the start: {bandwidth / 1e9:.1f} GB/s; load average (1 min) {load:.1f} at the start and "
             f"{os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} CPUs. `read GB/s` = stored bytes the step "
             "reads / its median time.", "",
             "| tokens | format | stored KB | median ms [min] | read GB/s | vs copy bandwidth | "
             "ns per token and KV head |",
             "|---:|---|---:|---|---:|---:|---:|"]
    for r in df.itertuples():
        lines.append(f"| {r.tokens:,} | {r.format} | {r.bytes / 1024:,.0f} | {r.median_ms:.3f} [{r.min_ms:.3f}] | "
                     f"{r.gb_per_s:.1f} | {r.gb_per_s / r.bandwidth_gb_per_s:.2f} | {r.ns_per_token_head:.1f} |")
    atomic_write_text(out / "reader.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
