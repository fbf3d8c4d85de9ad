"""Several questions per compressed context from a dataset: LongBench-format rows that repeat a context
(``task.questions_per_context``), SCBench's ``context`` + ``multi_turns`` (``task.preset=scbench``), JSON Lines;
end to end through ``python -m kvbench`` with one prefill and one compression per context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer
from kvbench.tasks.base import build_samples

datasets = pytest.importorskip("datasets")

BOOK = "The harbour office keeps the tide tables and the pilot roster. " * 60
OTHER = "The lighthouse keeper logs every ship that passes the point. " * 60


def _longbench_rows() -> dict[str, list[Any]]:
    """Five questions on two documents, LongBench's layout: one question per row, the context repeated."""
    return {
        "_id": ["a1", "b1", "a2", "a3", "b2"],
        "dataset": ["qasper"] * 5,
        "context": [BOOK, OTHER, BOOK, BOOK, OTHER],
        "input": ["What is kept?", "Who logs?", "Which roster?", "Which office?", "What passes?"],
        "answers": [["tide tables"], ["keeper"], ["pilot"], ["harbour"], ["ship"]],
    }


def _scbench_rows() -> dict[str, list[Any]]:
    return {
        "id": [0, 1],
        "context": [BOOK, OTHER],
        "multi_turns": [
            [{"input": "Key 1?", "answer": "v1"}, {"input": "Key 2?", "answer": "v2"},
             {"input": "Key 3?", "answer": "v3"}],
            [{"input": "Key 4?", "answer": "v4"}, {"input": "Key 5?", "answer": "v5"}],
        ],
    }


@pytest.fixture
def scbench_dir(tmp_path: Path) -> Path:
    """A local SCBench-format dataset (the layout of microsoft/SCBench's scbench_kv), saved with save_to_disk."""
    d = tmp_path / "scbench_kv"
    datasets.Dataset.from_dict(_scbench_rows()).save_to_disk(str(d))
    return d


@pytest.fixture
def longbench_file(tmp_path: Path) -> Path:
    f = tmp_path / "qasper.jsonl"
    datasets.Dataset.from_dict(_longbench_rows()).to_json(str(f))
    return f


def _build(task: str = "hf", **cfg: Any) -> list:
    return build_samples(task, {"name": task, "context_tokens": 512, **cfg}, ByteTokenizer(), 1 << 20)


def _text(ids: list[int]) -> str:
    return ByteTokenizer().decode(ids)


def test_longbench_rows_that_repeat_a_context_share_it(longbench_file):
    samples = _build(dataset=str(longbench_file), preset="longbench", questions_per_context=4, n_samples=2)
    assert [s.sample_id for s in samples] == ["hf_qasper/a1", "hf_qasper/a2", "hf_qasper/a3", "hf_qasper/b1",
                                              "hf_qasper/b2"]
    by_ctx: dict[str, list] = {}
    for s in samples:
        by_ctx.setdefault(s.metadata["context_id"], []).append(s)
    assert list(by_ctx) == ["hf_qasper/context/a1", "hf_qasper/context/b1"]
    for cid, qs in by_ctx.items():
        assert all(q.prefix_ids == qs[0].prefix_ids and q.metadata["document_id"] == cid for q in qs)
        assert [q.metadata["question_index"] for q in qs] == list(range(len(qs)))
        for q in qs:  # query-agnostic: the question comes after the compressed prefix, never inside it
            assert not q.metadata["query_aware"] and q.metadata["question"] not in _text(q.prefix_ids)
            assert q.metadata["question"] in _text(q.query_ids)
    # K caps the questions per context; n_samples counts contexts
    two = _build(dataset=str(longbench_file), questions_per_context=2, n_samples=1)
    assert [s.sample_id for s in two] == ["hf_qasper/a1", "hf_qasper/a2"]
    # K = 1 keeps one query-aware sample per row, as before
    one = _build(dataset=str(longbench_file))
    assert len(one) == 5 and all(s.metadata["query_aware"] and "context_id" not in s.metadata for s in one)
    assert "What is kept?" in _text(one[0].prefix_ids)


def test_sharing_needs_shared_contexts_and_the_query_agnostic_setting(tmp_path, longbench_file):
    with pytest.raises(KVBenchError, match="query_aware=false"):
        _build(dataset=str(longbench_file), questions_per_context=4, query_aware=True)
    with pytest.raises(KVBenchError, match="questions_per_context must be >= 1"):
        _build(dataset=str(longbench_file), questions_per_context=0)
    with pytest.raises(KVBenchError, match="valid: multi_request, multi_turn"):
        _build(dataset=str(longbench_file), questions_per_context=2, shared_context="chat")
    unique = tmp_path / "unique.jsonl"
    unique.write_text("".join(json.dumps({"context": f"doc {i} " * 20, "input": "q", "answers": ["a"]}) + "\n"
                              for i in range(3)))
    with pytest.raises(KVBenchError, match="no two of the first rows share a context"):
        _build(dataset=str(unique), questions_per_context=2)


