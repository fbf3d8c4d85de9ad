"""``kvbench calibrate``: tune a needle task on your corpus until the full-cache baseline is reliable.

    kvbench calibrate task=custom task.corpus=~/my-docs [model=...] [--target 0.8] [--n 12] [--criterion point]

A benchmark whose ``full`` baseline is near chance measures nothing; the built-in tasks were calibrated so that
the embedded model with a full cache answers at least 0.8 of their questions (docs/tasks.md, "Calibration").
On a new corpus that can fail (unseen novels: 0.667 at 4K, n = 6). This command tries settings of the task,
from the most discriminating to the easiest, and stops at the first whose full-cache accuracy meets the
target:

* ``task.distractors`` — from the configured count down to 0 (fewer near-identical statements);
* ``task.answer_prefix`` — ``true`` first (the reply starts with the needle's lead-in), then ``false``;
* ``task.needles`` — the configured families, then each other needle family alone.

Order: more distractors first; at one count, the answer prefix before none, and the configured families before
the others. Each trial builds the task's samples (same seed, so the same documents and depths) and greedy-decodes
them with the plain full cache (``model.generate``), scored with the task's metric.

**Criterion** (``--criterion``): ``point`` (default) — the accuracy itself is at least the target, as the
built-in tasks were calibrated; ``wilson`` — the lower end of the 95% Wilson interval is (needs about 16
correct of 16 for 0.8). The Wilson interval is printed for every trial either way, so a reader sees how sure
the chosen setting is. The chosen settings are printed as overrides to pass to ``python -m kvbench``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KVBenchError

CRITERIA = ("point", "wilson")
DEFAULT_TARGET = 0.8
DEFAULT_N = 12
#: Tasks whose samples have the three tunable settings (the needle suite).
TUNABLE = ("custom", "legal", "papers", "fiction")

Evaluator = Callable[[Any], list[float]]


@dataclass(frozen=True)
class Setting:
    """One candidate: needle families, answer prefix on/off, distractor count."""

    needles: tuple[str, ...]
    answer_prefix: bool
    distractors: int

    def overrides(self) -> list[str]:
        return [f"task.needles=[{','.join(self.needles)}]", f"task.answer_prefix={str(self.answer_prefix).lower()}",
                f"task.distractors={self.distractors}"]


@dataclass
class Trial:
    setting: Setting
    scores: list[float]
    accuracy: float
    low: float
    high: float
    meets: bool


def candidates(needles: Sequence[str], answer_prefix: bool, distractors: int) -> list[Setting]:
    """Every setting to try, most discriminating first (see the module docstring for the order)."""
    from kvbench.tasks.needles import FAMILIES

    families = [tuple(needles)] + [(f,) for f in FAMILIES if (f,) != tuple(needles)]
    prefixes = list(dict.fromkeys([True, answer_prefix, False]))
    return [Setting(fam, ap, d) for d in range(distractors, -1, -1) for ap in prefixes for fam in families]


def judge(scores: Sequence[float], target: float, criterion: str) -> tuple[float, float, float, bool]:
    """(accuracy, Wilson low, Wilson high, meets the target by ``criterion``)."""
    from kvbench.spec import accuracy_interval

    acc, lo, hi = accuracy_interval(list(scores), binary=True)
    return acc, lo, hi, (lo if criterion == "wilson" else acc) >= target


def calibrate(task_cfg: Any, evaluate: Evaluator, target: float = DEFAULT_TARGET, criterion: str = "point",
              max_trials: int = 12,
              report: Callable[[Trial], None] | None = None) -> tuple[Setting | None, list[Trial]]:
    """Try :func:`candidates` of ``task_cfg`` in order with ``evaluate(task_cfg_with_setting) -> scores``;
    return the first setting that meets ``target`` (None if none did within ``max_trials``) and every trial."""
    from omegaconf import OmegaConf

    if criterion not in CRITERIA:
        raise KVBenchError(f"unknown --criterion {criterion!r}; valid: {', '.join(CRITERIA)}")
    if not 0.0 < target <= 1.0:
        raise KVBenchError(f"--target must be in (0, 1] (got {target})")
    base = OmegaConf.create(OmegaConf.to_container(task_cfg, resolve=True))
    trials: list[Trial] = []
    start = candidates(list(base.needles), bool(base.answer_prefix), int(base.distractors))
    for setting in start[:max_trials]:
        cfg = OmegaConf.merge(base, {"needles": list(setting.needles), "answer_prefix": setting.answer_prefix,
                                     "distractors": setting.distractors})
        scores = evaluate(cfg)
        trial = Trial(setting, scores, *judge(scores, target, criterion))
        trials.append(trial)
        if report:
            report(trial)
        if trial.meets:
            return setting, trials
    return None, trials


def full_cache_evaluator(cfg: Any) -> Evaluator:
    """Scores of ``full`` on a task config: greedy ``model.generate`` with the plain cache, the task's metric."""
    import torch

    from kvbench.models import load_model
    from kvbench.tasks.base import build_samples
    from kvbench.tasks.metrics import score

    dtype = cfg.model.get("dtype") or "bfloat16"
    lm = load_model(cfg.model.name, dtype=dtype, path=cfg.model.get("path"), seed=int(cfg.seed))

    @torch.inference_mode()
    def evaluate(task_cfg: Any) -> list[float]:
        out = []
        for s in build_samples(str(task_cfg.name), task_cfg, lm.tokenizer, lm.max_context):
            ids = torch.tensor([s.prefix_ids + s.query_ids])
            gen = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=s.max_new_tokens, pad_token_id=lm.tokenizer.eos_token_id)
            out.append(float(score(s.metric, lm.tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True),
                                   s.answers)))
        return out

    return evaluate


