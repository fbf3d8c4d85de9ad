"""Decode speed side by side, in one run: bare transformers vs kvbench ``full`` vs every strategy, per context
length and dtype, against the memory-bandwidth limit (issue 23).

    python scripts/bench_decode.py                                  # 4K and 1K, bf16 and float32, 16 steps
    python scripts/bench_decode.py --contexts 1024,4096,8192 --steps 16
    python scripts/bench_decode.py --contexts 512 --steps 3 --strategies full,int4 --out /tmp/perf   # a quick check

Per dtype the embedded model is loaded once; per context length one sample of the ``legal`` task is prefilled
once (the engine's shared capture) and every row decodes from that same prefill:

* ``bare transformers (sdpa)`` — a transformers ``DynamicCache`` holding the captured K/V, SDPA attention:
  the model's own runtime, no kvbench code in the step;
* ``bare transformers (kvbench attention)`` — the same with ``attn_implementation="kvbench"``;
* ``full (sdpa)`` / ``full (kvbench attention)`` — kvbench's ``full`` store under each attention;
* every strategy at its defaults (``strategy=<name>``), under the engine's own choice (``engine.attention=auto``);
* ``model GEMVs alone (floor)`` — only the model's ``nn.Linear`` layers on one row each, no attention or cache:
  what the model's own matrix-vector products cost on this machine, a floor under every other row.

Each row feeds the question, then ``--steps`` greedy tokens (EOS does not stop it, so every row times the same
number of steps), and reports the median milliseconds of the decode steps. The rows take their steps in turn
(round robin, every cache held at once), so load that comes and goes on a shared machine falls on all rows
alike; ``--threads`` defaults to 1 for the same reason (two threads on an oversubscribed machine mostly wait
for each other). ``physical limit`` is
``(weight bytes + K/V bytes of the full cache) / memory bandwidth``: every weight and every cached byte is read
once per step, at the copy bandwidth :func:`kvbench.hardware_probe.measure_copy_bandwidth` measures at the start of
the run. The machine may be shared: ratios between rows of one run are the result; the load average at start
and end is printed with them, and every step is also timed in CPU seconds of the process, which a busy machine
inflates far less than wall time. Writes ``results/perf/decode.md`` and ``decode.csv`` after every (dtype,
context), so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from kvbench.strategies.base import held_bytes
from omegaconf import OmegaConf
from transformers import DynamicCache

from kvbench import attention, fused
from kvbench import strategies as registry
from kvbench.attention import NAME
from kvbench.config import strategy_params
from kvbench.engine import Engine, attached, query_window_for
from kvbench.hardware_probe import measure_copy_bandwidth
from kvbench.kernels import cpu_description
from kvbench.models import load_model
from kvbench.results import atomic_write_text
from kvbench.tasks.base import build_samples
from kvbench.workingset import WorkingSet

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
READERS = {"fused": "fused C++ reader (`kvbench/fused_attend.cpp`)",
           "fused-simd": "vector reader (`kvbench/fused_simd.cpp`, `engine.reader=simd`)",
           "blocks": "PyTorch block reader (`kvbench/blockattn.py`; no compiler, or KVBENCH_FUSED=0)"}
# Decode time vs `full` at 4K, issue 41's targets.
ISSUE41 = {"int8": 1.15, "int4": 1.3, "int2": 1.3, "fp8": 1.3, "bfp": 1.3, "quant_recompute": 1.3}


def _task_cfg(context: int) -> Any:
    cfg = OmegaConf.load(ROOT / "conf" / "task" / "legal.yaml")
    cfg.seed = 0  # the YAML's `${seed}` points at the run's top-level seed, absent outside Hydra
    cfg.context_tokens = context
    cfg.n_samples = 1
    return cfg


@dataclass
class Row:
    """One decoder of the comparison: its attention, a step function over its own cache, and what it measured."""

    name: str
    kind: str  # bare | full | strategy
    attention: str
    step: Callable[[list[int]], torch.Tensor]
    scope: Callable[[], AbstractContextManager[Any]] = nullcontext
    kv_bytes: int = 0
    compress_s: float = float("nan")
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    close: Callable[[], None] = lambda: None
    cache: Any = None  # a kvbench row's cache, whose decode working set is measured (kvbench.workingset)
    working_set_bytes: float = float("nan")


def bare_row(engine: Engine, pre: Any, impl: str) -> Row:
    """Plain transformers: a ``DynamicCache`` holding the captured K/V, attention ``impl``."""
    model = engine.model
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(pre.keys, pre.values, strict=True)):
        cache.update(k, v, i)  # held, not copied; the first step's concatenation makes new tensors

    def step(tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=engine.device)
        return model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits

    return Row(f"bare transformers ({impl})", "bare", impl, step, kv_bytes=held_bytes([*pre.keys, *pre.values]))


def gemv_floor_row(engine: Engine) -> Row:
    """The model's own single-row GEMVs and nothing else: every ``nn.Linear`` of the model (projections, MLPs,
    LM head), in module order, applied to one row in the model dtype with its own weights. No attention, cache,
    norm or activation: a lower bound on any decode step of this model on this machine, whatever the cache."""
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = linears[0].weight.dtype
    rows = {n: torch.randn(1, n, generator=gen).to(engine.device, dtype) for n in {m.in_features for m in linears}}

    def step(tokens: list[int]) -> torch.Tensor:
        out = torch.empty(0)
        for m in linears:
            out = torch.nn.functional.linear(rows[m.in_features], m.weight, m.bias)
        return out[None]  # the LM head's row, shaped like logits

    return Row("model GEMVs alone (floor)", "floor", NAME, step)  # attention unused: the step has none


def kvbench_row(engine: Engine, name: str, kind: str, strategy: Any, sample: Any, pre: Any, impl: str) -> Row:
    """A strategy's cache built from the capture as the engine builds it, stepped by ``Engine.forward``."""
    engine.bind(strategy, sample.prefix_ids)
    with torch.inference_mode():
        cache, compress_s = engine._cache(strategy, pre.rows[0])

    def close() -> None:  # tiered spill files go now, not at garbage collection
        for layer in cache.layers:
            getattr(layer.store, "close", lambda: None)()

    return Row(name, kind, impl, lambda t: engine.forward(cache, [t], 1),
               lambda: attached(cache, engine.model, strategy), cache.kv_bytes(), compress_s, close=close,
               cache=cache)