def test_scbench_rows_ask_every_turn_of_one_compressed_context(scbench_dir):
    samples = _build(dataset=str(scbench_dir), preset="scbench")
    assert [s.sample_id for s in samples] == ["hf_scbench_kv/0/q0", "hf_scbench_kv/0/q1", "hf_scbench_kv/0/q2",
                                              "hf_scbench_kv/1/q0", "hf_scbench_kv/1/q1"]
    assert {s.metadata["context_id"] for s in samples} == {"hf_scbench_kv/0", "hf_scbench_kv/1"}
    assert all(s.metric == "substring" and s.max_new_tokens == 150 for s in samples)  # SCBench's kv scorer, length
    first = samples[:3]
    assert all(s.prefix_ids == first[0].prefix_ids and not s.metadata["query_aware"] for s in first)
    assert [s.answers for s in first] == [["v1"], ["v2"], ["v3"]]
    # multi-request (default): each turn alone; multi-turn: after the earlier turns and their reference answers
    assert "Key 1?" not in _text(first[2].query_ids) and "Key 3?" in _text(first[2].query_ids)
    turns = _build(dataset=str(scbench_dir), preset="scbench", shared_context="multi_turn")
    q = _text(turns[2].query_ids)
    assert q.index("Key 1?") < q.index("v1") < q.index("Key 2?") < q.index("v2") < q.index("Key 3?")
    assert turns[2].prefix_ids == first[2].prefix_ids and turns[0].query_ids == first[0].query_ids
    # questions_per_context takes the first K turns; n_samples counts contexts
    assert [s.sample_id for s in _build(dataset=str(scbench_dir), preset="scbench", questions_per_context=2,
                                        n_samples=1)] == ["hf_scbench_kv/0/q0", "hf_scbench_kv/0/q1"]


def test_scbench_subsets_metrics_and_bad_rows(tmp_path):
    rows = _scbench_rows()
    rows["multi_turns"] = [[{"input": "Pick one", "answer": "B", "options": ["x", "y", "z", "w"]}],
                           [{"input": "Summarise", "answer": "a summary", "task": "scbench_summary"},
                            {"input": "The pass key?", "answer": "123", "task": "scbench_passkey"}]]
    datasets.Dataset.from_dict(rows).to_json(str(tmp_path / "scbench_summary_with_needles.jsonl"))
    a, b, c = _build(dataset=str(tmp_path / "scbench_summary_with_needles.jsonl"), preset="scbench")
    assert "A. x\nB. y\nC. z\nD. w" in _text(a.query_ids)
    assert (b.metric, b.max_new_tokens, c.metric, c.max_new_tokens) == ("rouge_l", 200, "substring", 15)
    datasets.Dataset.from_dict(_scbench_rows()).to_json(str(tmp_path / "scbench_repoqa.jsonl"))
    with pytest.raises(KVBenchError, match="no kvbench metric"):
        _build(dataset=str(tmp_path / "scbench_repoqa.jsonl"), preset="scbench")
    assert _build(dataset=str(tmp_path / "scbench_repoqa.jsonl"), preset="scbench", metric="code_sim")
    with pytest.raises(KVBenchError, match="no turns column"):
        _build(dataset=str(_no_turns(tmp_path)), preset="scbench", metric="f1")


def _no_turns(tmp_path: Path) -> Path:
    f = tmp_path / "plain.jsonl"
    f.write_text(json.dumps({"context": "c", "input": "q", "answers": ["a"]}) + "\n")
    return f


def test_jsonl_task_shares_contexts_too(tmp_path, longbench_file):
    samples = _build("jsonl", path=str(longbench_file), questions_per_context=3)
    assert [s.metadata["context_id"] for s in samples] == ["jsonl/context/a1"] * 3 + ["jsonl/context/b1"] * 2
    turns = tmp_path / "turns.jsonl"
    turns.write_text("".join(json.dumps(r) + "\n" for r in datasets.Dataset.from_dict(_scbench_rows()).to_list()))
    got = _build("jsonl", path=str(turns))
    assert [s.sample_id for s in got][:3] == ["jsonl/0/q0", "jsonl/0/q1", "jsonl/0/q2"]
    assert all(not s.metadata["query_aware"] and s.prefix_ids == got[0].prefix_ids for s in got[:3])


