"""lm-eval results into the result store: ``kvbench lmeval import RESULTS_JSON``.

Turns lm-eval's output JSON (and its per-sample files, when ``--log_samples`` wrote them) into result-store
records ``results/store/lmeval-<hash>.parquet`` that :func:`kvbench.results.read_store` and the leaderboard
read. Needs lm-eval only to parse a ``model_args`` string and to look up a metric's aggregation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvbench import SPEC_VERSION
from kvbench.errors import KVBenchError
from kvbench.fmt import as_float
from kvbench.record import MEASURED_FIELDS

#: Engine-record fields that lm-eval does not measure (from the one record schema); imported records carry them
#: as NaN.
UNMEASURED_FIELDS = MEASURED_FIELDS


def _metric_keys(task_results: dict[str, Any]) -> list[tuple[str, str]]:
    """``(metric, filter)`` pairs of one task's results, in lm-eval's order, without stderr entries."""
    keys = []
    for key in task_results:
        if key == "alias" or "," not in key:
            continue
        metric, flt = key.split(",", 1)
        if not metric.endswith("_stderr"):
            keys.append((metric, flt))
    return keys


def _model_args(config: dict[str, Any]) -> dict[str, Any]:
    args = config.get("model_args") or {}
    if isinstance(args, str):
        try:
            from lm_eval.utils import simple_parse_args_string
        except ImportError:  # lm-eval's parser also converts values; without it they stay strings
            return dict(a.split("=", 1) for a in args.split(",") if "=" in a)
        args = simple_parse_args_string(args)
    return dict(args)


def _sample_files(results_path: Path, task: str) -> list[Path]:
    """lm-eval's ``--log_samples`` files for ``task`` written with ``results_path`` (same timestamp)."""
    stamp = results_path.stem[len("results_"):] if results_path.stem.startswith("results_") else None
    if stamp is None:
        return []
    return sorted(results_path.parent.glob(f"samples_{task}_{stamp}.json*"))


def _aggregated_by_mean(metric: str, task_cfg: dict[str, Any]) -> bool:
    """Whether lm-eval averages ``metric`` over documents: only then is a per-document record's ``score``
    (averaged by the leaderboard) the same quantity as lm-eval's figure. Perplexities, corpus F1, BLEU
    and the like are aggregated otherwise and imported as their aggregate."""
    for entry in task_cfg.get("metric_list") or []:
        if isinstance(entry, dict) and entry.get("metric") == metric and "aggregation" in entry:
            return entry["aggregation"] == "mean"
    try:
        from lm_eval.api.registry import get_aggregation, get_metric_aggregation
    except ImportError:
        return False
    try:
        return get_metric_aggregation(metric) is get_aggregation("mean")
    except (KeyError, ValueError):
        return False


def _per_sample_scores(files: Iterable[Path], metric: str, flt: str) -> list[tuple[str, float]]:
    """``(doc id, score)`` per document from lm-eval sample files; empty if any value is not a number
    (corpus-level metrics such as perplexity keep per-document tuples, only their aggregate is meaningful)."""
    out = []
    for path in files:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("filter", flt) != flt:
                continue
            value = row.get(metric)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)):
                return []
            out.append((f"doc-{row.get('doc_id')}", float(value)))
    return out


