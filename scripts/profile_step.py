"""Where a batched decode step spends its time, per strategy and batch: the measured profile behind the throughput
table's misses (issue 50 item 2: "where a row misses, a measured profile names what the step spends its time on").

    PYTHONPATH=. python scripts/profile_step.py                              # full x 3 and int8 x 5 at 4,096 tokens
    PYTHONPATH=. python scripts/profile_step.py --context 8176 --rows full:2,int8:5 --threads 2

The batch is built as ``kvbench throughput`` builds it (:class:`kvbench.throughput.Bench`, synthetic prefill,
ragged questions, the configuration of ``scripts/bench_throughput.py``: ``linear=upcast``, ``reader=simd``), warmed
up, and then ``--steps`` decode steps are timed with these parts timed inside them (wall time, each counted once
where calls nest):

* ``store``: the layer stores' ``attend`` (the one way attention reads a store: its own work on the step's new
  token — appending, quantizing, concatenating — plus the read below), or ``attend_rows`` where a batch's rows
  attend together;
* ``read``: :func:`kvbench.blockattn.attend` (or ``attend_rows``), the read itself; ``kernel``:
  :func:`kvbench.fused.attend` (or ``attend_rows``), the part of it in the C++ reader;
* ``linear``: the model's linear layers (``engine.linear``'s forward, or ``torch.nn.Linear``'s).

``store - read`` is what a store spends beside the read; ``step - store - linear`` is the model's other per-layer
work (norms, rotary embedding, masks, the MLP's activation) and Python. Rows are stepped in turn (one step of each,
``--steps`` times), so load that comes and goes falls on all alike. Writes ``results/perf/step_profile.md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARTS = ("store", "read", "kernel", "linear")


class Timers:
    """Inclusive wall time per part, counted once where calls of one part nest (a subclass's ``attend`` calling
    its parent's), charged to ``seconds``: the row being stepped points it at its own."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.depth[part] += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[part] -= 1
                if self.depth[part] == 0:
                    self.seconds[part] += time.perf_counter() - t
        return timed


@dataclass
class Row:
    """One batch of the profile: its cache and tokens, its parts' seconds and its steps' times."""

    name: str
    n: int
    cache: Any
    tokens: Any
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: list[float] = field(default_factory=list)


def install(timers: Timers) -> None:
    """Wrap the parts' functions where the engine calls them (module attributes and classes, patched in place)."""
    from kvbench.strategies.base import LayerStore

    from kvbench import blockattn, fused, linear

    fused.attend = timers.wrap("kernel", fused.attend)
    fused.attend_rows = timers.wrap("kernel", fused.attend_rows)
    blockattn.attend = timers.wrap("read", blockattn.attend)
    blockattn.attend_rows = timers.wrap("read", blockattn.attend_rows)
    for cls in (linear._Float32Linear, linear._UpcastLinear):
        cls.__call__ = timers.wrap("linear", cls.__call__)
    torch.nn.Linear.forward = timers.wrap("linear", torch.nn.Linear.forward)
    todo, seen = [LayerStore], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        if "attend" in cls.__dict__:
            cls.attend = timers.wrap("store", cls.__dict__["attend"])
        if "attend_rows" in cls.__dict__:  # a batch's rows attending together (a classmethod)
            cls.attend_rows = classmethod(timers.wrap("store", cls.__dict__["attend_rows"].__func__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", default="full:3,int8:5", help="strategy:batch, comma-separated")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    ap.add_argument("--name", default="step_profile.md", help="file written under --out")
    args = ap.parse_args()

    from kvbench import throughput
    from kvbench.hardware import HardwareProfile
    from kvbench.kernels import cpu_description
    from kvbench.spec import bound_heap_growth

    bound_heap_growth()  # as the CLI does
    torch.set_num_threads(args.threads)
    wanted = [(s, int(n)) for s, n in (item.split(":") for item in args.rows.split(","))]
    names = sorted({s for s, _ in wanted} - {"full"})
    cfg = throughput.compose(["model=smollm2-135m", "prefill=synthetic", f"contexts=[{args.context}]",
                              f"strategies=[{','.join(names)}]", "linear=upcast", "reader=simd",
                              f"hardware.threads={args.threads}"])
    bench = throughput.Bench(cfg, HardwareProfile.from_config(cfg.hardware))
    built, _ = bench.build(throughput.check(cfg), args.context)
    by = {b.strategy.name: b for b in built}
    batches = []
    for name, n in wanted:
        cache, _, _, tokens = bench.batch(by[name], n)
        for _ in range(2):  # warm-up: first steps allocate, flush pending tokens
            tokens = bench.step(cache, by[name].strategy, tokens)
        batches.append(Row(name, n, cache, tokens))
    timers = Timers()
    install(timers)
    load = os.getloadavg()[0]
    for _ in range(args.steps):
        for row in batches:
            timers.seconds = row.seconds  # this step's parts are this row's
            t = time.perf_counter()
            row.tokens = bench.step(row.cache, by[row.name].strategy, row.tokens)
            row.steps.append(time.perf_counter() - t)
    lines = ["# Where a batched decode step spends its time (measured by `scripts/profile_step.py`)", "",
             f"`PYTHONPATH=. python scripts/profile_step.py --context {args.context} --rows {args.rows} --steps "
             f"{args.steps} --threads {args.threads}"
             + (f" --name {args.name}" if args.name != "step_profile.md" else "") + "`;"
             f" SmolLM2-135M in bf16, CPU ({cpu_description()}), "
             f"{args.threads} thread(s), `linear=upcast`, `reader=simd`, synthetic prefill of {args.context:,} "
             f"tokens; load average {load:.1f} at the start. Milliseconds per step (total over the steps / steps; "
             "the step's median beside it); parts are inclusive wall time, each counted once where calls nest.", "",
             "| strategy x batch | step ms (median) | store ms | of which read | of which kernel | store beside "
             "the read | linear ms | rest ms | step ms per sequence |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in batches:
        total = sum(row.steps) / len(row.steps) * 1000
        part = {p: row.seconds[p] / len(row.steps) * 1000 for p in PARTS}
        rest = total - part["store"] - part["linear"]
        lines.append(f"| {row.name} x {row.n} | {total:.1f} ({statistics.median(row.steps) * 1000:.1f}) | "
                     f"{part['store']:.1f} | {part['read']:.1f} | {part['kernel']:.1f} | "
                     f"{part['store'] - part['read']:.1f} | {part['linear']:.1f} | {rest:.1f} | {total / row.n:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
