"""Sample builders shared by the real-text tasks (legal, papers, fiction, custom).

Two variants over the same documents:

* ``retrieval`` — a needle statement at a requested token depth among ``distractors`` near-identical
  statements; the question names the needle's key; scored by ``substring`` on the decoded reply.
* ``continuation`` — long-range language modelling: ``context_tokens`` of real text are the prefix,
  the next ``query_tokens`` are the query and the ``continuation_tokens`` after them are the gold,
  scored by ``token_accuracy`` (engine, from logits).

Every sample is a pure function of (task name, config, seed, sample index, tokenizer): each sample
draws from its own ``random.Random`` seeded with a string, never from global RNG state.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.base import Sample
from kvbench.tasks.corpora import Document
from kvbench.tasks.haystack import Insert, break_ranks, draw_filler, spread_targets, weave
from kvbench.tasks.needles import FAMILIES, sample_needle_set, sample_needles
from kvbench.tasks.prompt import DEFAULT_INSTRUCTION, build_pieces, encode, leading_special_ids

VARIANTS = ("retrieval", "continuation")
# Where distractors go relative to the needle ("before": the needle is the latest statement of its kind).
PLACEMENTS = ("anywhere", "before", "after")
MIN_CONTEXT = 256

# Defaults shared by the task YAMLs; each task module may override some.
DEFAULTS: dict[str, Any] = {
    "variant": "retrieval",
    "context_tokens": 4096,
    "depths": [0.1, 0.5, 0.9],
    "n_samples": 9,
    "distractors": 2,
    "distractor_kind": "other",
    "distractor_placement": "anywhere",
    "query_aware": True,
    "questions_per_context": 1,
    "stop_at_newline": True,
    "answer_prefix": True,
    "seed": 0,
    "max_new_tokens": 12,
    "snap_tokens": 16,
    "query_tokens": 16,
    "continuation_tokens": 64,
    "pool": "all",
    "first_context": 0,
}
#: Document pools (``task.pool``): every work, or one side of a fixed split by work, so that a calibration
#: and the study it calibrates never share a document (nor a part of the same work). The split is a hash of
#: the task and work name: it does not depend on the order of the pool or on which works other tasks hold.
POOLS = ("all", "calibration", "study")
CALIBRATION_SHARE = 64  # of 256: about a quarter of the works calibrate, the rest are the study's
#: Task settings whose default leaves samples as they were before the setting existed: left out of the run
#: identity at that value (kvbench.runner), so runs made before them keep their ids.
IDENTITY_NEUTRAL = {"pool": "all", "first_context": 0}


def identity_settings(task_cfg: dict[str, Any]) -> dict[str, Any]:
    """The task settings that name a run: all but those at their :data:`IDENTITY_NEUTRAL` value."""
    return {k: v for k, v in task_cfg.items() if not (k in IDENTITY_NEUTRAL and v == IDENTITY_NEUTRAL[k])}


def option(cfg: Any, key: str, defaults: dict[str, Any]) -> Any:
    """``cfg[key]`` if set (not None), else the task's default."""
    value = cfg.get(key, None) if cfg is not None else None
    return defaults[key] if value is None else value


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str | int | float):
        return [value]
    return list(value)


def _insert_text(text: str, form: str) -> str:
    """The statement as its own paragraph; in a play it is spoken by a minor character."""
    if form == "play":
        return f"\nSERVANT.\n{text}\n\n"
    return f"\n{text}\n\n"


def _place_distractors(rng: random.Random, placement: str, budget: int, target: int, needle_len: int,
                       lengths: list[int], gap: int) -> tuple[list[int], str]:
    """Distractor starts for ``placement``; "before"/"after" fall back to "anywhere" when the needle's
    depth leaves no room on that side (e.g. "before" at depth 0). Returns (starts, placement used)."""
    fixed = [(target, needle_len)]
    windows = {"before": (0, max(0, target - gap)), "after": (min(budget, target + needle_len + gap), budget),
               "anywhere": (0, budget)}
    for used in (placement, "anywhere"):
        starts = spread_targets(rng, windows[used], fixed, lengths, gap)
        if starts is not None:
            return starts, used
    raise KVBenchError(f"cannot place {len(lengths)} distractors {gap} tokens apart in a {budget}-token document; "
                       "lower task.distractors or raise task.context_tokens")