def decode_round_robin(engine: Engine, rows: list[Row], query: list[int], steps: int) -> None:
    """The question pass of every row, then ``steps`` greedy steps, one step of each row in turn: on a shared
    machine, load that comes and goes falls on every row alike. Only the step itself is timed. The first decode
    step of a kvbench row measures its working set (:class:`kvbench.workingset.WorkingSet`) and is not timed."""
    with torch.inference_mode():
        for k in range(steps + 2):
            for row in rows:
                attention.use(engine.model, row.attention, engine.device)
                with row.scope():
                    if k == 1 and row.cache is not None:
                        with WorkingSet(engine.model, row.cache, engine.device) as ws:
                            logits = row.step([row.tokens[-1]])
                        row.tokens.append(int(logits[0, -1].argmax()))
                        row.working_set_bytes = ws.bytes
                        continue
                    t0, c0 = time.perf_counter(), time.process_time()
                    logits = row.step(query if k == 0 else [row.tokens[-1]])
                    row.tokens.append(int(logits[0, -1].argmax()))
                    if k > 1 or (k == 1 and row.cache is None):
                        row.seconds.append(time.perf_counter() - t0)
                        row.cpu_seconds.append(time.process_time() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,1024", help="comma-separated context lengths in tokens")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per row")
    ap.add_argument("--strategies", default="all", help="comma-separated names, or all (the registry)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared, oversubscribed machine two threads mostly wait on each "
                         "other)")
    ap.add_argument("--reader", default="auto", choices=fused.CHOICES,
                    help="what reads a stored cache under kvbench attention (engine.reader, kvbench/fused.py)")
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    ap.add_argument("--tag", default="", help="suffix of the output names: decode<tag>.md, decode<tag>.csv")
    args = ap.parse_args()

    names = registry.available() if args.strategies == "all" else args.strategies.split(",")
    unknown = sorted(set(names) - set(registry.available()))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; valid: {', '.join(registry.available())}")
    torch.set_num_threads(args.threads)
    fused.choose(args.reader)
    load_start = os.getloadavg()
    bandwidth = measure_copy_bandwidth(256 * 2**20, repeats=5)
    auto = attention.resolve("auto", "cpu")
    cpu = cpu_description()  # the ratios are this machine's (a slow bf16 SDPA call, or AMX, moves them)
    records: list[dict[str, Any]] = []
    weights: dict[str, int] = {}  # per dtype: every section's limit uses its own
    for dtype in args.dtypes.split(","):
        lm = load_model("smollm2-135m", dtype=dtype)
        engine = Engine(lm)  # engine.attention=auto
        engine.warmup()
        weights[dtype] = held_bytes(lm.model.parameters())
        for context in [int(c) for c in args.contexts.split(",")]:
            sample = build_samples("legal", _task_cfg(context), lm.tokenizer, lm.max_context)[0]
            strats = [registry.build(n, strategy_params(n)) for n in names]
            with torch.inference_mode():
                pre = engine.capture(torch.tensor([sample.prefix_ids]), query_window_for(strats))
            rows = [bare_row(engine, pre, "sdpa"), bare_row(engine, pre, NAME), gemv_floor_row(engine)]
            rows += [kvbench_row(engine, f"full ({impl})", "full", registry.build("full"), sample, pre, impl)
                     for impl in ("sdpa", NAME)]
            rows += [kvbench_row(engine, n, "strategy", s, sample, pre, auto)
                     for n, s in zip(names, strats, strict=True) if n != "full"]  # `full (kvbench)` is that row
            decode_round_robin(engine, rows, list(sample.query_ids), args.steps)
            limit_ms = 1000 * (weights[dtype] + rows[0].kv_bytes) / (bandwidth * GB)
            for row in rows:
                records.append({"dtype": dtype, "context": context, "threads": torch.get_num_threads(),
                                "row": row.name, "kind": row.kind, "attention": row.attention,
                                "kv_bytes": row.kv_bytes, "working_set_bytes": row.working_set_bytes,
                                "compress_s": row.compress_s, "seconds": row.seconds,
                                "cpu_seconds": row.cpu_seconds,
                                "tokens_equal": row.tokens == rows[0].tokens, "limit_ms": limit_ms,
                                "reader": fused.reader(), "cpu": cpu})
                row.close()
            print(f"{dtype} {context}: done", flush=True)
            del pre, rows
            gc.collect()
            # Written after every (dtype, context): an interrupted run keeps what it measured.
            write(records, args, bandwidth, weights, load_start, os.getloadavg())


