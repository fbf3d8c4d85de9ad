"""``engine.linear=upcast``'s few-row product (``kvbench/linear_rows.cpp``) against another version of its source,
in one run: the decode step's linear layers, whose cost a batch of sequences shares.

    PYTHONPATH=. python scripts/bench_linear.py --against 13a0b75 [--threads 1,2] [--out results/perf]

Each of SmolLM2-135M's weight shapes (bf16, random) is multiplied by 1 to 16 rows of float32 input, by the kernel
built from this checkout's source and by the one built from ``git show REV:kvbench/linear_rows.cpp`` (both with the
flags and the cache of :mod:`kvbench.kernels`). Each repeat times both in turn, so load from other processes falls
on both alike; per (threads, shape, rows): the median over the repeats of the time per product, GFLOP/s and the
weight's bytes per second, and the ratio new / base. The outputs of the two builds are compared bit for bit (the
kernel's order of sums is part of ``upcast``'s run identity): a difference stops the benchmark. The model's rows
sum its 30 layers' products and its head, as one decode step runs them. The copy bandwidth of the machine is
measured at the start. Written to ``results/perf/linear.md`` and ``linear.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench import fused, kernels, linear  # noqa: E402
from kvbench.hardware_probe import measure_copy_bandwidth  # noqa: E402
from kvbench.results import atomic_write_text  # noqa: E402

#: SmolLM2-135M's linear layers per decoder layer (out, in), and its head; 30 layers.
LAYER_SHAPES = {"q, o": ((576, 576), 2), "k, v": ((192, 576), 2), "gate, up": ((1536, 576), 2),
                "down": ((576, 1536), 1)}
HEAD, LAYERS = (49152, 576), 30


def base_kernel(rev: str):
    """``linear_rows.cpp`` as of ``rev``, built under another module name (its own cache entry)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kvbench/linear_rows.cpp"], check=True,
                          capture_output=True, text=True).stdout
    src = Path(tempfile.mkdtemp()) / "linear_rows_base.cpp"
    src.write_text(text)
    mod = kernels.load("kvbench_linear_rows_base", [src], fused.FLAGS, ["-fopenmp"])
    if mod is None:
        sys.exit(f"bench_linear: the source of {rev} could not be built")
    return mod


def timed(mod, x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    mod.linear_rows(x, w, None)
    t = time.perf_counter()
    for _ in range(reps):
        mod.linear_rows(x, w, None)
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision whose linear_rows.cpp is the base")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,6,8,12,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="results/perf")
    args = ap.parse_args()
    new = linear.rows_kernel()
    if new is None:
        sys.exit("bench_linear: kvbench/linear_rows.cpp could not be built (or KVBENCH_FUSED=0)")
    base = base_kernel(args.against)
    bandwidth = measure_copy_bandwidth(256 * 2**20, repeats=5)  # GB/s
    load0 = os.getloadavg()[0]
    torch.manual_seed(0)
    shapes = {name: (torch.randn(*shape).to(torch.bfloat16), n) for name, (shape, n) in LAYER_SHAPES.items()}
    shapes["head"] = (torch.randn(*HEAD).to(torch.bfloat16), 0)
    rows_list = [int(r) for r in args.rows.split(",")]
    records = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in rows_list:
            x = torch.randn(rows, 1536)
            times: dict[tuple[str, str], list[float]] = {}
            for name, (w, _) in shapes.items():
                xi = x[:, :w.shape[1]].contiguous()
                if not torch.equal(new.linear_rows(xi, w, None), base.linear_rows(xi, w, None)):
                    sys.exit(f"bench_linear: the two builds differ on {name} x {rows} rows: another order of sums")
                reps = max(3, int(2e7 / w.numel()))
                for _ in range(args.repeats):
                    for tag, mod in (("base", base), ("new", new)):
                        times.setdefault((name, tag), []).append(timed(mod, xi, w, reps))
            for name, (w, _) in shapes.items():
                rec = {"threads": threads, "rows": rows, "weight": name, "shape": f"{w.shape[0]}x{w.shape[1]}"}
                for tag in ("base", "new"):
                    rec[f"{tag}_us"] = statistics.median(times[(name, tag)]) * 1e6
                records.append(rec)
            step = {"threads": threads, "rows": rows, "weight": f"model ({LAYERS} layers + head)", "shape": ""}
            for tag in ("base", "new"):
                step[f"{tag}_us"] = sum(statistics.median(times[(name, tag)]) * 1e6 * (LAYERS * n if n else 1)
                                        for name, (_, n) in shapes.items())
            records.append(step)
    df = pd.DataFrame(records)
    macs = {name: w.numel() for name, (w, _) in shapes.items()}
    macs_model = sum(w.numel() * (LAYERS * n if n else 1) for w, n in shapes.values())
    df["macs"] = [macs.get(w, macs_model) for w in df["weight"]]
    df["new / base"] = df["new_us"] / df["base_us"]
    df["new GFLOP/s"] = 2 * df["macs"] * df["rows"] / df["new_us"] / 1e3
    df["base GFLOP/s"] = 2 * df["macs"] * df["rows"] / df["base_us"] / 1e3
    df["new weight GB/s"] = 2 * df["macs"] / df["new_us"] / 1e3
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "linear.csv", index=False)
    cmd = "PYTHONPATH=. python scripts/bench_linear.py " + " ".join(sys.argv[1:])
    view = df[["threads", "rows", "weight", "shape", "base_us", "new_us", "new / base", "base GFLOP/s",
               "new GFLOP/s", "new weight GB/s"]]
    text = (f"# The few-row linear kernel against {args.against}'s (measured by `scripts/bench_linear.py`)\n\n"
            f"`{cmd}`; {kernels.cpu_description()}; copy bandwidth {bandwidth:.1f} GB/s at the start; load "
            f"average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. Medians of {args.repeats} "
            "repeats, the two builds timed in turn; their outputs are bit-identical for every shape and row count "
            "(checked, else no table). Microseconds per product. A product is repeated, so its weight is read from "
            "the caches, except the head's (57 MB); the model's rows add its 30 layers' products and its head (one "
            "decode step's linear work at that batch, with the layers' weights in cache: a step reads them from "
            "memory, `scripts/profile_step.py` times that).\n\n"
            + view.to_markdown(index=False, floatfmt=".2f") + "\n")
    atomic_write_text(out / "linear.md", text)
    print(text)


if __name__ == "__main__":
    main()
