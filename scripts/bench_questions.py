"""Independent questions per CPU-hour: one question per prefill (spec v1.1) vs several questions per context.

    python scripts/bench_questions.py                       # legal, 4,096 tokens, full + int8/fp8/bfp, K = 8
    python scripts/bench_questions.py --context 1024 --questions 4 --single 2   # a quick check

In one run, on the same task, model and strategies, it times :func:`kvbench.loop.run_samples` in turn for:

* ``single`` — the v1.1 path: ``task.questions_per_context=1`` and no early stop (decoding runs to
  ``max_new_tokens`` or EOS), one prefill and one compression per question;
* ``single_stop`` — the same samples with decoding stopped once the score is settled or the line ends
  (:meth:`kvbench.engine.Engine._stop_for`);
* ``multi`` — ``task.questions_per_context=K`` with the stop: one prefill and one compression per context,
  each question answered from its own copy of the compressed cache.

It reports questions per hour (a question = one paired comparison of every strategy against ``full``), the
mean tokens generated, and the ratio against ``single``; ``multi`` also reports the baseline accuracy so a K
that makes the task harder for the model is visible. Writes ``results/perf/questions.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from kvbench import strategies as registry
from kvbench.engine import Engine
from kvbench.loop import run_samples
from kvbench.models import load_model
from kvbench.results import atomic_write_text
from kvbench.tasks.base import build_samples

ROOT = Path(__file__).resolve().parents[1]


def _samples(lm, task: str, context: int, n: int, k: int, stop: bool) -> list:
    cfg = OmegaConf.load(ROOT / "conf" / "task" / f"{task}.yaml")
    cfg.seed, cfg.context_tokens, cfg.n_samples = 0, context, n
    cfg.query_aware, cfg.questions_per_context, cfg.stop_at_newline = False, k, stop
    return build_samples(task, cfg, lm.tokenizer, lm.max_context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="legal")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--questions", type=int, default=8, help="K, questions per context in the multi mode")
    ap.add_argument("--contexts", type=int, default=1, help="contexts in the multi mode")
    ap.add_argument("--single", type=int, default=4, help="questions (= prefills) in each single mode")
    ap.add_argument("--strategies", default="int8,fp8,bfp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "perf"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2-135m", dtype="bfloat16")
    engine = Engine(lm, run_fields={"task": args.task})
    engine.warmup()
    strats = [registry.build("full")] + [registry.build(n) for n in args.strategies.split(",")]
    modes = {
        "single": _samples(lm, args.task, args.context, args.single, 1, False),  # decoded with no early stop
        "single_stop": _samples(lm, args.task, args.context, args.single, 1, True),
        "multi": _samples(lm, args.task, args.context, args.contexts, args.questions, True),
    }
    rows = []
    for mode, samples in modes.items():
        records: list[dict] = []
        stop_for = engine._stop_for
        if mode == "single":  # the v1.1 engine: decoding runs to max_new_tokens or EOS
            engine._stop_for = lambda sample: None  # type: ignore[method-assign]
        t0 = time.perf_counter()
        run_samples(engine, samples, strats, set(), records.extend)
        seconds = time.perf_counter() - t0
        engine._stop_for = stop_for  # type: ignore[method-assign]
        base = [r for r in records if r["strategy_name"] == "full"]
        rows.append({
            "mode": mode, "questions": len(samples), "prefills": len({r["context_id"] for r in base}),
            "seconds": round(seconds, 1), "questions_per_hour": round(3600 * len(samples) / seconds, 1),
            "mean_generated_tokens": round(sum(r["generated_tokens"] for r in records) / len(records), 2),
            "baseline_accuracy": round(sum(r["score"] for r in base) / len(base), 3),
        })
        print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    df["vs_single"] = (df["questions_per_hour"] / df.loc[df["mode"] == "single", "questions_per_hour"].iloc[0]).round(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "questions.csv", df.to_csv(index=False))
    head = (f"# Questions per hour\n\n`python scripts/bench_questions.py --task {args.task} --context {args.context} "
            f"--questions {args.questions} --contexts {args.contexts} --single {args.single} --strategies "
            f"{args.strategies} --threads {args.threads}` — SmolLM2-135M bf16 on CPU, strategies full + "
            f"{args.strategies}, query-agnostic, one run (modes timed in turn; the machine's other load is not "
            "controlled, so read the ratios).\n\n")
    atomic_write_text(out / "questions.md", head + df.to_markdown(index=False) + "\n")


if __name__ == "__main__":
    main()