def write(rows: list[dict[str, Any]], args: argparse.Namespace, bandwidth: float, weights: dict[str, int],
          load_start: tuple[float, ...], load_end: tuple[float, ...]) -> None:
    df = pd.DataFrame(rows)
    for col, src in (("ms", "seconds"), ("cpu_ms", "cpu_seconds")):
        df[f"{col}_median"] = [1000 * statistics.median(s) for s in df[src]]
        df[f"{col}_min"] = [1000 * min(s) for s in df[src]]
        df[f"{col}_max"] = [1000 * max(s) for s in df[src]]
    key = ["dtype", "context"]
    for col in ("ms", "cpu_ms"):
        bare = df[df.row == "bare transformers (sdpa)"].set_index(key)[f"{col}_median"]
        full = df[(df.kind == "full") & (df.attention == NAME)].set_index(key)[f"{col}_median"]
        at = list(zip(df.dtype, df.context, strict=True))
        df[f"{col}_vs_bare_sdpa"] = [m / bare[k] for m, k in zip(df[f"{col}_median"], at, strict=True)]
        df[f"{col}_vs_full"] = [m / full[k] for m, k in zip(df[f"{col}_median"], at, strict=True)]
        df[f"{col}_vs_limit"] = df[f"{col}_median"] / df.limit_ms
    full_ws = df[(df.kind == "full") & (df.attention == NAME)].set_index(key)["working_set_bytes"]
    df["working_set_vs_full"] = [w / full_ws[k] for w, k in
                                 zip(df.working_set_bytes, zip(df.dtype, df.context, strict=True), strict=True)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["seconds", "cpu_seconds"]).to_csv(out / f"decode{args.tag}.csv", index=False)

    lines = [
        "# Decode speed (measured by `scripts/bench_decode.py`)", "",
        f"SmolLM2-135M, CPU ({rows[0]['cpu']}), {rows[0]['threads']} torch thread(s), one `legal` sample per "
        "context length, "
        f"{args.steps} timed decode steps per row after the question pass, rows stepped in turn. Memory copy "
        f"bandwidth measured at the start: {bandwidth:.1f} GB/s; weights "
        f"{', '.join(f'{w / 1e6:.0f} MB in {d}' for d, w in weights.items())}. Load average "
        f"(1 min) {load_start[0]:.1f} at the start and {load_end[0]:.1f} at the end on {os.cpu_count()} CPUs. "
        "On a shared machine wall time mostly measures the wait for a CPU, so each step is also timed in CPU "
        "seconds of this process (`cpu ms`, median; the ratios use it); wall medians [min, max] are listed "
        "beside it. `physical limit` = (weight bytes + `full` K/V bytes) / bandwidth per step. `tokens = bare`: "
        "the greedy tokens equal bare transformers' with SDPA. Strategies run under `engine.attention=auto`. "
        "`working set`: the bytes the cache, its scratch and attention's temporaries held at the peak of the first "
        "decode step, measured while it ran (`kvbench.workingset`; that step is not timed). Short queries under "
        f"kvbench attention were read by the {READERS[rows[0]['reader']]}, for `full` as for every compressed "
        "store.", "",
    ]
    for (dtype, context), g in df.groupby(key, sort=False):
        lines += [f"## {dtype}, {context} tokens (physical limit {g.limit_ms.iloc[0]:.1f} ms/token)", "",
                  "| row | cpu ms/token | vs bare sdpa | vs full | vs limit | wall ms/token | kv MB | "
                  "working set MB | working set vs full | tokens = bare |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
        for r in g.itertuples():
            lines.append(f"| {r.row} | {r.cpu_ms_median:.1f} | {r.cpu_ms_vs_bare_sdpa:.2f}x | "
                         f"{r.cpu_ms_vs_full:.2f}x | {r.cpu_ms_vs_limit:.1f}x | "
                         f"{r.ms_median:.1f} [{r.ms_min:.1f}, {r.ms_max:.1f}] | "
                         f"{r.kv_bytes / 1e6:.1f} | "
                         + ("n/a | n/a | " if r.working_set_bytes != r.working_set_bytes else
                            f"{r.working_set_bytes / 1e6:.1f} | {r.working_set_vs_full:.2f}x | ") +
                         f"{'n/a' if r.kind == 'floor' else 'yes' if r.tokens_equal else 'no'} |")
        lines.append("")
    lines += ["## Targets (issue 23), in CPU time", ""]
    for (dtype, context), g in df.groupby(key, sort=False):
        full = g[(g.kind == "full") & (g.attention == NAME)].iloc[0]
        part = [f"{dtype} {context}: `full` {full.cpu_ms_vs_bare_sdpa:.2f}x bare SDPA (target <= 0.5x at 4K), "
                f"{full.cpu_ms_vs_limit:.1f}x the limit (target <= 3x)"]
        for name in ("tiered", "quant_recompute"):
            hit = g[g.row == name]
            if len(hit):
                part.append(f"{name} {hit.cpu_ms_vs_full.iloc[0]:.2f}x `full` (target <= 1.2x)")
        for name, target in ISSUE41.items():
            hit = g[g.row == name]
            if len(hit):
                part.append(f"{name} {hit.cpu_ms_vs_full.iloc[0]:.2f}x `full` (issue 41: <= {target}x)")
        floor = g[g.kind == "floor"].iloc[0]
        part.append(f"the model's GEMVs alone {floor.cpu_ms_vs_limit:.1f}x the limit ({floor.ms_vs_limit:.1f}x in "
                    f"wall time; `full` {full.ms_vs_limit:.1f}x)")
        lines.append("* " + "; ".join(part) + ".")
    atomic_write_text(out / f"decode{args.tag}.md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
