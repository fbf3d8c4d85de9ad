"""``legal``: numbered contract clauses among near-identical clauses, in real licence and EULA text.

The haystack is a bundle of real licences (ScanCode LicenseDB, deduplicated), each from its start,
like a third-party notices file. The needle is a clause of a contract schedule (notice period,
liability cap or governing law) for one named account; the distractors are the same clause for other
accounts with other values.
"""

from __future__ import annotations

from typing import Any

from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.corpora import load_corpus
from kvbench.tasks.needles import DOMAIN_FAMILIES
from kvbench.tasks.suite import DEFAULTS, build_task

# One distractor: with two, the embedded 135M model scored below 0.8 at 4K even with a full cache
# (the licence text itself is full of real governing-law and liability clauses); see docs/tasks.md.
LEGAL_DEFAULTS: dict[str, Any] = {**DEFAULTS, "distractors": 1, "needles": list(DOMAIN_FAMILIES["legal"])}


@register_task("legal", inputs=TaskInputs(corpus="legal"))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """Build ``legal`` samples (see :mod:`kvbench.tasks.suite` for the variants)."""
    return build_task("legal", cfg, tokenizer, max_context, load_corpus("legal"), LEGAL_DEFAULTS,
                      random_start=False)
