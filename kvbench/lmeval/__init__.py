"""lm-evaluation-harness integration: a ``kvbench`` model, task export, and result import.

* :mod:`kvbench.lmeval.model` — ``KVBenchLM``, registered with lm-eval as ``kvbench``: every request runs on
  the engine against a strategy's compressed cache (``strategy=full`` equals lm-eval's ``hf`` model);
* :mod:`kvbench.lmeval.export` — ``kvbench lmeval export``: kvbench tasks as lm-eval task YAML + JSONL;
* :mod:`kvbench.lmeval.importer` — ``kvbench lmeval import``: lm-eval results JSON into the result store;
* :mod:`kvbench.lmeval.cli` — ``kvbench lmeval {run,export,import}``, ``python -m kvbench.lmeval`` and the
  ``kvbench-lm-eval`` console script.

lm-eval 0.4.x has no plugin entry-point group for models, so importing this package registers ``kvbench``
(when lm-eval is installed): from Python, ``import kvbench.lmeval`` before ``lm_eval.simple_evaluate``.
Export and import work without lm-eval.
"""

from kvbench.lmeval.cli import build_parser, console_main, main, run_lm_eval
from kvbench.lmeval.export import GENERATION_METRICS, export_task, process_results, task_config
from kvbench.lmeval.importer import UNMEASURED_FIELDS, find_results_json, import_results, lmeval_records
from kvbench.lmeval.model import (
    HAVE_LM_EVAL,
    LM_EVAL_INSTALL,
    MODEL_NAME,
    CacheStats,
    KVBenchLM,
    build_strategy,
    register,
    strategy_params_from_arg,
)

__all__ = [
    "GENERATION_METRICS", "HAVE_LM_EVAL", "LM_EVAL_INSTALL", "MODEL_NAME", "UNMEASURED_FIELDS", "CacheStats",
    "KVBenchLM", "build_parser", "build_strategy", "console_main", "export_task", "find_results_json",
    "import_results", "lmeval_records", "main", "process_results", "register", "run_lm_eval",
    "strategy_params_from_arg", "task_config",
]

if HAVE_LM_EVAL:
    register()
