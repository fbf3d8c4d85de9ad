"""Scoring of decoded answers against reference answers.

``score(metric, prediction, answers)`` returns a value in [0, 1]; the maximum over ``answers``.

* ``substring`` — after SQuAD-style normalisation (lower case, punctuation and articles removed,
  whitespace collapsed, numbers kept whole) some answer occurs in the prediction *on word
  boundaries*: "45" matches "45 days." but not "145 days", so a distractor value cannot count as a
  hit by accident.
* ``exact`` — normalised prediction equals a normalised answer.
* ``f1`` — SQuAD token F1 between the normalised prediction and answer.
* ``token_accuracy`` — computed by the engine from logits over ``gold_ids``; text scoring is refused.

:data:`TASK_METRICS` is the one registry of these names (a "task metric": how a sample's answer is scored,
as opposed to the summary figures of :data:`kvbench.record.METRICS`). What a sample may carry
(``kvbench.tasks.base.METRICS``), which scores are binary (``kvbench.spec.BINARY_METRICS``, choosing Wilson and
Newcombe intervals over the bootstrap) and which tasks lm-eval generates (``kvbench.lmeval.GENERATION_METRICS``)
are derived from it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvbench.errors import KVBenchError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# Punctuation becomes a space (not nothing) so "US$250,000" and "250 000" normalise alike and
# "45-day" still splits into words; unicode dashes and quotes common in real text are included.
_PUNCT = re.compile("[" + re.escape(string.punctuation + "\u2018\u2019\u201c\u201d\u2013\u2014\u2212") + "]")


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL = re.compile(r"(?<=\d)\.(?=\d)")
_DOT = "\x00"


def normalize(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop punctuation and articles, collapse whitespace.

    Numbers stay whole ("1,250,000" -> "1250000", "91.3" stays "91.3") so that one figure can never
    be found inside another ("250,000" is not in "1,250,000").
    """
    text = _DECIMAL.sub(_DOT, _THOUSANDS.sub("", text.lower()))
    text = _PUNCT.sub(" ", text).replace(_DOT, ".")
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _substring(prediction: str, answer: str) -> float:
    pred, ans = normalize(prediction), normalize(answer)
    if not ans:
        return 0.0
    return float(f" {ans} " in f" {pred} ")


def _exact(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def _f1(prediction: str, answer: str) -> float:
    pred, ans = normalize(prediction).split(), normalize(answer).split()
    if not pred or not ans:
        # SQuAD convention: both empty is a match, one empty is not.
        return float(pred == ans)
    common = Counter(pred) & Counter(ans)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ans)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class TaskMetric:
    """One task metric. ``binary``: every score is 0 or 1 (else anywhere in [0, 1]); ``scorer``: the score of a
    decoded prediction against one answer, or None for a metric the engine computes from logits."""

    name: str
    binary: bool
    scorer: Callable[[str, str], float] | None = None


#: Every task metric, by name.
TASK_METRICS: dict[str, TaskMetric] = {m.name: m for m in (
    TaskMetric("substring", binary=True, scorer=_substring),
    TaskMetric("exact", binary=True, scorer=_exact),
    TaskMetric("f1", binary=False, scorer=_f1),
    TaskMetric("token_accuracy", binary=False),  # fraction of gold tokens the model predicts (kvbench.engine)
)}
#: Metrics scored from decoded text, by :func:`score`.
TEXT_METRICS: tuple[str, ...] = tuple(n for n, m in TASK_METRICS.items() if m.scorer is not None)
_SCORERS = {n: m.scorer for n, m in TASK_METRICS.items() if m.scorer is not None}


def score(metric: str, prediction: str, answers: list[str]) -> float:
    """Score ``prediction`` against every answer with ``metric``; return the best score."""
    if metric == "token_accuracy":
        raise KVBenchError("metric 'token_accuracy' is computed by the engine from logits, not from decoded text")
    if metric not in _SCORERS:
        raise KVBenchError(f"unknown text metric {metric!r}; valid: {', '.join(TEXT_METRICS)}")
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise KVBenchError("score() needs at least one reference answer")
    return max(_SCORERS[metric](prediction, a) for a in answers)
