"""What a task hands the engine: token-exact samples split at the point where the cache is compressed.

A sample is three token sequences:

* ``prefix_ids`` — everything prefilled with full attention and then compressed by the strategy
  (prompt template + long document, plus the question when the task is query-aware);
* ``query_ids`` — processed *after* compression, against the compressed cache (the question when
  query-agnostic, always the assistant header);
* ``gold_ids`` — the reference answer (or held-out continuation), teacher-forced for NLL/KL.

Everything is deterministic from (task config, seed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.metrics import TEXT_METRICS

#: Every metric a sample may name: the text metrics of :mod:`kvbench.tasks.metrics` and the engine's own.
METRICS = (*TEXT_METRICS, "token_accuracy")


@dataclass
class Sample:
    sample_id: str
    prefix_ids: list[int]
    query_ids: list[int]
    gold_ids: list[int]
    answers: list[str]
    metric: str
    metadata: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise KVBenchError(f"unknown metric {self.metric!r}; valid: {', '.join(METRICS)}")
        if not self.query_ids:
            raise KVBenchError(f"sample {self.sample_id}: query_ids must not be empty")
        if self.max_new_tokens < 1:
            raise KVBenchError(f"sample {self.sample_id}: max_new_tokens must be >= 1 (got {self.max_new_tokens})")

    @property
    def context_tokens(self) -> int:
        return len(self.prefix_ids)


TaskBuilder = Callable[..., list[Sample]]
_TASKS: dict[str, TaskBuilder] = {}


def register_task(name: str) -> Callable[[TaskBuilder], TaskBuilder]:
    """Register ``fn(cfg, tokenizer, max_context) -> list[Sample]`` under ``name``."""

    def deco(fn: TaskBuilder) -> TaskBuilder:
        _TASKS[name] = fn
        return fn

    return deco


def task_names() -> list[str]:
    _import_builtin_tasks()
    return sorted(_TASKS)


def build_samples(name: str, cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    _import_builtin_tasks()
    if name not in _TASKS:
        raise KVBenchError(f"unknown task {name!r}; valid: {', '.join(sorted(_TASKS))}")
    n = int(cfg.get("n_samples", 1))
    if n < 1:
        raise KVBenchError(f"task.n_samples must be >= 1 (got {n})")
    max_new = cfg.get("max_new_tokens", None)
    if max_new is not None and int(max_new) < 1:
        # 0 would decode nothing and score every strategy on an empty answer.
        raise KVBenchError(f"task.max_new_tokens must be >= 1 (got {max_new})")
    ctx = int(cfg.get("context_tokens", 0))
    if max_context and ctx > max_context:
        raise KVBenchError(f"task.context_tokens={ctx} exceeds the model's maximum context of {max_context}")
    return _TASKS[name](cfg, tokenizer, max_context)


def _import_builtin_tasks() -> None:
    import importlib
    import pkgutil

    import kvbench.tasks as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.name.startswith("_") and mod.name not in ("base",):
            importlib.import_module(f"kvbench.tasks.{mod.name}")
