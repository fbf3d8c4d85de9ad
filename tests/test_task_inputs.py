"""Tasks declare their inputs (issue 27 §4): the run identity digests whatever a task declares with
``register_task(..., inputs=TaskInputs(...))``, so a new file-backed task needs no edit to kvbench.identity."""

from __future__ import annotations

import pytest

from kvbench import identity
from kvbench.tasks import base
from kvbench.tasks.base import Sample, TaskInputs, register_task, task_inputs

NAME = "unit_file_task"


@pytest.fixture
def file_task():
    def build(cfg, tokenizer, max_context) -> list[Sample]:  # never called: only the declaration matters here
        raise AssertionError

    register_task(NAME, inputs=TaskInputs(files=("path",), directories=("docs",)))(build)
    yield NAME
    base._TASKS.pop(NAME), base._INPUTS.pop(NAME)


def _cfg(tmp_path, text: str = "one\n") -> dict:
    (tmp_path / "data.jsonl").write_text(text)
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "a.txt").write_text("alpha")
    return {"path": str(tmp_path / "data.jsonl"), "docs": str(tmp_path / "docs"), "n_samples": 2}


def _dets(name: str, cfg: dict) -> dict:
    return identity.determinants(spec="1.1", task_name=name, task_cfg=cfg, task_inputs=identity.task_digest(name, cfg),
                                 model_name="m", model_digest="d", dtype="float32", device="cpu", hardware={}, seed=0,
                                 prefill="shared", chunk_tokens=0)


def test_a_new_file_backed_task_is_digested_from_its_declaration(file_task, tmp_path):
    cfg = _cfg(tmp_path)
    first = identity.task_digest(file_task, cfg)
    assert first["digest"] and set(first["inputs"]) == {"path", "docs"}
    assert identity.task_digest(file_task, _cfg(tmp_path, "two\n"))["digest"] != first["digest"]  # edited: new run
    cfg = _cfg(tmp_path)
    (tmp_path / "docs" / "a.txt").write_text("beta")  # a document of the declared directory edited
    assert identity.task_digest(file_task, cfg)["digest"] != first["digest"]


def test_where_an_input_lives_is_not_what_it_is(file_task, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    a, b = _dets(file_task, _cfg(here)), _dets(file_task, _cfg(there))
    assert identity.config_hash(a, []) == identity.config_hash(b, [])
    assert "path" not in a["task_config"] and "docs" not in a["task_config"] and a["task_config"]["n_samples"] == 2


def test_a_missing_input_leaves_the_digest_empty(file_task, tmp_path):
    cfg = {**_cfg(tmp_path), "path": str(tmp_path / "missing.jsonl")}
    assert identity.task_digest(file_task, cfg)["digest"] is None


def test_built_in_tasks_declare_what_they_read():
    assert task_inputs("jsonl") == TaskInputs(files=("path",))
    assert task_inputs("custom") == TaskInputs(directories=("corpus",))
    assert {task_inputs(t).corpus for t in ("legal", "fiction", "papers")} == {"legal", "fiction", "papers"}
    assert task_inputs("no_such_task") == TaskInputs()
