"""Question answering over given contexts, one or several questions per context (``hf``, ``jsonl``).

A dataset row gives a context and one question (LongBench's layout) or a context and several turns (SCBench's
``multi_turns``, Li et al. 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods", ICLR 2025).
``task.questions_per_context`` (K) decides how questions meet contexts:

* K = 1 (a question-per-row dataset's default): every row is its own context, prefilled and compressed for its
  one question, which may be part of the compressed prefix (``query_aware``);
* K > 1: rows whose context is the same text are one context (in order of first appearance), and its first K
  questions are asked of it; a row with ``multi_turns`` is one context with its first K turns (all of them when
  K is unset). The questions come after compression (query-agnostic, as SCBench's shared-context modes), so one
  prefill and one compression per (context, strategy) serve all of them (:func:`kvbench.loop.run_samples`).

``task.shared_context`` states how the questions of one context are asked (SCBench's two modes):

* ``multi_request`` — each question alone on the compressed context (SCBench's ``--same_context_different_query``);
* ``multi_turn`` — question j comes after the earlier questions of the context and their reference answers
  (SCBench's default, with its golden answers as the history), written into the query after compression. SCBench
  itself prefills the first question with the context and keeps every turn in the cache; here the context alone
  is compressed and the history is part of each question's uncompressed query.

Questions of one context share a ``context_id`` and a ``document_id``: the data's own (a ``document_id`` column,
or the one ``task.document_field`` names: contexts cut from one work are one cluster), else the context.
Intervals cluster on it (docs/measurement-spec.md §2.2), as for the built-in multi-question tasks. Each sample
records the ``task.context_tokens`` it was built under as ``context_budget``: its length band
(:mod:`kvbench.bands`), since contexts keep their natural lengths under it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.base import Sample
from kvbench.tasks.prompt import build_pieces, encode, truncate_middle

MODES = ("multi_request", "multi_turn")


@dataclass
class Question:
    sample_id: str
    text: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    text: str
    questions: list[Question]
    #: None: a context of one question asked on its own (its sample id is its context); else the shared id.
    context_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def sharing(cfg: Any, turns: bool) -> tuple[int | None, bool, str]:
    """``(K, query_aware, mode)`` from ``questions_per_context``, ``query_aware`` and ``shared_context``.

    K None means every turn of a ``multi_turns`` row. ``query_aware`` unset is false when questions share a
    context (K > 1, or turns) and true otherwise; set true with shared questions it is refused."""
    k = cfg.get("questions_per_context", None)
    if k is not None:
        k = int(k)
        if k < 1:
            raise KVBenchError(f"task.questions_per_context must be >= 1 (got {k})")
    mode = str(cfg.get("shared_context", None) or "multi_request")
    if mode not in MODES:
        raise KVBenchError(f"unknown task.shared_context {mode!r}; valid: {', '.join(MODES)}")
    shared = turns or (k or 1) > 1
    qa = cfg.get("query_aware", None)
    if qa is None:
        return k, not shared, mode
    if bool(qa) and shared and (k is None or k > 1):
        raise KVBenchError(f"task.questions_per_context={k if k is not None else 'all turns'} needs "
                           "task.query_aware=false (or unset): a query-aware prefix holds its one question, so "
                           "each question would need its own prefill")
    return k, bool(qa), mode


def group_by_text(texts: list[str], k: int, n: int) -> list[list[int]]:
    """Indices of ``texts`` grouped by equal text, in order of first appearance: the first ``n`` groups, each
    with its first ``k`` members. Refuses a grouping that shares nothing (K > 1 would silently mean K = 1)."""
    groups: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        if text in groups:
            if len(groups[text]) < k:
                groups[text].append(i)
        elif len(groups) < n:
            groups[text] = [i]
    out = list(groups.values())
    if k > 1 and out and all(len(g) == 1 for g in out):
        raise KVBenchError(f"task.questions_per_context={k}: no two of the first rows share a context; rows that "
                           "ask about one document must repeat its text in the context column (or give the "
                           "questions as a row's multi_turns, task.preset=scbench)")
    return out


def document_meta(row: dict[str, Any], column: str | None) -> dict[str, Any]:
    """``{"document_id": ...}`` from ``row[column]`` when the row names its work there, else nothing."""
    value = row.get(column) if column else None
    return {"document_id": str(value)} if value not in (None, "") else {}


def _history(questions: list[Question], j: int, mode: str) -> str:
    """Question j's text; in multi-turn mode after the earlier questions and their reference answers."""
    if mode != "multi_turn" or j == 0:
        return questions[j].text
    turns = [f"{q.text}\nAnswer: {q.answers[0]}" for q in questions[:j]]
    return "\n\nQuestion: ".join([*turns, questions[j].text])


def qa_samples(contexts: list[Context], tokenizer: Any, *, context_tokens: int, query_aware: bool,
               instruction: str, answer_prefix: str, mode: str = "multi_request",
               stop_at_newline: bool = False) -> list[Sample]:
    """The samples of ``contexts``: each context truncated in the middle to the budget once, its questions
    sharing that prefix (and the ``context_id``) when it has an id."""
    samples = []
    for c in contexts:
        pieces = []
        for j in range(len(c.questions)):
            text = _history(c.questions, j, mode)
            p = build_pieces(tokenizer, text, answer_prefix, instruction, document_label="Context")
            if not text:  # summarisation / code completion rows ask nothing beyond the instruction
                p = dataclasses.replace(p, question=[])
            pieces.append(p)
        if any(p.head != pieces[0].head for p in pieces):
            raise KVBenchError("the prompt head depends on the question; questions cannot share a context")
        budget = pieces[0].document_budget(context_tokens, query_aware)
        if budget < 1:
            raise KVBenchError(f"task.context_tokens={context_tokens} leaves no room for the context of "
                               f"{c.questions[0].sample_id} after its {context_tokens - budget}-token prompt")
        ctx_ids = encode(tokenizer, c.text)
        document = truncate_middle(ctx_ids, budget)
        for j, (q, p) in enumerate(zip(c.questions, pieces, strict=True)):
            prefix, query = p.assemble(document, query_aware)
            meta = {**c.metadata, **q.metadata, "template": p.template, "context_tokens": len(prefix),
                    "query_aware": query_aware, "original_context_tokens": len(ctx_ids),
                    "truncated": len(ctx_ids) > budget, "truncation": "middle", "question": q.text,
                    "context_budget": context_tokens}
            if c.context_id is not None:
                meta.update(context_id=c.context_id, document_id=c.metadata.get("document_id") or c.context_id,
                            question_index=j, questions_per_context=len(c.questions), shared_context=mode)
            samples.append(Sample(
                sample_id=q.sample_id, prefix_ids=prefix, query_ids=query,
                gold_ids=p.gold_ids(tokenizer, q.answers[0]), answers=q.answers, metric=q.metric,
                max_new_tokens=q.max_new_tokens, stop_at_newline=stop_at_newline, metadata=meta))
    return samples
