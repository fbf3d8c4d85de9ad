"""Baseline accuracy of the embedded model with a plain full cache, per task, with bootstrap 95% CIs.

Used to calibrate the task defaults (the full-cache baseline should score >= 0.8 on every retrieval
task at the default length, with distractors in place). Retrieval samples are greedy-decoded with
``model.generate`` and scored with the sample's metric; continuation samples are scored by gold
token accuracy from one teacher-forced forward pass.

    python scripts/calibrate_tasks.py                                  # legal, papers, fiction defaults
    python scripts/calibrate_tasks.py --tasks legal --set distractors=4 --set context_tokens=2048
    python scripts/calibrate_tasks.py --variant continuation --n 6
    python scripts/calibrate_tasks.py --records cal.jsonl    # resumable: rerun the same command after a kill
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.models import load_model  # noqa: E402
from kvbench.tasks.base import Sample, build_samples  # noqa: E402
from kvbench.tasks.metrics import score  # noqa: E402


def bootstrap_ci(values: list[float], iters: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return means[int(0.025 * iters)], means[min(iters - 1, int(0.975 * iters))]


def task_config(task: str, seed: int, overrides: list[str]) -> Any:
    """The task's YAML with ``key=value`` overrides, inside a root that resolves ``${seed}``."""
    cfg = OmegaConf.load(ROOT / "conf" / "task" / f"{task}.yaml")
    root = OmegaConf.create({"seed": seed, "task": cfg})
    for item in overrides:
        key, value = item.split("=", 1)
        OmegaConf.update(root, f"task.{key}", yaml.safe_load(value), force_add=True)
    return root.task


@torch.inference_mode()
def run_sample(lm: Any, sample: Sample) -> tuple[float, str]:
    """Score one sample with the full cache; return (score, decoded output or accuracy note)."""
    ids = torch.tensor([sample.prefix_ids + sample.query_ids])
    if sample.metric == "token_accuracy":
        full = torch.tensor([sample.prefix_ids + sample.query_ids + sample.gold_ids])
        logits = lm.model(input_ids=full, logits_to_keep=len(sample.gold_ids) + 1).logits[0, :-1]
        hits = (logits.argmax(-1) == torch.tensor(sample.gold_ids)).float()
        return float(hits.mean()), f"{int(hits.sum())}/{len(sample.gold_ids)} tokens"
    out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            max_new_tokens=sample.max_new_tokens, do_sample=False,
                            pad_token_id=lm.tokenizer.eos_token_id)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return score(sample.metric, text, sample.answers), text


def sample_identity(sample: Sample) -> list[Any]:
    """What must match for a recorded result to be reused for ``sample`` (a resumed run rebuilds the
    same samples deterministically; this guards against a changed config or task code)."""
    m = sample.metadata
    return [sample.sample_id, len(sample.prefix_ids), len(sample.query_ids), sample.gold_ids, sample.answers,
            sample.max_new_tokens, m.get("needle_text"), m.get("needle_token_index"), m.get("source_docs")]


def load_records(path: Path | None) -> dict[str, dict[str, Any]]:
    """Per-sample records already written to ``path`` (JSON Lines); a torn last line is ignored."""
    if path is None or not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[rec["sample_id"]] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="legal,papers,fiction")
    ap.add_argument("--variant", default=None, help="retrieval or continuation (default: the YAML's)")
    ap.add_argument("--n", type=int, default=None, help="samples per task (default: the YAML's n_samples)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="task config override")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--records", type=Path, default=None,
                    help="append per-sample results here (JSON Lines); samples already recorded are reused, "
                         "so an interrupted run resumes where it stopped")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every sample's output")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_model("smollm2-135m", dtype="bfloat16")
    overrides = list(args.set)
    if args.variant:
        overrides.append(f"variant={args.variant}")
    if args.n:
        overrides.append(f"n_samples={args.n}")
    print(f"model smollm2-135m bf16, full cache, greedy; torch threads {torch.get_num_threads()}; "
          f"seed {args.seed}; overrides {overrides or 'none'}", flush=True)
    done = load_records(args.records)
    rows = []
    for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        cfg = task_config(task, args.seed, overrides)
        samples = build_samples(task, cfg, lm.tokenizer, lm.max_context)
        t0 = time.perf_counter()
        scores = []
        for s in samples:
            m = s.metadata
            ident = sample_identity(s)
            if s.sample_id in done and done[s.sample_id].get("identity") == ident:
                rec = done[s.sample_id]
            else:
                value, text = run_sample(lm, s)
                rec = {"identity": ident, "task": task, "sample_id": s.sample_id, "score": value, "output": text,
                       "answers": s.answers, "depth": m.get("depth"), "family": m.get("needle_family"),
                       "distractor_values": m.get("distractor_values"), "needle_index": m.get("needle_token_index"),
                       "distractor_indices": m.get("distractor_token_indices")}
                if args.records:
                    with open(args.records, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")
            scores.append(rec["score"])
            if args.verbose:
                print(f"  {s.sample_id} depth={m.get('depth')} {m.get('needle_family')} gold={s.answers}"
                      f"@{m.get('needle_token_index')} distractors={m.get('distractor_values')}"
                      f"@{m.get('distractor_token_indices')} -> {rec['output']!r} [{rec['score']:.2f}]", flush=True)
        lo, hi = bootstrap_ci(scores)
        m = samples[0].metadata
        rows.append((task, m["variant"], m["context_tokens"], m.get("distractors", 0), len(scores),
                     sum(scores) / len(scores), lo, hi, time.perf_counter() - t0))
        print(f"{task:8s} {m['variant']:12s} ctx={m['context_tokens']} distractors={m.get('distractors', 0)} "
              f"n={len(scores)} score={rows[-1][5]:.3f} 95% CI [{lo:.3f}, {hi:.3f}] ({rows[-1][8]:.0f} s)",
              flush=True)
    print("\n| task | variant | context tokens | distractors | n | score | 95% CI (bootstrap) |")
    print("|---|---|---|---|---|---|---|")
    for task, variant, ctx, nd, n, mean, lo, hi, _ in rows:
        print(f"| {task} | {variant} | {ctx} | {nd} | {n} | {mean:.3f} | [{lo:.3f}, {hi:.3f}] |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
