"""Disjoint samples for a calibration and the study it calibrates: ``task.pool`` splits a task's works by hash,
``task.first_context`` shifts the sample numbers; at their defaults neither names a run (old run ids stay)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer
from kvbench.tasks.base import build_samples
from kvbench.tasks.corpora import Document
from kvbench.tasks.suite import IDENTITY_NEUTRAL, POOLS, identity_settings, pool_documents


def _docs(n: int = 40) -> list[Document]:
    return [Document(doc_id=f"w{i}#0{j}", text=f"Text {i} {j}. " * 50, work=f"w{i}", domain="d", title="t",
                     source="s", licence="l", form="prose") for i in range(n) for j in (1, 2)]


def test_pools_split_by_work_and_cover_everything() -> None:
    docs = _docs()
    cal, study = pool_documents("legal", docs, "calibration"), pool_documents("legal", docs, "study")
    assert cal and study and len(cal) + len(study) == len(docs)
    assert not {d.work for d in cal} & {d.work for d in study}  # parts of one work stay on one side
    assert pool_documents("legal", docs, "all") == docs
    # The split does not depend on what else the pool holds.
    assert pool_documents("legal", docs[:20], "calibration") == [d for d in cal if d in docs[:20]]


def test_unknown_pool_is_one_line() -> None:
    with pytest.raises(KVBenchError, match="valid: " + ", ".join(POOLS)):
        pool_documents("legal", _docs(), "train")


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    for i in range(12):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(f"Sentence {k} of document {i}." for k in range(300)))
    return tmp_path


def _cfg(corpus: Path, **over):
    cfg = {"name": "custom", "corpus": str(corpus), "context_tokens": 2048, "n_samples": 2, "distractors": 0,
           "query_aware": False, "questions_per_context": 2, "seed": 7}
    return {**cfg, **over}


def test_first_context_shifts_ids_and_content_but_not_the_index(corpus_dir: Path) -> None:
    tok = ByteTokenizer()
    base = build_samples("custom", _cfg(corpus_dir, n_samples=4), tok, 4096)
    shifted = build_samples("custom", _cfg(corpus_dir, first_context=2), tok, 4096)
    far = build_samples("custom", _cfg(corpus_dir, first_context=1000), tok, 4096)
    # Context 2 onwards is the same sample whichever run draws it; ids carry the number, records count from 0.
    assert [(s.sample_id, s.prefix_ids) for s in shifted] == [(s.sample_id, s.prefix_ids) for s in base[4:]]
    assert [s.metadata["index"] for s in shifted] == [0, 0, 1, 1]
    assert far[0].sample_id == "custom/retrieval/1000/q0"
    assert not {s.sample_id for s in far} & {s.sample_id for s in base}
    with pytest.raises(KVBenchError, match="first_context"):
        build_samples("custom", _cfg(corpus_dir, first_context=-1), tok, 4096)


def test_defaults_leave_the_run_identity_alone() -> None:
    from omegaconf import OmegaConf

    from kvbench.config import compose_config

    cfg = compose_config(["task=legal"])
    task = OmegaConf.to_container(cfg.task, resolve=True)
    assert {k: task[k] for k in IDENTITY_NEUTRAL} == IDENTITY_NEUTRAL  # the schema's defaults are the neutral ones
    assert identity_settings(task) == {k: v for k, v in task.items() if k not in IDENTITY_NEUTRAL}
    assert identity_settings({**task, "pool": "study", "first_context": 1000})["pool"] == "study"
