"""Harness throughput: re-prefilling vs one shared prefill, batch 1 vs batched evaluation, decode cost per strategy.

    python scripts/bench_harness.py                        # legal task, 4,096 tokens, 8 samples, batch 4, S = 7
    python scripts/bench_harness.py --context 512 --samples 2 --batch-size 2 --repeats 1   # a quick check
    python scripts/bench_harness.py --phases --samples 1 --strategies all   # where a sample's time goes
    python scripts/bench_harness.py --before-after --samples 1 --strategies all   # the engine's speed-ups, on/off
    python scripts/bench_harness.py --device cuda --samples 2 --batch-size 2     # on an accelerator

For S strategies on the same samples it times, in one run and in turn within each repeat:

* ``reprefill`` — a fresh full-attention prefill for every (sample, strategy), batch 1;
* ``shared`` — the engine at batch 1: one prefill per sample, every strategy built from its capture;
* ``reprefill_batched`` / ``batched`` — the same two at ``--batch-size`` (``engine.batch_size``): one
  prefill per batch of samples, every strategy's caches for the batch built and decoded together.

``shared`` and ``batched`` run :func:`kvbench.loop.run_samples`; the re-prefill modes call the same
``Engine.evaluate_batch`` after a prefill of their own, so every mode does the same work per evaluation.
Writes ``results/perf/harness.md`` and ``.csv`` files with medians and min/max over repeats: the
shared-prefill speed-up (target >= 0.8 S), sample x strategy evaluations per hour at batch 1 and batched
(target >= 3x), and per-strategy compression seconds and decode ms/token against ``full`` at batch 1
(target <= 1.1x for int8, int4, fp8).

``--phases`` instead times each phase of an evaluation per strategy (cache builds, teacher forcing, question
pass, decode steps, the rest: fidelity and the record), once under ``engine.attention=sdpa`` and once under the
engine's own choice, and writes ``results/perf/harness_phases.md`` and ``.csv``.

``--before-after`` runs the shared-prefill engine (batch 1) twice over the same samples and strategies: once
with the engine's speed-ups off (``engine.attention=sdpa``, ``engine.linear=native``: the model's own kernels)
and once with its choices (``auto``), and compares the records of the two: how many greedy predictions and
scores are equal, and the largest differences in KL and gold-answer NLL (the products are the same; float32 sums
in another order change bf16 roundings of the activations, which a 4K context and 30 layers compound).
Writes ``results/perf/harness_before_after.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from kvbench import strategies as registry
from kvbench.engine import Engine, query_window_for
from kvbench.loop import batches, run_samples
from kvbench.models import load_model
from kvbench.results import atomic_write_text
from kvbench.tasks.base import build_samples

ROOT = Path(__file__).resolve().parents[1]
MODES = ("reprefill", "shared", "reprefill_batched", "batched")


def _task_cfg(task: str, context: int, samples: int) -> object:
    cfg = OmegaConf.load(ROOT / "conf" / "task" / f"{task}.yaml")
    cfg.seed = 0  # the YAML's `${seed}` points at the run's top-level seed, absent outside Hydra
    cfg.context_tokens = context
    cfg.n_samples = samples
    return cfg


def time_mode(mode: str, engine: Engine, samples: list, strats: list, batch_size: int) -> tuple[float, list[dict]]:
    """Seconds for every (sample, strategy) evaluation in ``mode``, and the records written."""
    records: list[dict] = []
    t0 = time.perf_counter()
    size = batch_size if mode.endswith("batched") else 1
    if mode.startswith("reprefill"):
        window = query_window_for(strats)
        for batch in batches(samples, size):
            base: list = [None] * len(batch)
            for i, s in enumerate(strats):
                pre = engine.prefill(batch[0] if len(batch) == 1 else batch, window)
                res = engine.evaluate_batch(s, batch, pre, base)
                base = [r.logp for r in res] if i == 0 else base
                records.extend(r.record for r in res)
    else:
        run_samples(engine, samples, strats, set(), records.extend, batch_size=size)
    return time.perf_counter() - t0, records


class PhaseEngine(Engine):
    """The engine, timing in CPU seconds of this process (a shared machine inflates wall time with the wait for
    a CPU) where an evaluation goes, per strategy: cache builds (``_cache``: the strategy's compression, twice
    per evaluation, as teacher forcing and greedy decoding each get a fresh cache), teacher forcing, the
    question pass and the decode steps of greedy decoding, and the rest of ``evaluate_batch`` (fidelity against
    the baseline, byte accounting, the record)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.phases: dict[str, dict[str, float]] = {}
        self._question: str | None = None  # the strategy whose greedy question pass is the next forward

    def _add(self, strategy: str, phase: str, seconds: float) -> None:
        row = self.phases.setdefault(strategy, {})
        row[phase] = row.get(phase, 0.0) + seconds

    def _cache(self, strategy, row):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        out = super()._cache(strategy, row)
        self._add(strategy.name, "build caches", time.process_time() - c0)
        return out

    def _teacher_force(self, cache, strategy, queries, golds):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        out = super()._teacher_force(cache, strategy, queries, golds)
        self._add(strategy.name, "teacher forcing", time.process_time() - c0)
        return out

    def forward(self, cache, tokens, keep):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        out = super().forward(cache, tokens, keep)
        if self._question is not None:
            self._add(self._question, "question pass", time.process_time() - c0)
            self._question = None
        return out

    def greedy(self, cache, queries, max_new_tokens, stop=None):  # type: ignore[no-untyped-def]
        self._question = cache.strategy.name
        c0 = time.process_time()
        out = super().greedy(cache, queries, max_new_tokens, stop)
        self._add(cache.strategy.name, "greedy", time.process_time() - c0)
        return out

    def evaluate_batch(self, strategy, samples, pre, baseline_logps, chunk_tokens=0,
                       rows=None):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        out = super().evaluate_batch(strategy, samples, pre, baseline_logps, chunk_tokens, rows)
        self._add(strategy.name, "evaluation", time.process_time() - c0)
        return out