# ------------------------------------------------------------------------------------------- end to end


def _run(args: list[str]) -> None:
    from kvbench import cli

    try:
        cli.main(["model=tiny-llama", "hardware.threads=1", "engine.progress=false", "task.max_new_tokens=2",
                  "task.context_tokens=512", *args])
    except SystemExit as exc:
        assert not exc.code


@pytest.mark.parametrize("kind", ["scbench", "longbench"])
def test_one_prefill_and_one_compression_per_context_end_to_end(kind, scbench_dir, longbench_file, tmp_path,
                                                                monkeypatch):
    """python -m kvbench task=hf ... strategy=int8: every question answered, one prefill per context and one
    compression per (context, strategy); the records of a context share its context_id and compression time."""
    from kvbench.cache import KVBenchCache
    from kvbench.engine import Engine
    from kvbench.results import read_store

    prefills, builds = [], []
    prefill, build = Engine.prefill, KVBenchCache.from_capture.__func__

    def count_prefill(self, *a, **k):
        prefills.append(1)
        return prefill(self, *a, **k)

    def count_build(cls, *a, **k):
        builds.append(1)
        return build(cls, *a, **k)

    monkeypatch.setattr(Engine, "prefill", count_prefill)
    monkeypatch.setattr(KVBenchCache, "from_capture", classmethod(count_build))
    results = tmp_path / "results"
    if kind == "scbench":
        args = [f"task.dataset={scbench_dir}", "task.preset=scbench"]
        contexts, questions = 2, 5
    else:
        args = [f"task.dataset={longbench_file}", "task.questions_per_context=4", "task.n_samples=2"]
        contexts, questions = 2, 5
    _run(["task=hf", "strategy=int8", f"results_dir={results}", *args])
    store = read_store(results)
    assert len(store) == 2 * questions and set(store["strategy_name"]) == {"full", "int8"}
    assert store["context_id"].nunique() == contexts and not store["query_aware"].any()
    assert len(prefills) == contexts
    # per (context, strategy) one cache build, then one copy per pass (int8's store copies)
    assert len(builds) == contexts * 2
    per = store.groupby(["context_id", "strategy_name"])
    assert (per["compress_s"].nunique() == 1).all() and (per["prefill_s"].nunique() == 1).all()
    assert (per.size() > 1).all()


def test_custom_task_takes_questions_per_context_from_the_command_line(tmp_path):
    from kvbench.config import check_overrides

    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("The committee met in the long room above the library.\n\n" * 400)
    assert check_overrides(["model=tiny-llama", "task=custom", f"task.corpus={d}", "task.questions_per_context=2",
                            "task.query_aware=false", "task.context_tokens=1024", "task.distractors=1"]) == 1


def test_own_document_ids_cluster_contexts_cut_from_one_work(tmp_path):
    """Two contexts cut from one novel are one cluster: the rows' ``document_id`` (or the column
    ``task.document_field`` names) is the samples' document, and each sample records its length budget."""
    from kvbench.engine import document_of
    from kvbench.paired import document_ids

    rows = {"id": ["n1", "n2", "m1"], "context": [BOOK, BOOK[::-1], OTHER], "input": ["q1", "q2", "q3"],
            "answers": [["a"], ["b"], ["c"]], "work": ["novel", "novel", "memoir"]}
    f = tmp_path / "own.jsonl"
    datasets.Dataset.from_dict({**rows, "document_id": rows["work"]}).to_json(str(f))
    for task, cfg in (("hf", {"dataset": str(f)}), ("hf", {"dataset": str(f), "document_field": "work"}),
                      ("jsonl", {"path": str(f)}), ("jsonl", {"path": str(f), "document_field": "work"})):
        samples = _build(task, **cfg)
        assert [document_of(s) for s in samples] == ["novel", "novel", "memoir"], (task, cfg)
        assert all(s.metadata["context_budget"] == 512 for s in samples)
        recs = pd.DataFrame({"task": "own", "sample_id": [s.sample_id for s in samples],
                             "document_id": [document_of(s) for s in samples],
                             "sample_meta": [json.dumps(s.metadata) for s in samples]})
        assert document_ids(recs).nunique() == 2
    # without one, each context is its own cluster (the data says nothing about shared works)
    plain = tmp_path / "plain.jsonl"
    datasets.Dataset.from_dict({k: v for k, v in rows.items() if k != "work"}).to_json(str(plain))
    assert len({document_of(s) for s in _build("jsonl", path=str(plain))}) == 3
    with pytest.raises(KVBenchError, match="task.document_field='nope' is not a column"):
        _build(dataset=str(f), document_field="nope")
