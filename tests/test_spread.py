"""Samples are spread over documents, each records its primary ``document_id``; works are cut into parts."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest

from kvbench.models import ByteTokenizer
from kvbench.tasks.corpora import Document, as_parts, split_parts
from kvbench.tasks.haystack import draw_filler, primary_document, spread_order
from kvbench.tasks.suite import DEFAULTS, build_task


def _docs(n: int, chars: int = 600) -> list[Document]:
    return [Document(f"doc{k:02d}", "fiction", f"Doc {k}", f"Document {k} line.\n" * (chars // 18),
                     "src", "lic", "prose") for k in range(n)]


def _assert_spread(primaries: list[str], n_docs: int) -> None:
    """No document is primary more than ceil(n/D) times, nor twice before all D have been used once."""
    counts = Counter(primaries)
    assert max(counts.values()) <= math.ceil(len(primaries) / n_docs)
    first_block = primaries[:n_docs]
    assert len(set(first_block)) == len(first_block)


@pytest.mark.parametrize("n_docs, n", [(7, 3), (7, 7), (7, 20), (30, 95)])
def test_primary_documents_follow_the_spread_rule(n_docs, n):
    works = [f"w{k % 4}" for k in range(n_docs)]  # parts of 4 works
    primaries = [str(primary_document(works, i, "fiction:0")) for i in range(n)]
    _assert_spread(primaries, n_docs)
    assert len({works[int(p)] for p in primaries[:4]}) == min(4, n)  # every work before a second part of any
    assert sorted(spread_order(works, "fiction:0")) == list(range(n_docs))
    assert spread_order(works, "fiction:0") != spread_order(works, "fiction:1")  # the seed reorders


def test_draw_filler_starts_in_the_primary_document_then_adds_others():
    tok, docs = ByteTokenizer(), _docs(5, chars=300)
    f = draw_filler(tok, docs, random.Random(0), 1000, random_start=False, index=3, spread_key="k")
    assert f.document_id == docs[primary_document([d.work for d in docs], 3, "k")].doc_id
    ids = [s["doc_id"] for s in f.sources]
    assert len(ids) > 1 and len(set(ids)) == len(ids)  # too short alone: concatenated, no repeats
    assert len(f.ids) == 1000


@pytest.mark.parametrize("variant", ["retrieval", "continuation"])
def test_task_samples_record_document_id_and_are_spread(variant):
    docs = _docs(6, chars=3000)
    cfg = {"context_tokens": 1024, "n_samples": 14, "seed": 3, "variant": variant, "depths": [0.5],
           "needles": ["pet_name"], "distractors": 0}
    samples = build_task("fiction", cfg, ByteTokenizer(), 4096, docs, DEFAULTS, random_start=True)
    primaries = [s.metadata["document_id"] for s in samples]
    assert all(p == s.metadata["source_docs"][0] for p, s in zip(primaries, samples, strict=True))
    _assert_spread(primaries, len(docs))
    assert set(primaries) == {d.doc_id for d in docs}


def test_split_parts_keeps_every_character_and_the_minimum():
    text = "".join(f"SCENE {k}.\n" + "word " * (40 + 13 * k) + "\n" for k in range(1, 12))
    parts = split_parts(text, re.compile(r"^SCENE \d+", re.M), min_chars=500)
    assert "".join(parts) == text
    assert all(len(p) >= 500 for p in parts) and len(parts) > 2
    assert all(p.startswith("SCENE") for p in parts)  # cut at the divisions only
    assert split_parts("short", re.compile("x"), min_chars=500) == ["short"]


def test_as_parts_names_parts_after_their_work():
    work = Document("gutenberg:x", "fiction", "X", "CHAPTER I\n" + "a " * 400 + "\nCHAPTER II\n" + "b " * 400,
                    "pkg==1:x.txt", "Public domain", "prose")
    parts = as_parts(work, re.compile(r"^CHAPTER", re.M), min_chars=500)
    assert [p.doc_id for p in parts] == ["gutenberg:x#01", "gutenberg:x#02"]
    assert {p.work for p in parts} == {"gutenberg:x"} and parts[1].title == "X (part 2 of 2)"
    assert as_parts(work, re.compile(r"^CHAPTER", re.M), min_chars=10_000) == [work]
    assert work.work == "gutenberg:x"  # a whole work is its own work


def test_documents_used_counts_primary_documents_per_task(tmp_path):
    import json

    import pandas as pd

    from kvbench.tasks import corpora

    meta = [{"document_id": "a#01"}, {"source_docs": ["b", "c"]}, {"source_docs": ["b"]}, {}]
    rows = [{"task": "fiction", "model": "m", "score": 1.0, "sample_id": f"s{i}", "strategy": st,
             "config_hash": "h", "sample_meta": json.dumps(m)}
            for i, m in enumerate(meta) for st in ("full", "snapkv")]
    rows.append({"task": "papers", "model": "m", "score": 1.0, "sample_id": "p0", "strategy": "full",
                 "config_hash": "h", "sample_meta": "{}", "document_id": "pmc:x"})
    (tmp_path / "store").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "store" / "x.parquet")
    # a#01, b (twice), and the sample id s3 for a record without any document field
    assert corpora.documents_used(tmp_path) == {"fiction": {"samples": 4, "documents": 3},
                                                "papers": {"samples": 1, "documents": 1}}
    assert corpora.main(["--results", str(tmp_path / "missing")]) == 2
