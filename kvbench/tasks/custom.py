"""``custom``: the same needle and continuation samples over the user's own documents.

``task.corpus=<dir>`` names a folder of ``.txt``/``.md`` files (read recursively, sorted by path).
The needle family defaults to the generic key-value statement (``access_code``); any family of
:mod:`kvbench.tasks.needles` can be chosen with ``task.needles``, e.g. the legal clauses.
"""

from __future__ import annotations

from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.corpora import load_directory
from kvbench.tasks.needles import DOMAIN_FAMILIES
from kvbench.tasks.suite import DEFAULTS, build_task

CUSTOM_DEFAULTS: dict[str, Any] = {**DEFAULTS, "needles": list(DOMAIN_FAMILIES["generic"])}


@register_task("custom", inputs=TaskInputs(directories=("corpus",)))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """Build ``custom`` samples from the documents in ``task.corpus``."""
    corpus = cfg.get("corpus", None)
    if not corpus:
        raise KVBenchError("task custom needs task.corpus=<directory of .txt/.md files>")
    return build_task("custom", cfg, tokenizer, max_context, load_directory(str(corpus)), CUSTOM_DEFAULTS,
                      random_start=True)
