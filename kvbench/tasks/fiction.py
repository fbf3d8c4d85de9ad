"""``fiction``: an early character attribute recalled late, in real novel and play text.

The haystack is a Project Gutenberg novel (*Botchan*, *Alice*) or Shakespeare play from a random
paragraph. Early in it (shallow default depths) the needle gives a character's attribute (a pet's
name, a keepsake, a birthplace); distractors give other characters the same kind of attribute. The
question comes at the end, so the fact must survive the whole context.
"""

from __future__ import annotations

from typing import Any

from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.corpora import load_corpus
from kvbench.tasks.needles import DOMAIN_FAMILIES
from kvbench.tasks.suite import DEFAULTS, build_task

# 2048 tokens: the fact sits early and the question at the end, and at 4096 tokens the embedded 135M
# model recalled it among distractors too rarely for a useful full-cache baseline; see docs/tasks.md.
FICTION_DEFAULTS: dict[str, Any] = {**DEFAULTS, "context_tokens": 2048, "depths": [0.05, 0.2, 0.35],
                                    "needles": list(DOMAIN_FAMILIES["fiction"])}


@register_task("fiction", inputs=TaskInputs(corpus="fiction"))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """Build ``fiction`` samples (see :mod:`kvbench.tasks.suite` for the variants)."""
    return build_task("fiction", cfg, tokenizer, max_context, load_corpus("fiction"), FICTION_DEFAULTS,
                      random_start=True)