def pool_documents(task: str, docs: Sequence[Document], pool: str) -> list[Document]:
    """The documents of ``pool`` (:data:`POOLS`): a split by work, stable whatever else the pool holds."""
    if pool not in POOLS:
        raise KVBenchError(f"unknown task.pool {pool!r}; valid: {', '.join(POOLS)}")
    if pool == "all":
        return list(docs)
    side = [d for d in docs if (hashlib.sha256(f"{task}:{d.work}".encode()).digest()[0] < CALIBRATION_SHARE)
            == (pool == "calibration")]
    if not side:
        raise KVBenchError(f"task.pool={pool} holds no document of {task}'s {len(docs)}; use task.pool=all")
    return side


def build_task(task: str, cfg: Any, tokenizer: Any, max_context: int, docs: Sequence[Document],
               defaults: dict[str, Any], random_start: bool) -> list[Sample]:
    """Dispatch on ``cfg.variant``, over the documents of ``task.pool``."""
    docs = pool_documents(task, docs, str(option(cfg, "pool", defaults)))
    variant = str(option(cfg, "variant", defaults))
    if variant == "retrieval" and int(option(cfg, "questions_per_context", defaults)) != 1:
        return multi_question_samples(task, cfg, tokenizer, max_context, docs, defaults, random_start)
    if variant == "retrieval":
        return retrieval_samples(task, cfg, tokenizer, max_context, docs, defaults, random_start)
    if variant == "continuation":
        return continuation_samples(task, cfg, tokenizer, max_context, docs, defaults, random_start)
    raise KVBenchError(f"unknown task.variant {variant!r}; valid: {', '.join(VARIANTS)}")


def _common(cfg: Any, defaults: dict[str, Any]) -> tuple[int, range, int]:
    """Context length, the sample indices (``task.first_context`` on, ``task.n_samples`` of them), seed.
    An index names a sample's id and draws its content, so two stores with disjoint ranges share no sample; the
    records' ``index`` counts from the first (a sequential design's looks are prefixes of it)."""
    context_tokens = int(option(cfg, "context_tokens", defaults))
    if context_tokens < MIN_CONTEXT:
        raise KVBenchError(f"task.context_tokens must be >= {MIN_CONTEXT} (got {context_tokens})")
    n = int(option(cfg, "n_samples", defaults))
    if n < 1:
        raise KVBenchError(f"task.n_samples must be >= 1 (got {n})")
    first = int(option(cfg, "first_context", defaults))
    if first < 0:
        raise KVBenchError(f"task.first_context must be >= 0 (got {first})")
    return context_tokens, range(first, first + n), int(option(cfg, "seed", defaults))