def _print_trial(t: Trial) -> None:
    s = t.setting
    print(f"  needles={','.join(s.needles):<28} answer_prefix={str(s.answer_prefix).lower():<5} "
          f"distractors={s.distractors}  full {t.accuracy:.3f} [{t.low:.3f}, {t.high:.3f}] (n={len(t.scores)})"
          f"{'  <- meets the target' if t.meets else ''}", flush=True)


def main(argv: list[str] | None = None, make_evaluator: Callable[[Any], Evaluator] = full_cache_evaluator) -> int:
    p = argparse.ArgumentParser(prog="kvbench calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="kvbench overrides, e.g. task=custom task.corpus=~/docs model=...")
    p.add_argument("--target", type=float, default=DEFAULT_TARGET, help="full-cache accuracy to reach (0.8)")
    p.add_argument("--criterion", default="point", choices=CRITERIA,
                   help="point: accuracy >= target (default); wilson: 95%% Wilson lower bound >= target")
    p.add_argument("--n", type=int, default=DEFAULT_N, help=f"samples per trial ({DEFAULT_N})")
    p.add_argument("--max-trials", type=int, default=12, help="settings tried at most (12)")
    try:
        # Intermixed: overrides may come before, between or after the options (``task=custom --n 5 model=...``).
        args = p.parse_intermixed_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        from kvbench.config import compose_config

        cfg = compose_config([*args.overrides, f"task.n_samples={args.n}"])
        if str(cfg.task.name) not in TUNABLE:
            raise KVBenchError(f"kvbench calibrate tunes the needle tasks; valid: {', '.join(TUNABLE)} "
                               f"(got task={cfg.task.name})")
        if args.n < 1 or args.max_trials < 1:
            raise KVBenchError("--n and --max-trials must be >= 1")
        if str(cfg.task.get("variant")) != "retrieval":
            raise KVBenchError("kvbench calibrate tunes the retrieval variant (task.variant=retrieval)")
        print(f"calibrating task={cfg.task.name} on model={cfg.model.name}: full-cache accuracy >= {args.target} "
              f"by the {'Wilson lower bound' if args.criterion == 'wilson' else 'point estimate'}, n={args.n}",
              flush=True)
        chosen, trials = calibrate(cfg.task, make_evaluator(cfg), args.target, args.criterion, args.max_trials,
                                   report=_print_trial)
    except KVBenchError as exc:
        print(f"kvbench calibrate: error: {exc}", file=sys.stderr)
        return 2
    if chosen is None:
        print(f"no setting reached {args.target} in {len(trials)} trial(s); raise --max-trials, shorten "
              "task.context_tokens or choose other task.needles")
        return 1
    print("chosen: " + " ".join(chosen.overrides()))
    print("run:    python -m kvbench " + " ".join([*args.overrides, *chosen.overrides()]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
