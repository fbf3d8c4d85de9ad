"""kvbench tasks as lm-eval tasks: ``kvbench lmeval export --task legal --out DIR``.

Builds the harness's samples (:func:`kvbench.tasks.build_samples`), writes them as decoded text to
``DIR/kvbench_legal.jsonl`` and writes ``DIR/kvbench_legal.yaml``, so ``--tasks kvbench_legal --include_path DIR``
runs offline. Needs no lm-eval.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench import SPEC_VERSION
from kvbench.errors import KVBenchError
from kvbench.tasks.metrics import TEXT_METRICS

#: lm-eval metric for each kvbench task metric; ``token_accuracy`` tasks (held-out continuations) become
#: loglikelihood tasks, whose per-sample figures are the gold log-likelihood and whole-continuation match.
GENERATION_METRICS = TEXT_METRICS


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` hook of exported generation tasks: kvbench's own metric for the doc."""
    from kvbench.tasks.metrics import score

    return {doc["metric"]: float(score(doc["metric"], results[0], list(doc["answers"])))}


def task_config(task: str, overrides: Sequence[str] = (), seed: int = 0) -> Any:
    """The ``task`` node exactly as ``python -m kvbench task=<task> task.<key>=<value> seed=<seed>`` composes
    it (Hydra's compose API on kvbench's config tree, so interpolations such as ``${seed}`` resolve).
    A task without a YAML in ``conf/task`` (registered from Python) gets ``{name: task}`` plus overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from kvbench.config import compose_config, group_options

    dotted = [o if o.startswith("task.") else f"task.{o}" for o in overrides]
    if task not in group_options("task"):
        try:
            return OmegaConf.merge(OmegaConf.create({"name": task, "seed": seed}),
                                   OmegaConf.from_dotlist([o[len("task."):] for o in dotted]))
        except OmegaConfBaseException as exc:
            raise KVBenchError(f"bad task override in {list(overrides)}: {str(exc).splitlines()[0]}") from None
    try:
        cfg = compose_config([f"task={task}", f"seed={seed}", *dotted])
        return OmegaConf.create(OmegaConf.to_container(cfg.task, resolve=True))
    except (KVBenchError, OmegaConfBaseException) as exc:
        raise KVBenchError(f"bad task override in {list(overrides)}: {str(exc).strip().splitlines()[0]}") from None


def export_task(task: str, out_dir: str | Path, model: str = "smollm2-135m", model_path: str | None = None,
                overrides: Sequence[str] = (), seed: int = 0) -> tuple[Path, Path]:
    """Write ``kvbench_<task>.jsonl`` (the harness's samples as text) and ``kvbench_<task>.yaml`` into ``out_dir``.

    Samples are built with the named model's tokenizer, exactly as ``python -m kvbench task=<task>`` builds
    them (``overrides`` are ``key=value`` task settings such as ``context_tokens=2048``), then decoded
    with special tokens kept so a chat template survives the round trip through text.
    """
    import yaml
    from omegaconf import OmegaConf

    from kvbench.models import load_model
    from kvbench.tasks.base import build_samples

    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = task_config(task, overrides, seed)
    lm = load_model(model, dtype="float32", path=model_path)
    samples = build_samples(task, cfg, lm.tokenizer, lm.max_context)
    metrics = sorted({s.metric for s in samples})
    if len(metrics) != 1:
        raise KVBenchError(f"task {task!r} mixes metrics {', '.join(metrics)}; export one metric per task")
    metric = metrics[0]

    def text(ids: list[int]) -> str:
        return lm.tokenizer.decode(ids, skip_special_tokens=False)

    name = f"kvbench_{task}"
    rows = []
    for s in samples:
        context, query = text(s.prefix_ids), text(s.query_ids)
        rows.append({
            "id": s.sample_id, "prompt": context + query, "context": context, "query": query,
            "target": text(s.gold_ids), "answers": list(s.answers), "metric": s.metric,
            "max_new_tokens": s.max_new_tokens, "context_tokens": s.context_tokens,
            "meta": json.dumps(s.metadata, sort_keys=True, default=str),
        })
    data_path = out / f"{name}.jsonl"
    from kvbench.results import atomic_write_text

    atomic_write_text(data_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    task_cfg: dict[str, Any] = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}},
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{target}}",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metadata": {"version": 1.0, "kvbench_task": task, "kvbench_model": model,
                     "kvbench_spec_version": SPEC_VERSION,
                     "task_config": OmegaConf.to_container(cfg, resolve=True)},
    }
    if metric in GENERATION_METRICS:
        task_cfg.update({
            "output_type": "generate_until",
            "generation_kwargs": {"until": [], "max_gen_toks": max(s.max_new_tokens for s in samples),
                                  "do_sample": False, "temperature": 0.0},
            "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}],
        })
    else:
        task_cfg.update({
            "output_type": "loglikelihood",
            # acc first: it is the per-sample figure `kvbench lmeval import` ranks (perplexity is corpus-level)
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False}],
        })
    body = yaml.safe_dump(task_cfg, sort_keys=False, allow_unicode=True)
    if metric in GENERATION_METRICS:
        # The `!function` tag cannot come out of safe_dump; lm-eval resolves it as an importable module path.
        body += "process_results: !function kvbench.lmeval.process_results\n"
    header = (f"# Generated by `kvbench lmeval export --task {task}` ({len(rows)} samples, model {model}).\n"
              f"# Run: kvbench lmeval run --model_args pretrained={model},strategy=int8 --tasks {name} "
              f"--include_path {out}\n")
    yaml_path = out / f"{name}.yaml"
    atomic_write_text(yaml_path, header + body)
    return data_path, yaml_path

