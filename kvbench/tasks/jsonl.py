"""``jsonl``: LongBench/RULER-style question answering from a JSON Lines file.

Each row has ``context``, a question in ``input`` or ``question``, and ``answers`` (a list) or
``answer`` (a string); an optional ``id``/``_id`` must be unique. A row may instead carry several questions on
its context as ``multi_turns: [{input, answer}, ...]`` (SCBench's layout); ``task.questions_per_context`` groups
rows that repeat one context (:mod:`kvbench.tasks.shared`). Records name the dataset by
``task.dataset_name`` (default: the file's stem). The file is read line by line as UTF-8 JSON objects
(no cache in between: the run identity hashes the same bytes the samples come from). Contexts longer
than the budget are truncated in the middle (LongBench convention: the start and end of a document
carry most of its framing); shorter contexts keep their natural length, so ``len(prefix_ids)`` is at
most ``context_tokens`` here rather than exactly it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.base import Sample, TaskInputs, answer_list, register_task
from kvbench.tasks.metrics import TEXT_METRICS
from kvbench.tasks.shared import Context, Question, document_meta, group_by_text, qa_samples, sharing
from kvbench.tasks.suite import option

JSONL_DEFAULTS: dict[str, Any] = {
    "context_tokens": 2048,
    "n_samples": 10,
    "metric": "substring",
    "query_aware": None,  # null: false when questions share a context (kvbench/tasks/shared.py), else true
    "questions_per_context": None,  # K > 1: rows with the same context text are one context (null: 1; a row's turns)
    "shared_context": "multi_request",  # multi_request | multi_turn: how a context's questions are asked
    "max_new_tokens": 32,
    "instruction": "Read the context and answer the question concisely.",
    "answer_prefix": "",
    "seed": 0,
    "dataset_name": None,  # the name records carry as `task` (None: the file stem)
    # the key naming the work a row's context is cut from: contexts of one work are one cluster of the intervals
    # (spec v1.2 §2.2); a row without it is its own
    "document_field": "document_id",
}


def _rows(path: str) -> list[dict[str, Any]]:
    file = Path(path).expanduser()
    if not file.is_file():
        raise KVBenchError(f"task.path={path!r} is not a file; point it at a .jsonl file with context/input/answers")
    rows = []
    for n, raw in enumerate(file.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise KVBenchError(f"cannot read {file} as JSON Lines (line {n}: {type(exc).__name__})") from None
        if not isinstance(row, dict):
            raise KVBenchError(f"cannot read {file} as JSON Lines (line {n} is not a JSON object)")
        rows.append(row)
    return rows


def _row_id(row: dict[str, Any]) -> str:
    """The row's ``_id``, else its ``id`` ('' when it has neither; an id of 0 is an id)."""
    value = row.get("_id")
    value = row.get("id") if value in (None, "") else value
    return "" if value is None else str(value)


def _answers(row: dict[str, Any], i: int) -> list[str]:
    value = row.get("answers")
    if value is None:
        value = row.get("answer")
    answers = answer_list(value, f"row {i} of the jsonl task")
    if not answers:
        raise KVBenchError(f"row {i} of the jsonl task has no 'answers' (list) or 'answer' (string)")
    return answers


@register_task("jsonl", inputs=TaskInputs(files=("path",)))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """One context per row (the first ``n_samples``, in file order); with ``questions_per_context`` > 1, rows
    sharing a context's text are one context, and a row's ``multi_turns`` are its questions
    (:mod:`kvbench.tasks.shared`)."""
    path = cfg.get("path", None)
    if not path or path == "???":
        raise KVBenchError("task jsonl needs task.path=<file.jsonl>")
    metric = str(option(cfg, "metric", JSONL_DEFAULTS))
    if metric not in TEXT_METRICS:
        raise KVBenchError(f"task.metric={metric!r} is not valid for jsonl; valid: {', '.join(TEXT_METRICS)}")
    n = int(option(cfg, "n_samples", JSONL_DEFAULTS))
    max_new = int(option(cfg, "max_new_tokens", JSONL_DEFAULTS))
    all_rows = _rows(str(path))
    turns = any("multi_turns" in r for r in all_rows[:n])
    k, query_aware, mode = sharing(cfg, turns)
    doc_f = str(option(cfg, "document_field", JSONL_DEFAULTS) or "")
    base = {"task": "jsonl", "variant": "qa", "seed": int(option(cfg, "seed", JSONL_DEFAULTS)), "depth": None,
            "needle_token_index": None, "distractors": 0}

    def context_of(i: int, row: dict[str, Any]) -> str:
        if not isinstance(row.get("context"), str):
            raise KVBenchError(f"row {i} of {path} has no string 'context'")
        return row["context"]

    def question(i: int, row: dict[str, Any], sample_id: str, text: Any, answers: list[str]) -> Question:
        return Question(sample_id=sample_id, text="" if text is None else str(text), answers=answers, metric=metric,
                        max_new_tokens=max_new, metadata={**base, "index": i, "dataset": row.get("dataset"),
                                                          "source_docs": [f"{Path(str(path)).name}:{i}"]})

    contexts = []
    if turns:
        for i, row in enumerate(all_rows[:n]):
            key = _row_id(row) or f"{i:03d}"
            items = row.get("multi_turns")
            if not isinstance(items, list) or not items or not all(isinstance(t, dict) for t in items):
                raise KVBenchError(f"row {i} of {path}: multi_turns must be a non-empty list of {{input, answer}}")
            qs = [question(i, row, f"jsonl/{key}/q{j}", t.get("input", t.get("question")), _answers(t, i))
                  for j, t in enumerate(items[:k] if k else items)]
            contexts.append(Context(context_of(i, row), qs, context_id=f"jsonl/{key}",
                                    metadata=document_meta(row, doc_f)))
    else:
        if (k or 1) > 1:
            groups = group_by_text([r.get("context") if isinstance(r.get("context"), str) else "" for r in all_rows],
                                   int(k or 1), n)
        else:
            groups = [[i] for i in range(min(n, len(all_rows)))]
        for group in groups:
            qs = []
            for i in group:
                row = all_rows[i]
                row_id = _row_id(row)
                text = row.get("input") if row.get("input") is not None else row.get("question")
                qs.append(question(i, row, f"jsonl/{row_id}" if row_id else f"jsonl/{i:03d}", text,
                                   _answers(row, i)))
            first = all_rows[group[0]]
            shared_id = f"jsonl/context/{_row_id(first) or group[0]}" if (k or 1) > 1 else None
            contexts.append(Context(context_of(group[0], first), qs, context_id=shared_id,
                                    metadata=document_meta(first, doc_f)))
    samples = qa_samples(contexts, tokenizer, context_tokens=int(option(cfg, "context_tokens", JSONL_DEFAULTS)),
                         query_aware=query_aware, instruction=str(option(cfg, "instruction", JSONL_DEFAULTS)),
                         answer_prefix=str(option(cfg, "answer_prefix", JSONL_DEFAULTS)), mode=mode)
    if not samples:
        raise KVBenchError(f"{path} holds no rows")
    counts = Counter(s.sample_id for s in samples)
    dupes = sorted(sid.split("/", 1)[1] for sid, c in counts.items() if c > 1)
    if dupes:
        # Rows sharing an id would collapse into one record and share one stored baseline.
        raise KVBenchError(f"{path} has duplicate ids: {', '.join(dupes[:10])}{' ...' if len(dupes) > 10 else ''}; "
                           "give every row a unique 'id' (or '_id')")
    return samples
