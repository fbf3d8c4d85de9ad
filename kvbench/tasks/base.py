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
from kvbench.tasks.metrics import TASK_METRICS

#: The metrics a sample may carry (the registry: :data:`kvbench.tasks.metrics.TASK_METRICS`).
METRICS: tuple[str, ...] = tuple(TASK_METRICS)


def answer_list(value: Any, where: str) -> list[str]:
    """A row's reference answers as strings — the one reading for every task whose answers come from a file or a
    dataset (``jsonl``, ``hf``). A string is one answer; a number is the evident string (``4400`` -> ``"4400"``:
    the model writes digits); a list holds such answers (``null`` entries and blanks dropped). A mapping, a
    boolean or a nested list has no evident answer and is one :class:`KVBenchError` line naming ``where`` (a
    mapping used to be scored against its keys). Empty when there is no answer (the caller says what is
    missing)."""
    import numbers
    from collections.abc import Mapping

    def one(v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            if v != v or v in (float("inf"), float("-inf")):
                raise KVBenchError(f"{where}: an answer is {v!r}, not a value a model can write")
            return str(int(v)) if isinstance(v, numbers.Integral) else repr(float(v))
        kind = "a mapping" if isinstance(v, Mapping) else type(v).__name__
        raise KVBenchError(f"{where}: an answer is {kind} ({str(v)[:40]}); answers are strings or numbers, one or a "
                           'list: "answers": ["..."] or "answer": "..."')

    if value is None:
        return []
    if isinstance(value, Mapping):
        raise KVBenchError(f"{where}: the answers are a mapping ({str(value)[:40]}), which names no answer; give a "
                           'string or a list of strings: "answers": ["..."] or "answer": "..."')
    items = [value] if isinstance(value, str | numbers.Real) else value
    try:
        items = list(items)
    except TypeError:
        raise KVBenchError(f"{where}: the answers are {type(value).__name__}; give a string or a list of strings") \
            from None
    return [a for a in map(one, items) if a is not None and a.strip()]


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
    #: Stop decoding once the reply has ended its first line (one-line answers: what follows cannot score).
    stop_at_newline: bool = False

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

    @property
    def total_tokens(self) -> int:
        """The most tokens a cache of this sample ever sees: context, question, and the longer of the gold
        answer (teacher forcing) and the decoded one."""
        return len(self.prefix_ids) + len(self.query_ids) + max(len(self.gold_ids), self.max_new_tokens)


@dataclass(frozen=True)
class TaskInputs:
    """What a task's samples are read from besides its settings, declared with :func:`register_task` so the run
    identity digests it (:func:`kvbench.identity.task_digest`): an edited input is a new run, a moved one is not.

    ``files``: settings naming one file each (``jsonl``'s ``path``); ``directories``: settings naming a folder
    of documents, every ``.txt``/``.md`` file under it (``custom``'s ``corpus``); ``corpus``: a built-in corpus
    of :mod:`kvbench.tasks.corpora` (its pinned archives and extractor version). A task declaring nothing is
    identified by its settings alone.
    """

    files: tuple[str, ...] = ()
    directories: tuple[str, ...] = ()
    corpus: str | None = None
    #: A task whose inputs depend on its settings (RULER's generator and optional haystack corpus, a Hugging Face
    #: dataset's files) digests them itself: ``digest(task_cfg) -> {"kind", "digest", ...}``.
    digest: Callable[[Any], dict[str, Any]] | None = None
    #: Settings that only locate what ``digest`` reads (``hf``'s ``dataset``).
    located_by: tuple[str, ...] = ()

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings that only say *where* an input lives (left out of the identity once it is digested)."""
        return (*self.files, *self.directories, *self.located_by)


TaskBuilder = Callable[..., list[Sample]]
_TASKS: dict[str, TaskBuilder] = {}
_INPUTS: dict[str, TaskInputs] = {}


def register_task(name: str, inputs: TaskInputs | None = None) -> Callable[[TaskBuilder], TaskBuilder]:
    """Register ``fn(cfg, tokenizer, max_context) -> list[Sample]`` under ``name``, reading ``inputs``."""

    def deco(fn: TaskBuilder) -> TaskBuilder:
        _TASKS[name] = fn
        _INPUTS[name] = inputs or TaskInputs()
        return fn

    return deco


def task_inputs(name: str) -> TaskInputs:
    """What task ``name`` declared it reads (nothing for an unknown name)."""
    _import_builtin_tasks()
    return _INPUTS.get(name, TaskInputs())


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
