"""The long-context task suite: exact lengths, needle depths, distractors, determinism, metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer
from kvbench.tasks.base import Sample, build_samples, task_names
from kvbench.tasks.metrics import normalize, score
from kvbench.tasks.needles import FAMILIES, sample_needles
from kvbench.tasks.prompt import build_pieces, truncate_middle

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"

PARAGRAPH = ("The committee met in the long room above the library. Several members had travelled far, and "
             "the minutes of the previous meeting were read aloud before any new business was taken.\n"
             "Rain fell all afternoon; the clerk kept the windows shut and the lamps lit.\n\n")


class ChatByteTokenizer(ByteTokenizer):
    """Byte tokenizer with a ChatML template, to exercise the chat path without a real model."""

    chat_template = "chatml"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        text = "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        for m in messages:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(PARAGRAPH * 12)
    (d / "sub" / "b.md").write_text(PARAGRAPH.replace("committee", "council") * 9)
    (d / "ignored.pdf").write_bytes(b"%PDF")
    return d


def _custom(corpus: Path, **over: Any) -> dict[str, Any]:
    cfg = {"name": "custom", "corpus": str(corpus), "context_tokens": 1024, "depths": [0.0, 0.25, 0.5, 1.0],
           "n_samples": 8, "distractors": 3, "query_aware": True, "seed": 7}
    cfg.update(over)
    return cfg


def _key(samples: list[Sample]) -> list[tuple]:
    return [(s.sample_id, s.prefix_ids, s.query_ids, s.gold_ids, s.answers) for s in samples]


# ------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("metric, prediction, answers, expected", [
    ("substring", " 45 days, and any notice", ["45"], 1.0),
    ("substring", "145 days", ["45"], 0.0),                      # word boundaries: no accidental hit
    ("substring", "It was THE Heron!", ["the heron"], 1.0),       # case, articles, punctuation
    ("substring", "US$250,000, except", ["250,000"], 1.0),
    ("substring", "US$1,250,000", ["250,000"], 0.0),
    ("substring", "the law of New   York.", ["Ontario", "New York"], 1.0),
    ("substring", "", ["x"], 0.0),
    ("exact", "The Heron.", ["heron"], 1.0),
    ("exact", "Heron boat", ["heron"], 0.0),
    ("f1", "the green rowing boat", ["green boat"], 0.8),         # p=2/3, r=1
    ("f1", "12 days", ["19 days", "12 days"], 1.0),               # max over answers
    ("f1", "blue", ["green boat"], 0.0),
])
def test_metric_hand_cases(metric, prediction, answers, expected):
    assert score(metric, prediction, answers) == pytest.approx(expected)


def test_metric_errors_and_normalisation():
    assert normalize("  The  Notice-Period: 45 DAYS! ") == "notice period 45 days"
    with pytest.raises(KVBenchError, match="engine"):
        score("token_accuracy", "x", ["x"])
    with pytest.raises(KVBenchError, match="valid: substring, exact, f1"):
        score("bleu", "x", ["x"])
    with pytest.raises(KVBenchError):
        score("substring", "x", [])


# ------------------------------------------------------------------------------------ needle families


def _skeleton(needle: Any) -> str:
    text = re.sub(r"^\d+\.\d+ ", "", needle.text)
    return text.replace(needle.key, "<key>").replace(needle.value, "<value>")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_distractors_differ_in_key_and_value_only(family):
    import random

    needle, distractors = sample_needles(family, random.Random(3), 5)
    values = [needle.value] + [d.value for d in distractors]
    keys = [needle.key] + [d.key for d in distractors]
    assert len(set(values)) == len(values) and len(set(keys)) == len(keys)
    for d in distractors:
        # No distractor's value can satisfy the needle's answer (or vice versa) under substring scoring.
        assert score("substring", d.gold, list(needle.answers)) == 0.0
        assert score("substring", needle.gold, list(d.answers)) == 0.0
        # Same form: the statements differ only in the key, the value (and a legal clause's number).
        assert _skeleton(d) == _skeleton(needle)
    assert needle.key in needle.question and needle.answer_prefix.lower() in needle.text.lower()
    assert score("substring", needle.gold, list(needle.answers)) == 1.0


def test_too_many_distractors_is_a_clear_error():
    with pytest.raises(KVBenchError, match="too many"):
        sample_needles("notice", __import__("random").Random(0), 50)


# ------------------------------------------------------------------------------------- custom corpus


def test_registered_tasks():
    assert {"legal", "papers", "fiction", "custom", "jsonl"} <= set(task_names())


def test_exact_lengths_and_needle_at_depth(corpus_dir):
    tok = ByteTokenizer()
    cfg = _custom(corpus_dir)
    samples = build_samples("custom", cfg, tok, 2048)
    assert len(samples) == 8
    for s in samples:
        m = s.metadata
        assert len(s.prefix_ids) == 1024 == m["context_tokens"]
        start, end = m["document_span"]
        budget = end - start
        target = round(m["depth"] * (budget - m["needle_tokens"]))
        actual = m["needle_token_index"] - start
        assert abs(actual - target) <= cfg.get("snap_tokens", 16)
        assert abs(m["needle_depth"] - m["depth"]) <= 16 / (budget - m["needle_tokens"])
        # The needle's tokens sit exactly at the recorded index, and the question is in the prefix.
        needle = tok.encode(m["needle_text"])
        i = m["needle_token_index"]
        assert tok.decode(s.prefix_ids[i:i + m["needle_tokens"]]).strip() == m["needle_text"]
        assert s.prefix_ids[i + 1:i + 1 + len(needle)] == needle
        assert tok.decode(s.prefix_ids).endswith(f"Question: {m['question']}")
        assert tok.decode(s.query_ids) == f"\nAnswer: {m['answer_prefix_text']}"
        assert m["distractors"] == 3 == len(m["distractor_token_indices"])
        assert {"seed", "template", "variant", "source_docs", "depth"} <= set(m)
        assert m["template"] == "plain" and m["variant"] == "retrieval" and m["seed"] == 7
        # Distractor values: all distinct, none equal to the answer, each present in the prefix.
        values = m["distractor_values"]
        assert len(set(values)) == len(values) and s.answers[0] not in values
        text = tok.decode(s.prefix_ids)
        assert all(v in text for v in values) and text.count(s.answers[0]) == 1
        assert score("substring", tok.decode(s.gold_ids), s.answers) == 1.0
    assert [s.metadata["depth"] for s in samples] == [0.0, 0.25, 0.5, 1.0] * 2


def test_same_seed_same_samples_other_seed_differs(corpus_dir):
    tok = ByteTokenizer()
    a = build_samples("custom", _custom(corpus_dir), tok, 2048)
    b = build_samples("custom", _custom(corpus_dir), tok, 2048)
    c = build_samples("custom", _custom(corpus_dir, seed=8), tok, 2048)
    assert _key(a) == _key(b)
    assert [s.metadata for s in a] == [s.metadata for s in b]
    assert _key(a) != _key(c)
    assert [s.answers for s in a] != [s.answers for s in c]


def test_query_agnostic_moves_question_after_compression(corpus_dir):
    tok = ByteTokenizer()
    s = build_samples("custom", _custom(corpus_dir, query_aware=False, n_samples=1), tok, 2048)[0]
    assert len(s.prefix_ids) == 1024
    q = s.metadata["question"]
    assert q not in tok.decode(s.prefix_ids)
    assert tok.decode(s.query_ids).startswith(f"\n\nQuestion: {q}\nAnswer:")


def test_chat_template_path():
    pieces = build_pieces(ChatByteTokenizer(), "Who?", "It was")
    assert pieces.template == "chat"
    head = ChatByteTokenizer().decode(pieces.head)
    assert head.startswith("<|im_start|>system") and head.endswith("Document:\n")
    assert ChatByteTokenizer().decode(pieces.tail) == "<|im_end|>\n<|im_start|>assistant\n"
    prefix, query = pieces.assemble([65] * 10, query_aware=True)
    assert ChatByteTokenizer().decode(query) == "<|im_end|>\n<|im_start|>assistant\nIt was"
    assert ChatByteTokenizer().decode(pieces.gold_ids(ChatByteTokenizer(), "Tam")) == " Tam"
    assert build_pieces(ChatByteTokenizer(), "Who?").gold_ids(ChatByteTokenizer(), "Tam") == list(b"Tam")


def test_chat_template_exact_length(corpus_dir):
    samples = build_samples("custom", _custom(corpus_dir, n_samples=2, context_tokens=1500), ChatByteTokenizer(), 0)
    assert all(len(s.prefix_ids) == 1500 and s.metadata["template"] == "chat" for s in samples)


def test_continuation_variant(corpus_dir):
    tok = ByteTokenizer()
    cfg = _custom(corpus_dir, variant="continuation", n_samples=3, query_tokens=8, continuation_tokens=20)
    samples = build_samples("custom", cfg, tok, 2048)
    for s in samples:
        assert len(s.prefix_ids) == 1024 and len(s.query_ids) == 8 and len(s.gold_ids) == 20
        assert s.metric == "token_accuracy" and s.max_new_tokens == 20
        assert s.metadata["variant"] == "continuation" and s.metadata["template"] == "raw"
        # Prefix, query and gold are consecutive pieces of one real text.
        a, b = (PARAGRAPH * 12).strip() + "\n", (PARAGRAPH.replace("committee", "council") * 9).strip() + "\n"
        assert tok.decode(s.prefix_ids + s.query_ids + s.gold_ids) in (a + "\n\n" + b + "\n\n" + a)
    with pytest.raises(KVBenchError, match="valid: retrieval, continuation"):
        build_samples("custom", _custom(corpus_dir, variant="sideways"), tok, 2048)


def test_custom_corpus_errors(tmp_path, corpus_dir):
    tok = ByteTokenizer()
    with pytest.raises(KVBenchError, match="not a directory"):
        build_samples("custom", _custom(tmp_path / "missing"), tok, 2048)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n\n")
    with pytest.raises(KVBenchError, match="no non-empty .txt or .md"):
        build_samples("custom", _custom(tmp_path / "empty"), tok, 2048)
    with pytest.raises(KVBenchError, match="task.corpus"):
        build_samples("custom", {"name": "custom", "n_samples": 1}, tok, 2048)
    with pytest.raises(KVBenchError, match="unknown needle family"):
        build_samples("custom", _custom(corpus_dir, needles=["nope"]), tok, 2048)
    with pytest.raises(KVBenchError, match="depths"):
        build_samples("custom", _custom(corpus_dir, depths=[1.5]), tok, 2048)
    with pytest.raises(KVBenchError, match="exceeds the model's maximum context"):
        build_samples("custom", _custom(corpus_dir, context_tokens=4096), tok, 2048)


# ---------------------------------------------------------------------------------------------- jsonl


def test_jsonl_fixture():
    tok = ByteTokenizer()
    rows = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    assert 3 <= len(rows) <= 5
    samples = build_samples("jsonl", {"name": "jsonl", "path": str(FIXTURE), "context_tokens": 2048,
                                      "n_samples": 10}, tok, 2048)
    assert len(samples) == len(rows)
    assert samples[0].answers == ["Margit Sole"] and samples[1].answers == ["seven", "7"]
    assert samples[2].answers == ["12 days"]  # the "answer" (string) form
    assert samples[0].sample_id == "jsonl/lb-001" and samples[0].metric == "substring"
    for s, row in zip(samples, rows, strict=True):
        text = tok.decode(s.prefix_ids)
        assert row["context"] in text and not s.metadata["truncated"]
        assert (row.get("input") or row.get("question")) in text
        assert len(s.prefix_ids) <= 2048


def test_jsonl_truncates_in_the_middle_and_checks_metric():
    tok = ByteTokenizer()
    s = build_samples("jsonl", {"name": "jsonl", "path": str(FIXTURE), "context_tokens": 300, "n_samples": 1,
                                "metric": "f1"}, tok, 2048)[0]
    assert len(s.prefix_ids) == 300 and s.metadata["truncated"] and s.metric == "f1"
    context = json.loads(FIXTURE.read_text().splitlines()[0])["context"]
    text = tok.decode(s.prefix_ids)
    assert context[:40] in text and context[-40:] in text and context not in text
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    with pytest.raises(KVBenchError, match="valid: substring, exact, f1"):
        build_samples("jsonl", {"name": "jsonl", "path": str(FIXTURE), "metric": "token_accuracy"}, tok, 2048)
    with pytest.raises(KVBenchError, match="not a file"):
        build_samples("jsonl", {"name": "jsonl", "path": "/nonexistent.jsonl"}, tok, 2048)


def test_task_yamls_parse_and_name_their_keys():
    from omegaconf import OmegaConf

    from kvbench.config import compose_config  # generated from the task's *_DEFAULTS; the YAML points at it

    for name in ("legal", "papers", "fiction", "custom", "jsonl"):
        cfg = OmegaConf.to_container(compose_config([f"task={name}"]).task)
        assert cfg["name"] == name
        assert {"context_tokens", "n_samples", "query_aware", "seed", "max_new_tokens"} <= set(cfg)
        if name != "jsonl":
            assert {"depths", "distractors", "variant"} <= set(cfg)


# -------------------------------------------------------------------------------- real corpora, bytes


@pytest.mark.parametrize("task", ["legal", "papers", "fiction"])
def test_real_corpus_tasks_with_byte_tokens(task):
    tok = ByteTokenizer()
    cfg = {"name": task, "context_tokens": 1024, "n_samples": 3, "seed": 1}
    a = build_samples(task, cfg, tok, 2048)
    assert _key(a) == _key(build_samples(task, cfg, tok, 2048))
    for s in a:
        assert len(s.prefix_ids) == 1024 and s.metadata["source_docs"]
        assert s.metadata["needle_text"] in tok.decode(s.prefix_ids)
        assert s.metadata["needle_family"] in FAMILIES
    cont = build_samples(task, {**cfg, "variant": "continuation"}, tok, 2048)
    assert all(len(s.prefix_ids) == 1024 and len(s.gold_ids) == 64 for s in cont)


def test_real_tokenizer_exact_lengths(smollm):
    """BPE tokens: pieces are tokenized separately, so lengths stay exact at every size."""
    tok = smollm.tokenizer
    for task, ctx in (("legal", 1024), ("fiction", 2048)):
        samples = build_samples(task, {"name": task, "context_tokens": ctx, "n_samples": 3}, tok, smollm.max_context)
        for s in samples:
            m = s.metadata
            assert len(s.prefix_ids) == ctx and m["template"] == "chat"
            i = m["needle_token_index"]
            assert m["needle_text"] in tok.decode(s.prefix_ids[i:i + m["needle_tokens"]])
            assert tok.decode(s.query_ids).endswith(m["answer_prefix_text"])