def lmeval_records(results_path: str | Path, per_sample: bool = True) -> list[dict[str, Any]]:
    """Result-store records from one lm-eval results JSON.

    One record per task (its first metric, in the task's ``metric_list`` order), or one per document
    when ``--log_samples`` files sit next to the JSON and the metric is a mean over documents, so the
    leaderboard pairs strategies per sample. Every metric of the task is kept in ``lmeval_metrics`` (JSON). Fields
    that lm-eval does not measure are NaN, except the cache figures the ``kvbench`` model reports.
    """
    path = Path(results_path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KVBenchError(f"cannot read lm-eval results {path}: {exc}") from None
    if not isinstance(data, dict) or "results" not in data or "config" not in data:
        raise KVBenchError(f"{path} is not an lm-eval results JSON (no 'results'/'config')")
    config = data["config"]
    margs = _model_args(config)
    kv = config.get("kvbench") or {}
    backend = str(config.get("model", ""))
    from kvbench.results import stable_hash

    if kv:
        strategy, strategy_name = kv["strategy"], kv["strategy_name"]
        family, params, model = kv["family"], kv["params"], kv["model"]
        dtype, spec = kv.get("dtype"), kv.get("spec_version", SPEC_VERSION)
    else:  # any other lm-eval model holds a dense, uncompressed cache: the `full` baseline
        strategy, strategy_name, family, params = "full", "full", "baseline", {}
        model = str(margs.get("pretrained", backend))
        dtype, spec = margs.get("dtype"), SPEC_VERSION
    cache = kv.get("cache", {})
    leaf_tasks = [t for t in data["results"] if t in data.get("configs", data["results"])]
    records = []
    for task in leaf_tasks:
        res = data["results"][task]
        keys = _metric_keys(res)
        if not keys:
            continue
        task_cfg = data.get("configs", {}).get(task, {})
        # The task's metric_list order decides the primary metric (results follow process_results' order).
        listed = [e.get("metric") for e in task_cfg.get("metric_list") or [] if isinstance(e, dict)]
        keys.sort(key=lambda mf: listed.index(mf[0]) if mf[0] in listed else len(listed))
        metric, flt = keys[0]
        all_metrics = {f"{m},{f}": as_float(res.get(f"{m},{f}")) for m, f in keys}
        config_hash = stable_hash({
            "source": "lm-eval", "backend": backend, "model_args": margs, "strategy": strategy,
            "task": task, "task_config": task_cfg, "version": data.get("versions", {}).get(task),
            "n_shot": data.get("n-shot", {}).get(task), "limit": config.get("limit"),
            "lm_eval_version": data.get("lm_eval_version"),
        })
        base = {
            **{f: math.nan for f in UNMEASURED_FIELDS},
            "source": "lm-eval", "lmeval_backend": backend, "lmeval_task": task, "lmeval_filter": flt,
            "lmeval_version": data.get("lm_eval_version"), "lmeval_results": str(path.resolve()),
            "lmeval_metrics": json.dumps(all_metrics, sort_keys=True),
            "run_id": f"lmeval-{config_hash}", "config_hash": config_hash, "task": task, "model": model,
            "dtype": dtype, "device": kv.get("device", config.get("device")), "hardware": kv.get("hardware"),
            "seed": config.get("random_seed"), "spec_version": spec, "strategy": strategy,
            "strategy_name": strategy_name, "family": family, "params": json.dumps(params, sort_keys=True),
            "metric": metric, "query_aware": False,
            "n_samples": (data.get("n-samples", {}).get(task) or {}).get("effective"),
        }
        if cache:
            base.update({
                "kv_bytes": cache.get("kv_bytes_mean", math.nan),
                "kv_bytes_fp16": cache.get("kv_bytes_fp16_mean", math.nan),
                "kv_bytes_dense": cache.get("kv_bytes_dense_mean", math.nan),
                "memory_reduction": cache.get("memory_reduction", math.nan),
                "memory_reduction_fp16": cache.get("memory_reduction_fp16", math.nan),
                "bytes_per_token": cache.get("bytes_per_token", math.nan),
                "kept_fraction": cache.get("kept_fraction", math.nan),
                "context_tokens": cache.get("context_tokens_mean", math.nan),
            })
        mean_metric = _aggregated_by_mean(metric, task_cfg)
        docs = _per_sample_scores(_sample_files(path, task), metric, flt) if per_sample and mean_metric else []
        if docs:
            records.extend({**base, "sample_id": sid, "score": value, "score_stderr": math.nan}
                           for sid, value in docs)
        else:
            records.append({**base, "sample_id": "aggregate", "score": as_float(res.get(f"{metric},{flt}")),
                            "score_stderr": as_float(res.get(f"{metric}_stderr,{flt}"))})
    if not records:
        raise KVBenchError(f"{path} holds no task results to import")
    return records


def import_results(results_path: str | Path, results_dir: str | Path = "results",
                   per_sample: bool = True) -> tuple[Path, int]:
    """Write the records of one lm-eval results JSON as ``<results_dir>/store/lmeval-<hash>.parquet``.

    The file name is a hash of the records' config hashes, so importing the same JSON twice rewrites one
    file, and :func:`kvbench.results.read_store` de-duplicates whatever else overlaps.
    """
    import pandas as pd

    from kvbench.results import atomic_write_parquet, flatten_for_store, stable_hash

    records = lmeval_records(results_path, per_sample=per_sample)
    key = stable_hash(sorted({r["config_hash"] for r in records}))
    target = Path(results_dir) / "store" / f"lmeval-{key}.parquet"
    atomic_write_parquet(flatten_for_store(pd.DataFrame(records)), target)
    return target, len(records)


def find_results_json(path: str | Path) -> list[Path]:
    """``path`` itself if it is a file, else every ``results_*.json`` below it (lm-eval's --output_path)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(p.rglob("results_*.json"))
        if found:
            return found
    raise KVBenchError(f"no lm-eval results JSON at {p} (expected a results_*.json file or a directory with some)")

