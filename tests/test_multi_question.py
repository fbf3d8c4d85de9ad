"""Several questions per context: one prefill and one compression per (context, strategy), answers equal to
one single-question run per question on the same compressed cache (registry-wide)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvbench import strategies
from kvbench.cache import KVBenchCache
from kvbench.engine import Engine, attached, can_clone, clone_cache, query_window_for
from kvbench.loop import run_samples
from kvbench.models import ByteTokenizer, LoadedModel
from kvbench.tasks.base import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")

TINY = {"group_size": 8, "residual_length": 8, "residual_tokens": 8, "recompute_tokens": 16, "block_size": 8,
        "quant_group_size": 8, "block_tokens": 16, "recent_tokens": 16, "decode_evict": True}
QUESTIONS = [(b"Q?", b"ab", 5), (b"What is it?", b"xyzw", 7), (b"Hm", b"k", 6)]


def _tiny(name: str) -> strategies.Strategy:
    names = {f.name for f in dataclasses.fields(strategies.strategy_class(name))}
    return strategies.build(name, {k: v for k, v in TINY.items() if k in names})


def _context(prefix_len: int = 120, context: str = "c0", seed: int = 7) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, 255, (prefix_len,), generator=g).tolist()
    return [Sample(sample_id=f"{context}/q{i}", prefix_ids=prefix, query_ids=list(q), gold_ids=list(a),
                   answers=[a.decode()], metric="substring", max_new_tokens=n,
                   metadata={"context_id": context, "document_id": f"doc-{context}"})
            for i, (q, a, n) in enumerate(QUESTIONS)]


@pytest.fixture
def engine(tiny_model):
    return Engine(LoadedModel("tiny-llama", tiny_model, ByteTokenizer()), run_fields={"task": "unit"})


def _comparable(record: dict) -> dict:
    drop = ("_s", "_ms_per_token", "peak_bytes")
    out = {k: v for k, v in record.items() if not any(d in k for d in drop)}
    out["stats"] = {k: v for k, v in record["stats"].items() if "seconds" not in k}
    return out


@pytest.mark.parametrize("name", strategies.available())
def test_questions_of_one_context_equal_separate_runs_and_compress_once(engine, name, monkeypatch):
    strategy, questions = _tiny(name), _context()
    window = query_window_for([strategy])
    alone = [engine.evaluate(strategy, q, engine.prefill(q, window), None) for q in questions]
    builds = []
    original = KVBenchCache.from_capture.__func__

    def counting(cls, *args, **kwargs):
        builds.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(KVBenchCache, "from_capture", classmethod(counting))
    shared = engine.evaluate_context(strategy, questions, engine.prefill(questions[0], window),
                                     [None] * len(questions))
    copyable = can_clone(strategy, engine._cache(strategy, engine.prefill(questions[0], window).rows[0])[0],
                         engine.model)
    assert copyable or name in ("hf_quantized", "tiered")  # the two whose stores hold more than tensors
    # compression ran once for the context (plus one build per pass where a cache cannot be copied)
    assert len(builds) == (2 if copyable else 2 + 2 * len(questions))  # teacher forcing, decoding
    for a, b in zip(alone, shared, strict=True):
        ra, rb = _comparable(a.record), _comparable(b.record)
        for key in ("kl", "gold_nll", "top1_agreement", "gold_token_accuracy"):
            assert rb.pop(key) == pytest.approx(ra.pop(key), abs=1e-4), key
        assert ra == rb  # greedy tokens, prediction, score, bytes, held tokens, store statistics
        assert b.record["context_id"] == "c0" and b.record["document_id"] == "doc-c0"


@pytest.mark.parametrize("name", ["int4", "h2o", "quant_recompute", "compose"])
def test_a_clone_is_independent_of_the_original(engine, name):
    strategy, q = _tiny(name), _context()[0]
    pre = engine.prefill(q, query_window_for([strategy]))
    engine.bind(strategy, q.prefix_ids)
    built = KVBenchCache.from_capture(strategy, engine.model.config, pre.keys, pre.values, pre.captures)
    before = [t.clone() for layer in built.layers for t in layer.store.tensors()]
    copy = clone_cache(built, engine.model)
    with torch.inference_mode(), attached(copy, engine.model, strategy):
        engine.greedy(copy, torch.tensor(q.query_ids), 6)
    after = list(t for layer in built.layers for t in layer.store.tensors())
    assert len(before) == len(after) and all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert copy.layers[0].store.strategy is strategy  # the strategy (and its model) is shared, not copied


def test_run_samples_shares_one_prefill_per_context(engine, monkeypatch):
    built = [strategies.build("full"), _tiny("int4"), _tiny("snapkv")]
    samples = _context(context="c0") + _context(context="c1", seed=8)
    prefills = []
    original = engine.prefill

    def counting(batch, window):
        prefills.append(1)
        return original(batch, window)

    monkeypatch.setattr(engine, "prefill", counting)
    grouped: list[dict] = []
    run_samples(engine, samples, built, set(), grouped.extend)
    assert len(prefills) == 2
    monkeypatch.setattr(engine, "prefill", original)
    separate: list[dict] = []
    for s in samples:  # a context of one question each: the per-sample path
        run_samples(engine, [s], built, set(), separate.extend)
    key = [(r["sample_id"], r["strategy_name"]) for r in grouped]
    assert key == [(r["sample_id"], r["strategy_name"]) for r in separate]
    for a, b in zip(grouped, separate, strict=True):
        assert a["prediction"] == b["prediction"] and a["kv_bytes"] == b["kv_bytes"]


def test_resume_runs_only_the_missing_questions_and_limit_keeps_contexts_whole(engine):
    built = [strategies.build("full"), _tiny("int8")]
    samples = _context(context="c0") + _context(context="c1", seed=8)
    out: list[dict] = []
    run_samples(engine, samples, built, {"c0/q1"}, out.extend, max_new=1)
    assert sorted({r["sample_id"] for r in out}) == ["c0/q0", "c0/q2"]


# -- the task side: K needles in one context ------------------------------------------------------------------

PARAGRAPH = ("The committee met in the long room above the library. Several members had travelled far, and "
             "the minutes of the previous meeting were read aloud before any new business was taken.\n"
             "Rain fell all afternoon; the clerk kept the windows shut and the lamps lit.\n\n")


def _custom_samples(tmp_path, **over):
    from kvbench.models import ByteTokenizer as Tok
    from kvbench.tasks.base import build_samples

    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    (d / "a.txt").write_text(PARAGRAPH * 40)
    (d / "b.txt").write_text(PARAGRAPH.replace("committee", "council") * 40)
    cfg = {"name": "custom", "corpus": str(d), "context_tokens": 6000, "n_samples": 3, "distractors": 1,
           "query_aware": False, "questions_per_context": 4, "seed": 3, **over}
    return build_samples("custom", cfg, Tok(), 0)


def test_a_context_carries_k_needles_each_asked_once(tmp_path):
    samples = _custom_samples(tmp_path)
    assert len(samples) == 3 * 4
    by_context: dict[str, list] = {}
    for s in samples:
        by_context.setdefault(s.metadata["context_id"], []).append(s)
    assert len(by_context) == 3
    for cid, qs in by_context.items():
        assert [s.sample_id for s in qs] == [f"{cid}/q{j}" for j in range(4)]
        assert all(s.prefix_ids == qs[0].prefix_ids and len(s.prefix_ids) == 6000 for s in qs)  # exact length
        text = bytes(qs[0].prefix_ids).decode("utf-8", "replace")
        depths = [s.metadata["needle_depth"] for s in qs]
        assert depths == sorted(depths) and all(j / 4 - 0.05 <= d <= (j + 1) / 4 + 0.05 for j, d in enumerate(depths))
        for s in qs:
            assert text.count(s.metadata["needle_text"]) == 1  # each needle once in the shared context
            assert text.count(s.answers[0]) == 1  # its value only in its own statement
            assert s.metadata["question"] not in text  # query-agnostic: questions come after compression
        assert len({(s.metadata["needle_family"], s.metadata["needle_key"]) for s in qs}) == 4


def test_questions_per_context_needs_the_query_agnostic_setting(tmp_path):
    from kvbench.errors import KVBenchError

    with pytest.raises(KVBenchError, match="query_aware=false"):
        _custom_samples(tmp_path, query_aware=True)
    with pytest.raises(KVBenchError, match="questions_per_context must be >= 1"):
        _custom_samples(tmp_path, questions_per_context=0)


# -- stopping a reply early never changes its score ---------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvbench.tasks.metrics import score as task_score  # noqa: E402

PIECES = ["45", "450", "1", ",", "000", ".", "3", " ", "  ", "\n", "US$", "days", "the", "a", "-", "250", "'s", "!"]


class _PieceTokenizer:
    """Token i decodes to PIECES[i]: replies built from the pieces that make normalisation non-local."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, len(PIECES) - 1), min_size=1, max_size=14),
       st.sampled_from(["45", "250,000", "1,000", "45 days", "3.1", "45.3"]), st.booleans())
def test_an_early_stop_never_changes_the_score(tokens, answer, newline):
    engine = Engine(LoadedModel("pieces", None, _PieceTokenizer()))
    sample = Sample(sample_id="s", prefix_ids=[1], query_ids=[1], gold_ids=[1], answers=[answer],
                    metric="substring", stop_at_newline=newline)
    stop = engine._stop_for(sample)
    full = _PieceTokenizer().decode(tokens)
    for k in range(1, len(tokens) + 1):
        if stop(tokens[:k]):
            cut = _PieceTokenizer().decode(tokens[:k])
            if not (newline and "\n" in cut.lstrip()):  # the settled rule: the score is already final
                assert task_score("substring", cut, [answer]) == task_score("substring", full, [answer]) == 1.0
            break
