"""``papers``: a reported figure (a metric on a named cohort or dataset) among other results, in
real open-access papers.

The haystack is a PubMed Central article (CC-BY or public domain, from a random paragraph) or the
1992 Library of Congress workshop proceedings; the needle reports one metric on one cohort, and the
distractors report the same metric on other cohorts with other values.
"""

from __future__ import annotations

from typing import Any

from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.corpora import load_corpus
from kvbench.tasks.needles import DOMAIN_FAMILIES
from kvbench.tasks.suite import DEFAULTS, build_task

PAPERS_DEFAULTS: dict[str, Any] = {**DEFAULTS, "needles": list(DOMAIN_FAMILIES["papers"])}


@register_task("papers", inputs=TaskInputs(corpus="papers"))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """Build ``papers`` samples (see :mod:`kvbench.tasks.suite` for the variants)."""
    return build_task("papers", cfg, tokenizer, max_context, load_corpus("papers"), PAPERS_DEFAULTS,
                      random_start=True)