def time_phases(lm: object, samples: list, names: list[str], out: Path) -> None:
    """One shared-prefill pass over ``samples`` per attention implementation, every phase timed per strategy;
    writes ``harness_phases.md`` / ``.csv``."""
    from kvbench.config import strategy_params

    frames, walls = [], {}
    for impl in ("sdpa", "auto"):
        engine = PhaseEngine(lm, run_fields={"task": "legal", "model": "smollm2-135m", "hardware": "cpu"},
                             attention=impl)
        engine.warmup()
        strats = [registry.build(n, strategy_params(n)) for n in names]
        records: list[dict] = []
        t0, c0 = time.perf_counter(), time.process_time()
        run_samples(engine, samples, strats, set(), records.extend)
        walls[engine.attention] = (time.perf_counter() - t0, time.process_time() - c0)
        rec = pd.DataFrame(records).groupby("strategy_name").agg(decode_ms=("decode_ms_per_token", "median"))
        ph = pd.DataFrame(engine.phases).T.reindex(names)
        ph["decode steps"] = ph["greedy"] - ph["question pass"]
        ph["rest (fidelity, records)"] = ph["evaluation"] - ph["build caches"] - ph["teacher forcing"] - ph["greedy"]
        ph["wall decode ms/token"] = rec["decode_ms"].reindex(names)
        ph["attention"] = engine.attention
        frames.append(ph.rename_axis("strategy").reset_index())
    df = pd.concat(frames)
    df.to_csv(out / "harness_phases.csv", index=False)
    cols = ["build caches", "teacher forcing", "question pass", "decode steps", "rest (fidelity, records)",
            "evaluation", "wall decode ms/token"]
    lines = ["# Where a sample's time goes (measured by `scripts/bench_harness.py --phases`)", "",
             f"Model smollm2-135m (bfloat16, CPU, {torch.get_num_threads()} threads), {len(samples)} `legal` "
             f"sample(s) of {len(samples[0].prefix_ids)} context tokens, S = {len(names)} strategies at their "
             "defaults, batch 1, the shared prefill once per sample and attention implementation. CPU seconds "
             "of this process, summed over samples (the last column: the records' wall-clock decode latency). "
             "Load average (1 min) at the end: "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.", ""]
    for impl, g in df.groupby("attention", sort=False):
        wall, cpu = walls[impl]
        lines += [f"## engine.attention={impl}: whole run {cpu:.1f} CPU s ({wall:.1f} s wall, prefill included)", "",
                  "| strategy | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for _, r in g.iterrows():
            lines.append(f"| {r['strategy']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
        lines.append("")
    if len(walls) == 2:
        (_, a), (_, b) = walls.values()
        lines.append(f"Whole run with the engine's choice vs SDPA: {b / a:.2f}x the CPU time.")
    atomic_write_text(out / "harness_phases.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def before_after(lm: object, task: str, samples: list, names: list[str], out: Path, device: str) -> None:
    """The engine with its speed-ups off, then on, on the same samples; wall and CPU seconds and record equality
    (``harness_before_after.md`` / ``.csv``)."""
    from kvbench import linear
    from kvbench.config import strategy_params

    runs: dict[str, tuple[float, float, pd.DataFrame, str]] = {}
    for label, attn, lin in (("before", "sdpa", "native"), ("after", "auto", "auto")):
        engine = Engine(lm, device=device, run_fields={"task": task, "model": lm.name, "hardware": device},  # type: ignore[attr-defined]
                        attention=attn, linear=lin)
        engine.warmup()
        strats = [registry.build(n, strategy_params(n)) for n in names]
        records: list[dict] = []
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        run_samples(engine, samples, strats, set(), records.extend)
        runs[label] = (time.perf_counter() - t0, time.process_time() - c0,
                       pd.DataFrame(records).set_index(["sample_id", "strategy_name"]),
                       f"attention={engine.attention}, linear={engine.linear}, load {load:.1f}")
    linear.use(lm.model, "native", device)  # leave the model as loaded
    a, b = runs["before"][2], runs["after"][2].reindex(runs["before"][2].index)
    per = pd.DataFrame({
        "prefill_s_before": a["prefill_s"], "prefill_s_after": b["prefill_s"],
        "decode_ms_before": a["decode_ms_per_token"], "decode_ms_after": b["decode_ms_per_token"],
        "same_prediction": a["prediction"] == b["prediction"], "same_score": a["score"] == b["score"],
        "kl_abs_diff": (a["kl"] - b["kl"]).abs(), "gold_nll_abs_diff": (a["gold_nll"] - b["gold_nll"]).abs(),
    }).reset_index()
    per.to_csv(out / "harness_before_after.csv", index=False)
    (wb, cb, _, nb), (wa, ca, _, na) = runs["before"], runs["after"]
    lines = ["# The engine's speed-ups, off and on (measured by `scripts/bench_harness.py --before-after`)", "",
             f"Model smollm2-135m ({lm.model.dtype}, {device}, {torch.get_num_threads()} threads), "  # type: ignore[attr-defined]
             f"{len(samples)} `{task}` sample(s) of {len(samples[0].prefix_ids)} context tokens, S = {len(names)} "
             "strategies at their defaults, shared prefill, batch 1, one run each, in this order.", "",
             "| run | settings | wall s | CPU s |", "|---|---|---:|---:|",
             f"| before | {nb} | {wb:.1f} | {cb:.1f} |", f"| after | {na} | {wa:.1f} | {ca:.1f} |",
             f"| **after / before** | | **{wa / wb:.2f}x** | {ca / cb:.2f}x |", "",
             f"Shared prefill: {a['prefill_s'].median():.1f} s before, {b['prefill_s'].median():.1f} s after. "
             f"Records: {int(per['same_prediction'].sum())} of {len(per)} greedy predictions equal, "
             f"{int(per['same_score'].sum())} of {len(per)} scores equal; largest |ΔKL| "
             f"{per['kl_abs_diff'].max():.2e}, largest |Δ gold NLL| {per['gold_nll_abs_diff'].max():.2e}.", "",
             "| strategy | decode ms/token before | after | after / before | same prediction |",
             "|---|---:|---:|---:|---|"]
    for name, g in per.groupby("strategy_name", sort=False):
        db, da = g["decode_ms_before"].median(), g["decode_ms_after"].median()
        lines.append(f"| {name} | {db:.1f} | {da:.1f} | {da / db:.2f}x | "
                     f"{int(g['same_prediction'].sum())}/{len(g)} |")
    atomic_write_text(out / "harness_before_after.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def _row(label: str, values: list[float], fmt: str = "{:.1f}") -> str:
    return f"| {label} | {fmt.format(statistics.median(values))} | {fmt.format(min(values))} | " \
           f"{fmt.format(max(values))} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="legal")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--strategies", default="full,int8,int4,fp8,snapkv,streaming_llm,knorm")
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    ap.add_argument("--phases", action="store_true",
                    help="only time each phase per strategy, under SDPA and the engine's attention choice "
                         "(harness_phases.md)")
    ap.add_argument("--before-after", action="store_true",
                    help="only run the engine with its speed-ups off and on and compare (harness_before_after.md)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: cpu)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    names = registry.available() if args.strategies == "all" else \
        [n for n in args.strategies.split(",") if n in registry.available()]
    if names[0] != "full":
        names = ["full"] + [n for n in names if n != "full"]
    strats = [registry.build(n) for n in names]
    lm = load_model("smollm2-135m", dtype=args.dtype, device=args.device)
    samples = build_samples(args.task, _task_cfg(args.task, args.context, args.samples), lm.tokenizer,
                            lm.max_context)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.before_after:
        before_after(lm, args.task, samples, names, out, args.device)
        return
    engine = Engine(lm, device=args.device, run_fields={"task": args.task, "model": lm.name,
                                                        "hardware": args.device})
    if args.phases:
        time_phases(lm, samples, names, out)
        return
    engine.warmup()
    evaluations = len(samples) * len(strats)

    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    recs: list[dict] = []
    for _ in range(args.repeats):
        for mode in MODES:
            s, r = time_mode(mode, engine, samples, strats, args.batch_size)
            seconds[mode].append(s)
            if mode == "shared":
                recs.extend(r)
    speedup = [b / a for a, b in zip(seconds["shared"], seconds["reprefill"], strict=True)]
    speedup_b = [b / a for a, b in zip(seconds["batched"], seconds["reprefill_batched"], strict=True)]
    per_hour = {m: [3600 * evaluations / s for s in seconds[m]] for m in MODES}
    batch_gain = [b / a for a, b in zip(seconds["batched"], seconds["shared"], strict=True)]

    df = pd.DataFrame(recs)
    per = df.groupby("strategy_name").agg(
        compress_s_median=("compress_s", "median"), compress_s_min=("compress_s", "min"),
        compress_s_max=("compress_s", "max"), decode_ms_median=("decode_ms_per_token", "median"),
        decode_ms_min=("decode_ms_per_token", "min"), decode_ms_max=("decode_ms_per_token", "max"),
        prefill_s_median=("prefill_s", "median"), n=("score", "size")).reindex(names)
    per["decode_vs_full"] = per["decode_ms_median"] / per.loc["full", "decode_ms_median"]

    per.reset_index().to_csv(out / "harness_strategies.csv", index=False)
    pd.DataFrame({"repeat": range(1, args.repeats + 1), **{f"{m}_s": seconds[m] for m in MODES},
                  "speedup": speedup, "speedup_batched": speedup_b, "batch_gain": batch_gain,
                  "batch_size": args.batch_size}).to_csv(out / "harness_modes.csv", index=False)
    s_count = len(strats)
    lines = [
        "# Harness speed (measured by `scripts/bench_harness.py`)", "",
        f"Model smollm2-135m ({args.dtype}, {args.device}, {torch.get_num_threads()} threads), task `{args.task}`, "
        f"{args.context} context tokens, {len(samples)} samples, S = {s_count} strategies "
        f"({', '.join(names)}), {args.repeats} repeat(s); batched mode at batch size {args.batch_size}.", "",
        "## Shared prefill and batching", "",
        "| mode | median s | min s | max s |", "|---|---:|---:|---:|",
        _row("re-prefill per strategy (batch 1)", seconds["reprefill"]),
        _row("shared prefill (batch 1)", seconds["shared"]),
        _row(f"re-prefill per strategy, batch {args.batch_size}", seconds["reprefill_batched"]),
        _row(f"shared prefill, batch {args.batch_size}", seconds["batched"]),
        _row("**shared vs re-prefill speed-up, batch 1**", speedup, "{:.2f}x"),
        _row(f"**shared vs re-prefill speed-up, batch {args.batch_size}**", speedup_b, "{:.2f}x"),
        _row(f"**batch {args.batch_size} vs batch 1 speed-up**", batch_gain, "{:.2f}x"), "",
        "| mode | sample x strategy evaluations per hour (median [min, max]) |", "|---|---:|",
        *[f"| {m} | {statistics.median(v):.0f} [{min(v):.0f}, {max(v):.0f}] |" for m, v in per_hour.items()], "",
        f"Targets: shared vs re-prefill >= 0.8 S = {0.8 * s_count:.1f}x (measured "
        f"{statistics.median(speedup):.2f}x at batch 1, {statistics.median(speedup_b):.2f}x at batch "
        f"{args.batch_size}); batched evaluations per hour >= 3x batch 1 (measured "
        f"{statistics.median(batch_gain):.2f}x at batch {args.batch_size}).", "",
        "## Per strategy at batch 1 (medians over samples x repeats, [min, max])", "",
        "| strategy | compress s | decode ms/token | vs full |", "|---|---:|---:|---:|",
    ]
    for name, r in per.iterrows():
        lines.append(f"| {name} | {r.compress_s_median:.4f} [{r.compress_s_min:.4f}, {r.compress_s_max:.4f}] | "
                     f"{r.decode_ms_median:.1f} [{r.decode_ms_min:.1f}, {r.decode_ms_max:.1f}] | "
                     f"{r.decode_vs_full:.2f}x |")
    quant = [n for n in ("int8", "int4", "fp8") if n in per.index]
    if quant:
        lines += ["", "Target: decode <= 1.1x `full` for " + ", ".join(quant) + " (measured " +
                  ", ".join(f"{n} {per.loc[n, 'decode_vs_full']:.2f}x" for n in quant) + ")."]
    atomic_write_text(out / "harness.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
