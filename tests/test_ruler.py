"""RULER natively: exact lengths, answers placed as each subtask says, determinism, RULER's scorers."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import pytest

from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer
from kvbench.spec import binary_metric
from kvbench.tasks import ruler
from kvbench.tasks.base import build_samples
from kvbench.tasks.corpora import Document
from kvbench.tasks.metrics import score

ESSAY = ("Most of the ideas worth having start as small questions. A student asks why a result holds, and the "
         "answer takes a year. Nobody plans that year; it happens because the question would not go away.\n\n")


class ChatBytes(ByteTokenizer):
    """Byte tokenizer with a ChatML-like template, to exercise the chat path without a model."""

    chat_template = "chatml"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture(autouse=True)
def essay_corpus(monkeypatch):
    """Essay haystacks read kvbench's corpora; here a small in-memory one (nothing fetched)."""
    docs = [Document(f"essay-{k}", "papers", f"Essay {k}", ESSAY.replace("year", f"year ({k})") * 40, "test", "CC0",
                     "prose") for k in range(3)]
    monkeypatch.setattr("kvbench.tasks.corpora.load_corpus", lambda domain: docs)
    return docs


def _build(sub: str, tok: Any = None, **over: Any) -> list:
    cfg = {"name": "ruler", "subtask": sub, "context_tokens": 2048, "n_samples": 3, "seed": 3, **over}
    return build_samples("ruler", cfg, tok or ByteTokenizer(), 1 << 20)


def _document(s, tok) -> str:
    a, b = s.metadata["document_span"]
    return tok.decode(s.prefix_ids[a:b])


# ------------------------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("sub", ruler.SUBTASKS)
@pytest.mark.parametrize("tok", [ByteTokenizer(), ChatBytes()], ids=["plain", "chat"])
@pytest.mark.parametrize("query_aware", [True, False])
def test_every_subtask_has_the_exact_length(sub, tok, query_aware):
    samples = _build(sub, tok, query_aware=query_aware)
    for s in samples:
        assert len(s.prefix_ids) == 2048 and s.metadata["context_tokens"] == 2048
        assert s.metric == "string_match_all" and s.answers
        assert s.max_new_tokens == ruler.MAX_NEW[sub]
        question = tok.decode(s.query_ids if not query_aware else s.prefix_ids)
        assert s.metadata["question"] in question
        a, b = s.metadata["document_span"]
        assert b - a > 1000  # the document fills what the prompt leaves
    # cwe switches to RULER's 4K repetitions at a 4K window; the length stays exact there too.
    if sub in ("cwe", "fwe"):
        assert all(len(s.prefix_ids) == 4096 for s in _build(sub, tok, context_tokens=4096, n_samples=1))


@pytest.mark.integration  # loads SmolLM2's tokenizer (transformers import: seconds on a busy machine)
def test_real_bpe_tokenizer_exact_lengths():
    """BPE tokens merge across piece boundaries in a joint encoding; pieces are tokenized apart, so the
    length stays exact (SmolLM2's tokenizer, when the embedded model has been converted on this machine)."""
    from kvbench.models import cache_dir

    path = cache_dir() / "models" / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 tokenizer not converted yet (run any kvbench task once)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    for sub in ruler.SUBTASKS:
        for s in _build(sub, tok, context_tokens=1536, n_samples=1):
            assert len(s.prefix_ids) == 1536 and s.metadata["template"] == "chat"
            text = _document(s, tok)
            for a in s.answers:
                assert a in text


# ------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize("sub", list(ruler.NIAH))
def test_niah_values_occur_exactly_once(sub):
    tok = ByteTokenizer()
    spec = ruler.NIAH[sub]
    for s in _build(sub, tok):
        m, text = s.metadata, _document(s, tok)
        # every needle, queried or not, is in the haystack once; the queried ones are the answers
        assert len(m["needle_values"]) == max(spec.keys, spec.queries) * spec.values == m["needles"]
        for v in m["needle_values"]:
            assert text.count(v) == 1
        assert len(s.answers) == spec.queries * spec.values
        assert set(s.answers) <= set(m["needle_values"])
        for k in m["query_keys"]:
            assert f"for {k} is:" in text and k in m["question"]
        i = m["needle_token_index"]
        assert tok.decode(s.prefix_ids[i:i + m["needle_tokens"]]).strip().startswith("One of the special magic")
        if spec.haystack == "noise":
            assert "The grass is green." in text
        elif spec.haystack == "needle":
            assert text.count("One of the special magic") > 10  # the haystack is other needles
        else:
            assert m["source_docs"] and "Most of the ideas" in text


def test_single_needle_depths_are_honoured():
    depths = [0.0, 0.5, 1.0]
    for s in _build("niah_single_1", context_tokens=3000, depths=depths, n_samples=3):
        m = s.metadata
        assert m["depth"] == depths[m["index"]]
        # moved at most one noise line (~90 bytes) to land on a line start
        assert abs(m["needle_depth"] - m["depth"]) < 0.04
    with pytest.raises(KVBenchError, match="single-needle"):
        _build("niah_multikey_1", depths=[0.5])