def retrieval_samples(task: str, cfg: Any, tokenizer: Any, max_context: int, docs: Sequence[Document],
                      defaults: dict[str, Any], random_start: bool) -> list[Sample]:
    """Needle-among-distractors samples with exact prefix length and the needle at each asked depth."""
    context_tokens, n, seed = _common(cfg, defaults)
    depths = [float(d) for d in _as_list(option(cfg, "depths", defaults))]
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise KVBenchError(f"task.depths must be a non-empty list of numbers in [0, 1] (got {depths})")
    families = [str(f) for f in _as_list(option(cfg, "needles", defaults))]
    for fam in families:
        if fam not in FAMILIES:
            raise KVBenchError(f"unknown needle family {fam!r} in task.needles; valid: {', '.join(sorted(FAMILIES))}")
    n_distractors = int(option(cfg, "distractors", defaults))
    query_aware = bool(option(cfg, "query_aware", defaults))
    use_prefix = bool(option(cfg, "answer_prefix", defaults))
    max_new = int(option(cfg, "max_new_tokens", defaults))
    snap = int(option(cfg, "snap_tokens", defaults))
    distractor_kind = str(option(cfg, "distractor_kind", defaults))
    placement = str(option(cfg, "distractor_placement", defaults))
    if placement not in PLACEMENTS:
        raise KVBenchError(f"unknown task.distractor_placement {placement!r}; valid: {', '.join(PLACEMENTS)}")
    instruction = str(option(cfg, "instruction", {"instruction": DEFAULT_INSTRUCTION, **defaults}))
    forms = {d.doc_id: d.form for d in docs}

    samples = []
    for i in n:
        rng = random.Random(f"{task}:retrieval:{seed}:{i}")
        depth = depths[i % len(depths)]
        # Cycle families across depth sweeps so every depth sees every family.
        family = families[(i // len(depths)) % len(families)]
        needle, distractors = sample_needles(family, rng, n_distractors, distractor_kind)
        pieces = build_pieces(tokenizer, needle.question, needle.answer_prefix if use_prefix else "", instruction)
        budget = pieces.document_budget(context_tokens, query_aware)
        # Statements read like the first document (a speech in a play, a paragraph elsewhere), so the
        # filler is drawn first at full budget and trimmed once the inserts' lengths are known.
        filler = draw_filler(tokenizer, docs, random.Random(f"{task}:filler:{seed}:{i}"), budget, random_start,
                             index=i, spread_key=f"{task}:{seed}")
        form = forms[filler.sources[0]["doc_id"]]
        needle_ids = encode(tokenizer, _insert_text(needle.text, form))
        dist_ids = [encode(tokenizer, _insert_text(d.text, form)) for d in distractors]
        inserted = len(needle_ids) + sum(len(d) for d in dist_ids)
        if budget - inserted < MIN_CONTEXT // 2:
            need = context_tokens - budget + inserted + MIN_CONTEXT // 2  # prompt + inserts + the least filler
            raise KVBenchError(f"task.context_tokens={context_tokens} is too short for {task}: the prompt takes "
                               f"{context_tokens - budget} tokens, the needle and {n_distractors} distractors "
                               f"{inserted}, and at least {MIN_CONTEXT // 2} tokens of document must surround them; "
                               f"use task.context_tokens >= {need}")
        target = round(depth * (budget - len(needle_ids)))
        dist_targets, used_placement = _place_distractors(rng, placement, budget, target, len(needle_ids),
                                                          [len(d) for d in dist_ids], 2 * snap + 8)
        filler = filler.truncate(budget - inserted)
        inserts = [Insert(needle_ids, target, "needle")] + [
            Insert(ids, t, "distractor") for ids, t in zip(dist_ids, dist_targets, strict=True)]
        region, starts = weave(filler.ids, break_ranks(tokenizer, filler.ids), inserts, snap)
        prefix, query = pieces.assemble(region, query_aware)
        sample_id = f"{task}/retrieval/{i:03d}"
        doc_start = len(pieces.head)
        samples.append(Sample(
            sample_id=sample_id, prefix_ids=prefix, query_ids=query,
            gold_ids=pieces.gold_ids(tokenizer, needle.gold), answers=list(needle.answers), metric="substring",
            max_new_tokens=max_new, stop_at_newline=bool(option(cfg, "stop_at_newline", defaults)),
            metadata={
                "task": task, "variant": "retrieval", "template": pieces.template, "seed": seed, "index": i - n.start,
                "context_tokens": len(prefix), "query_aware": query_aware, "answer_prefix": use_prefix,
                "depth": depth, "needle_token_index": doc_start + starts[0],
                "needle_depth": starts[0] / max(1, budget - len(needle_ids)), "needle_tokens": len(needle_ids),
                "document_span": [doc_start, doc_start + budget],
                "distractors": len(distractors), "distractor_placement": used_placement,
                "distractor_kind": distractor_kind, "needle_kind": needle.kind,
                "distractor_kinds": [d.kind for d in distractors],
                "distractor_token_indices": [doc_start + s for s in starts[1:]],
                "distractor_values": [d.value for d in distractors],
                "needle_family": family, "needle_key": needle.key, "needle_text": needle.text,
                "question": needle.question, "answer_prefix_text": needle.answer_prefix if use_prefix else "",
                "form": form, "document_id": filler.document_id, "work_id": filler.work_id,
                "source_docs": [s["doc_id"] for s in filler.sources],
                "source_offsets": [s["char_start"] for s in filler.sources],
            }))
    return samples


def continuation_samples(task: str, cfg: Any, tokenizer: Any, max_context: int, docs: Sequence[Document],
                         defaults: dict[str, Any], random_start: bool) -> list[Sample]:
    """Held-out continuation of real text after ``context_tokens`` of it (raw text, no chat template)."""
    context_tokens, n, seed = _common(cfg, defaults)
    q_len = int(option(cfg, "query_tokens", defaults))
    g_len = int(option(cfg, "continuation_tokens", defaults))
    if q_len < 1 or g_len < 1:
        raise KVBenchError(f"task.query_tokens and task.continuation_tokens must be >= 1 (got {q_len}, {g_len})")
    lead = leading_special_ids(tokenizer)
    samples = []
    for i in n:
        rng = random.Random(f"{task}:continuation:{seed}:{i}")
        body = context_tokens - len(lead)
        filler = draw_filler(tokenizer, docs, rng, body + q_len + g_len, random_start, index=i,
                             spread_key=f"{task}:{seed}")
        ids = filler.ids
        prefix, query, gold = lead + ids[:body], ids[body:body + q_len], ids[body + q_len:]
        sample_id = f"{task}/continuation/{i:03d}"
        samples.append(Sample(
            sample_id=sample_id, prefix_ids=prefix, query_ids=query, gold_ids=gold,
            answers=[tokenizer.decode(gold)], metric="token_accuracy", max_new_tokens=g_len,
            metadata={
                "task": task, "variant": "continuation", "template": "raw", "seed": seed, "index": i - n.start,
                "context_tokens": len(prefix), "query_aware": False, "depth": None, "needle_token_index": None,
                "distractors": 0, "query_tokens": q_len, "continuation_tokens": g_len,
                "document_id": filler.document_id, "work_id": filler.work_id,
                "source_docs": [s["doc_id"] for s in filler.sources],
                "source_offsets": [s["char_start"] for s in filler.sources],
            }))
    return samples


def multi_question_samples(task: str, cfg: Any, tokenizer: Any, max_context: int, docs: Sequence[Document],
                           defaults: dict[str, Any], random_start: bool) -> list[Sample]:
    """``questions_per_context`` (K) needles in one context, each asked separately after compression.

    Query-agnostic only: the question is not part of the compressed prefix, so one prefill and one
    compression per (context, strategy) serve K paired questions (the engine answers each from its own copy
    of the compressed cache). Needle ``j`` of K lies at a depth drawn uniformly from the middle 70% of the
    ``j``-th of K equal depth strata, so the K needles cover the document from start to end; each needle
    keeps its own ``distractors``, and every statement of the context is distinct in (family, key) and
    value. ``task.n_samples`` counts contexts: the task yields ``n_samples * K`` questions, with ids
    ``<context id>/q<j>`` and a shared ``context_id`` (intervals cluster on it, spec §2).
    """
    context_tokens, n, seed = _common(cfg, defaults)
    k_questions = int(option(cfg, "questions_per_context", defaults))
    if k_questions < 1:
        raise KVBenchError(f"task.questions_per_context must be >= 1 (got {k_questions})")
    if bool(option(cfg, "query_aware", defaults)):
        raise KVBenchError(f"task.questions_per_context={k_questions} needs task.query_aware=false: a query-aware "
                           "prefix holds its one question, so each question needs its own prefill")
    families = [str(f) for f in _as_list(option(cfg, "needles", defaults))]
    for fam in families:
        if fam not in FAMILIES:
            raise KVBenchError(f"unknown needle family {fam!r} in task.needles; valid: {', '.join(sorted(FAMILIES))}")
    n_distractors = int(option(cfg, "distractors", defaults))
    use_prefix = bool(option(cfg, "answer_prefix", defaults))
    max_new = int(option(cfg, "max_new_tokens", defaults))
    snap = int(option(cfg, "snap_tokens", defaults))
    distractor_kind = str(option(cfg, "distractor_kind", defaults))
    instruction = str(option(cfg, "instruction", {"instruction": DEFAULT_INSTRUCTION, **defaults}))
    forms = {d.doc_id: d.form for d in docs}
    gap = 2 * snap + 8

    samples = []
    for c in n:
        rng = random.Random(f"{task}:multi:{seed}:{k_questions}:{c}")
        picked = [families[(c * k_questions + j) % len(families)] for j in range(k_questions)]
        groups = sample_needle_set(picked, rng, n_distractors, distractor_kind)
        pieces = [build_pieces(tokenizer, nd.question, nd.answer_prefix if use_prefix else "", instruction)
                  for nd, _ in groups]
        head = pieces[0].head
        if any(p.head != head for p in pieces):  # the shared prefix must not depend on the question
            raise KVBenchError("the prompt head depends on the question; questions cannot share a context")
        budget = pieces[0].document_budget(context_tokens, query_aware=False)
        filler = draw_filler(tokenizer, docs, random.Random(f"{task}:filler:{seed}:{c}"), budget, random_start,
                             index=c, spread_key=f"{task}:{seed}")
        form = forms[filler.sources[0]["doc_id"]]
        needle_ids = [encode(tokenizer, _insert_text(nd.text, form)) for nd, _ in groups]
        dist_ids = [[encode(tokenizer, _insert_text(d.text, form)) for d in ds] for _, ds in groups]
        inserted = sum(len(x) for x in needle_ids) + sum(len(d) for ds in dist_ids for d in ds)
        if budget - inserted < MIN_CONTEXT // 2:
            raise KVBenchError(
                f"task.context_tokens={context_tokens} leaves {budget} document tokens, too few for "
                f"{k_questions} needles with {n_distractors} distractors each ({inserted} tokens); it needs at "
                f"least {context_tokens - budget + inserted + MIN_CONTEXT // 2}")
        depths = [(j + rng.uniform(0.15, 0.85)) / k_questions for j in range(k_questions)]
        targets = [round(d * (budget - len(ids))) for d, ids in zip(depths, needle_ids, strict=True)]
        spans = sorted(zip(targets, (len(x) for x in needle_ids), strict=True))
        if any(a + la + gap > b for (a, la), (b, _) in zip(spans, spans[1:], strict=False)):
            raise KVBenchError(f"task.context_tokens={context_tokens} is too short to keep {k_questions} needles "
                               f"{gap} tokens apart; lower task.questions_per_context")
        flat = [ids for ds in dist_ids for ids in ds]
        dist_targets = spread_targets(rng, (0, budget), spans, [len(x) for x in flat], gap)
        if dist_targets is None:
            raise KVBenchError(f"cannot place {len(flat)} distractors {gap} tokens apart in a {budget}-token "
                               "document; lower task.distractors or task.questions_per_context")
        filler = filler.truncate(budget - inserted)
        inserts = [Insert(ids, t, "needle") for ids, t in zip(needle_ids, targets, strict=True)] + [
            Insert(ids, t, "distractor") for ids, t in zip(flat, dist_targets, strict=True)]
        region, starts = weave(filler.ids, break_ranks(tokenizer, filler.ids), inserts, snap)
        doc_start = len(head)
        prefix = head + region
        context_id = f"{task}/retrieval/{c:03d}"
        owner = [j for j, ds in enumerate(dist_ids) for _ in ds]  # which needle each distractor belongs to
        for j, (needle, distractors) in enumerate(groups):
            _, query = pieces[j].assemble(region, query_aware=False)
            mine = [doc_start + s for s, o in zip(starts[k_questions:], owner, strict=True) if o == j]
            samples.append(Sample(
                sample_id=f"{context_id}/q{j}", prefix_ids=prefix, query_ids=query,
                gold_ids=pieces[j].gold_ids(tokenizer, needle.gold), answers=list(needle.answers),
                metric="substring", max_new_tokens=max_new,
                stop_at_newline=bool(option(cfg, "stop_at_newline", defaults)),
                metadata={
                    "task": task, "variant": "retrieval", "template": pieces[j].template, "seed": seed,
                    "index": c - n.start,
                    "context_id": context_id, "question_index": j, "questions_per_context": k_questions,
                    "document_id": filler.document_id, "work_id": filler.work_id,
                    "context_tokens": len(prefix), "query_aware": False, "answer_prefix": use_prefix,
                    "depth": depths[j], "needle_token_index": doc_start + starts[j],
                    "needle_depth": starts[j] / max(1, budget - len(needle_ids[j])),
                    "needle_tokens": len(needle_ids[j]), "document_span": [doc_start, doc_start + budget],
                    "distractors": len(distractors), "distractor_placement": "anywhere",
                    "distractor_kind": distractor_kind, "needle_kind": needle.kind,
                    "distractor_kinds": [d.kind for d in distractors], "distractor_token_indices": mine,
                    "distractor_values": [d.value for d in distractors],
                    "other_needle_token_indices": [doc_start + starts[i] for i in range(k_questions) if i != j],
                    "needle_family": needle.family, "needle_key": needle.key, "needle_text": needle.text,
                    "question": needle.question,
                    "answer_prefix_text": needle.answer_prefix if use_prefix else "", "form": form,
                    "source_docs": [s["doc_id"] for s in filler.sources],
                    "source_offsets": [s["char_start"] for s in filler.sources],
                }))
    return samples
