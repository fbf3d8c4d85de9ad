"""Scoring of decoded answers against reference answers.

``score(metric, prediction, answers)`` returns a value in [0, 1]; the maximum over ``answers`` (RULER's
metrics below score all of them together).

* ``substring`` — after SQuAD-style normalisation (lower case, punctuation and articles removed,
  whitespace collapsed, numbers kept whole) some answer occurs in the prediction *on word
  boundaries*: "45" matches "45 days." but not "145 days", so a distractor value cannot count as a
  hit by accident.
* ``exact`` — normalised prediction equals a normalised answer.
* ``f1`` — SQuAD token F1 between the normalised prediction and answer.
* ``token_accuracy`` — computed by the engine from logits over ``gold_ids``; text scoring is refused.

RULER's metrics (Hsieh et al. 2024; ``scripts/eval/synthetic/constants.py`` of github.com/NVIDIA/RULER) score
the reply against *all* references at once, without normalisation beyond lower case:

* ``string_match_all`` — the fraction of references that occur (case-insensitive) in the prediction: NIAH,
  variable tracking, common- and frequent-word extraction. Multi-value and multi-query answers earn partial
  credit, so its scores are continuous.
* ``string_match_part`` — 1 when any reference occurs in the prediction (RULER's QA subtasks); binary.

LongBench's metrics (Bai et al. 2023; ``metrics.py`` of github.com/THUDM/LongBench), best over references:

* ``rouge_l`` — ROUGE-L F1 (longest common subsequence of words; lower case, non-alphanumerics as spaces,
  as the ``rouge-score`` package tokenizes). LongBench calls the ``rouge`` package, whose ``rouge-l`` can
  differ slightly on multi-sentence text.
* ``code_sim`` — LongBench's ``code_sim_score``: the reply's first line that holds no `` ` ``, ``#`` or ``//``,
  compared with the reference by ``difflib``'s similarity ratio, rounded to two decimals (fuzzywuzzy's
  ``fuzz.ratio`` without python-Levenshtein is exactly this).
* ``retrieval_score`` — of the numbers in the reply, the fraction equal to the paragraph number in the
  reference ("Paragraph 12"); ``count_score`` — of the numbers in the reply, the fraction equal to the reference.

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


_WORD = re.compile(r"[^a-z0-9]+")
_NUMBER = re.compile(r"\d+")


def _lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (one-row dynamic programme)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            cur = row[j]
            row[j] = prev + 1 if x == y else max(row[j], row[j - 1])
            prev = cur
    return row[-1]


def _rouge_l(prediction: str, answer: str) -> float:
    pred, ref = _WORD.sub(" ", prediction.lower()).split(), _WORD.sub(" ", answer.lower()).split()
    lcs = _lcs(pred, ref) if pred and ref else 0
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def _code_sim(prediction: str, answer: str) -> float:
    from difflib import SequenceMatcher

    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return round(100 * SequenceMatcher(None, line, answer).ratio()) / 100


def _number_share(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def _retrieval(prediction: str, answer: str) -> float:
    found = re.findall(r"Paragraph (\d+)", answer)
    return _number_share(prediction, found[0]) if found else 0.0


def _count(prediction: str, answer: str) -> float:
    return _number_share(prediction, answer.strip())




def _ruler_text(text: str) -> str:
    # RULER's post-processing of a prediction: control characters become newlines, then lower case.
    return re.sub(r"[\x00-\x1f]", "\n", text).strip().lower()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER: mean over references of ``ref.lower() in prediction.lower()``."""
    pred = _ruler_text(prediction)
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER: 1.0 when any reference occurs (case-insensitive) in the prediction."""
    pred = _ruler_text(prediction)
    return float(any(a.lower() in pred for a in answers))


@dataclass(frozen=True)
class TaskMetric:
    """One task metric. ``binary``: every score is 0 or 1 (else anywhere in [0, 1]); ``scorer``: the score of a
    decoded prediction against one answer (the best over answers counts), or None for a metric the engine
    computes from logits; ``list_scorer``: a score against the whole reference list at once (RULER's)."""

    name: str
    binary: bool
    scorer: Callable[[str, str], float] | None = None
    list_scorer: Callable[[str, list[str]], float] | None = None


#: Every task metric, by name.
TASK_METRICS: dict[str, TaskMetric] = {m.name: m for m in (
    TaskMetric("substring", binary=True, scorer=_substring),
    TaskMetric("exact", binary=True, scorer=_exact),
    TaskMetric("f1", binary=False, scorer=_f1),
    TaskMetric("string_match_all", binary=False, list_scorer=string_match_all),
    TaskMetric("string_match_part", binary=True, list_scorer=string_match_part),
    TaskMetric("rouge_l", binary=False, scorer=_rouge_l),
    TaskMetric("code_sim", binary=False, scorer=_code_sim),
    TaskMetric("retrieval_score", binary=False, scorer=_retrieval),
    TaskMetric("count_score", binary=False, scorer=_count),
    TaskMetric("token_accuracy", binary=False),  # fraction of gold tokens the model predicts (kvbench.engine)
)}
#: Metrics scored from decoded text, by :func:`score`.
TEXT_METRICS: tuple[str, ...] = tuple(n for n, m in TASK_METRICS.items() if m.scorer or m.list_scorer)
_SCORERS = {n: m.scorer for n, m in TASK_METRICS.items() if m.scorer is not None}
_LIST_SCORERS = {n: m.list_scorer for n, m in TASK_METRICS.items() if m.list_scorer is not None}


def score(metric: str, prediction: str, answers: list[str]) -> float:
    """Score ``prediction`` against every answer with ``metric``; return the best score."""
    if metric == "token_accuracy":
        raise KVBenchError("metric 'token_accuracy' is computed by the engine from logits, not from decoded text")
    if metric not in _SCORERS and metric not in _LIST_SCORERS:
        raise KVBenchError(f"unknown text metric {metric!r}; valid: {', '.join(TEXT_METRICS)}")
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise KVBenchError("score() needs at least one reference answer")
    if metric in _LIST_SCORERS:
        return _LIST_SCORERS[metric](prediction, [str(a) for a in answers])
    return max(_SCORERS[metric](prediction, a) for a in answers)