def test_vt_chain_is_complete_and_in_order():
    tok = ByteTokenizer()
    for s in _build("vt", tok):
        text = _document(s, tok)
        chain = s.metadata["chain"]
        value = chain[0].split("= ")[1]
        assert text.count(value) == 1 and len(s.answers) == ruler.VT_HOPS + 1
        positions = [text.index(c + "\n") for c in chain]
        assert positions == sorted(positions)
        assert f"assigned the value {value}" in s.metadata["question"]


def test_cwe_common_words_are_the_most_frequent():
    tok = ByteTokenizer()
    for ctx, (common, rare) in ((2048, (6, 1)), (4096, (30, 3))):
        for s in _build("cwe", tok, context_tokens=ctx, n_samples=2):
            entries = re.findall(r"(\d+)\. ([a-z]+)", _document(s, tok))
            assert [int(n) for n, _ in entries] == list(range(1, len(entries) + 1))
            counts = Counter(w for _, w in entries)
            assert {w: counts[w] for w in s.answers} == {w: common for w in s.answers}
            assert all(c == rare for w, c in counts.items() if w not in s.answers)
            assert s.metadata["pad_tokens"] < 3 * 20  # less than one word's entries


def test_fwe_answers_are_the_three_most_frequent_after_the_dots():
    tok = ByteTokenizer()
    for s in _build("fwe", tok):
        counts = Counter(_document(s, tok).split())
        top = [w for w, _ in counts.most_common(5)]
        assert top[0] == "..." and top[1:4] == s.answers
        assert counts[top[3]] > counts[top[4]]


def test_same_seed_same_samples_other_seed_differs():
    a = _build("niah_multiquery")
    b = _build("niah_multiquery")
    c = _build("niah_multiquery", seed=4)
    assert [(s.prefix_ids, s.query_ids, s.answers) for s in a] == [(s.prefix_ids, s.query_ids, s.answers) for s in b]
    assert [s.answers for s in a] != [s.answers for s in c]


def test_bad_input_is_one_clear_error():
    with pytest.raises(KVBenchError, match="valid: niah_single_1"):
        _build("niah_single_9")
    with pytest.raises(KVBenchError, match="haystack_corpus"):
        _build("niah_single_2", haystack_corpus="poetry")
    with pytest.raises(KVBenchError, match="context_tokens"):
        _build("niah_multivalue", context_tokens=300)
    with pytest.raises(KVBenchError, match="distinct words"):
        _build("cwe", context_tokens=40000, n_samples=1)


def test_record_name_and_corpus_use():
    assert ruler.record_name({"subtask": "vt"}) == "ruler_vt"
    assert ruler.uses_corpus({"subtask": "niah_single_2", "haystack_corpus": "fiction"}) == "fiction"
    assert ruler.uses_corpus({"subtask": "niah_single_1"}) is None


# ------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("metric, prediction, answers, expected", [
    # hand-worked: RULER lower-cases both sides and tests containment, nothing else
    ("string_match_all", " 1234567.", ["1234567"], 1.0),
    ("string_match_all", "1234567, 7654321 and 1111111", ["1234567", "7654321", "2222222", "1111111"], 0.75),
    ("string_match_all", "The words are: Dance, attach", ["dance", "attach", "shave"], 2 / 3),
    ("string_match_all", "none of them", ["alpha", "beta"], 0.0),
    ("string_match_all", "91234567", ["1234567"], 1.0),  # containment, as RULER: no word boundaries
    ("string_match_part", "it is beta", ["alpha", "beta"], 1.0),
    ("string_match_part", "gamma", ["alpha", "beta"], 0.0),
    ("string_match_part", "ALPHA\x07", ["alpha"], 1.0),  # control characters dropped, case ignored
])
def test_ruler_scorers_hand_cases(metric, prediction, answers, expected):
    assert score(metric, prediction, answers) == pytest.approx(expected)


def test_ruler_metrics_binary_or_continuous():
    assert binary_metric(["string_match_part"]) is True
    assert binary_metric(["string_match_all"]) is False


def test_gold_reply_scores_full_marks():
    tok = ByteTokenizer()
    for sub in ruler.SUBTASKS:
        for s in _build(sub, tok, n_samples=1):
            assert score(s.metric, tok.decode(s.gold_ids), s.answers) == 1.0


def test_runs_through_the_harness(tmp_path):
    """python -m kvbench task=ruler task.subtask=niah_multikey_2 strategy=snapkv, on the tiny random model."""
    from kvbench import cli, identity
    from kvbench.results import read_store

    results = tmp_path / "results"
    args = ["model=tiny-llama", "hardware.threads=1", "engine.progress=false", "task=ruler",
            "task.subtask=niah_multikey_2", "task.n_samples=1", "task.context_tokens=512", "task.max_new_tokens=2",
            "strategy=snapkv", f"results_dir={results}"]
    try:
        cli.main(args)
    except SystemExit as exc:
        assert not exc.code
    store = read_store(results)
    assert set(store["task"]) == {"ruler_niah_multikey_2"} and set(store["metric"]) == {"string_match_all"}
    assert set(store["strategy"].str.split("(").str[0]) == {"full", "snapkv"}
    cfg = {"subtask": "niah_multikey_2"}
    assert set(store["task_digest"]) == {identity.task_digest("ruler", cfg)["digest"]}
    # the essay haystack's corpus enters the identity; a noise haystack's does not
    assert identity.task_digest("ruler", {"subtask": "niah_single_2"}) != identity.task_digest("ruler", cfg)
