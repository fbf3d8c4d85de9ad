"""``jsonl``: LongBench/RULER-style question answering from a JSON Lines file.

Each row has ``context``, a question in ``input`` or ``question``, and ``answers`` (a list) or
``answer`` (a string); an optional ``id``/``_id`` must be unique. Records name the dataset by
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
from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.metrics import TEXT_METRICS
from kvbench.tasks.prompt import build_pieces, encode, truncate_middle
from kvbench.tasks.suite import option

JSONL_DEFAULTS: dict[str, Any] = {
    "context_tokens": 2048,
    "n_samples": 10,
    "metric": "substring",
    "query_aware": True,
    "max_new_tokens": 32,
    "instruction": "Read the context and answer the question concisely.",
    "answer_prefix": "",
    "seed": 0,
    "dataset_name": None,  # the name records carry as `task` (None: the file stem)
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


def _answers(row: dict[str, Any], i: int) -> list[str]:
    value = row.get("answers")
    if value is None:
        value = row.get("answer")
    if isinstance(value, str):
        value = [value]
    answers = [str(a) for a in (value or []) if a is not None and str(a).strip()]
    if not answers:
        raise KVBenchError(f"row {i} of the jsonl task has no 'answers' (list) or 'answer' (string)")
    return answers


@register_task("jsonl", inputs=TaskInputs(files=("path",)))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """One sample per row (the first ``n_samples`` rows, in file order)."""
    path = cfg.get("path", None)
    if not path or path == "???":
        raise KVBenchError("task jsonl needs task.path=<file.jsonl>")
    metric = str(option(cfg, "metric", JSONL_DEFAULTS))
    if metric not in TEXT_METRICS:
        raise KVBenchError(f"task.metric={metric!r} is not valid for jsonl; valid: {', '.join(TEXT_METRICS)}")
    context_tokens = int(option(cfg, "context_tokens", JSONL_DEFAULTS))
    n = int(option(cfg, "n_samples", JSONL_DEFAULTS))
    query_aware = bool(option(cfg, "query_aware", JSONL_DEFAULTS))
    max_new = int(option(cfg, "max_new_tokens", JSONL_DEFAULTS))
    instruction = str(option(cfg, "instruction", JSONL_DEFAULTS))
    answer_prefix = str(option(cfg, "answer_prefix", JSONL_DEFAULTS))
    seed = int(option(cfg, "seed", JSONL_DEFAULTS))

    samples = []
    for i, row in enumerate(_rows(str(path))[:n]):
        context = row.get("context")
        if not isinstance(context, str):
            raise KVBenchError(f"row {i} of {path} has no string 'context'")
        question = row.get("input")
        if question is None:
            question = row.get("question")
        question = "" if question is None else str(question)
        answers = _answers(row, i)
        pieces = build_pieces(tokenizer, question, answer_prefix, instruction, document_label="Context")
        budget = pieces.document_budget(context_tokens, query_aware)
        if budget < 1:
            raise KVBenchError(f"task.context_tokens={context_tokens} leaves no room for row {i}'s context "
                               f"after its {context_tokens - budget}-token prompt and question")
        ctx_ids = encode(tokenizer, context)
        document = truncate_middle(ctx_ids, budget)
        prefix, query = pieces.assemble(document, query_aware)
        row_id = row.get("_id") or row.get("id")
        samples.append(Sample(
            sample_id=f"jsonl/{row_id}" if row_id else f"jsonl/{i:03d}",
            prefix_ids=prefix, query_ids=query, gold_ids=pieces.gold_ids(tokenizer, answers[0]),
            answers=answers, metric=metric, max_new_tokens=max_new,
            metadata={
                "task": "jsonl", "variant": "qa", "template": pieces.template, "seed": seed, "index": i,
                "context_tokens": len(prefix), "query_aware": query_aware, "depth": None,
                "needle_token_index": None, "distractors": 0, "source_docs": [f"{Path(str(path)).name}:{i}"],
                "original_context_tokens": len(ctx_ids), "truncated": len(ctx_ids) > budget,
                "question": question, "dataset": row.get("dataset"),
            }))
    if not samples:
        raise KVBenchError(f"{path} holds no rows")
    counts = Counter(s.sample_id for s in samples)
    dupes = sorted(sid.split("/", 1)[1] for sid, c in counts.items() if c > 1)
    if dupes:
        # Rows sharing an id would collapse into one record and share one stored baseline.
        raise KVBenchError(f"{path} has duplicate ids: {', '.join(dupes[:10])}{' ...' if len(dupes) > 10 else ''}; "
                           "give every row a unique 'id' (or '_id')")
    return samples
