"""task=hf: local Hugging Face datasets (saved DatasetDict, parquet), presets, truncation, identity, metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbench import identity
from kvbench.errors import KVBenchError
from kvbench.models import ByteTokenizer
from kvbench.tasks import hf
from kvbench.tasks.base import build_samples
from kvbench.tasks.metrics import score

datasets = pytest.importorskip("datasets")

LONG = "The harbour office keeps the tide tables. " * 200  # ~8,400 bytes: longer than the budgets below


def _longbench_rows() -> dict[str, list[Any]]:
    return {
        "_id": ["q1", "q2", "q3"],
        "dataset": ["qasper"] * 3,
        "context": ["START " + LONG + " The answer is ketch. END", "Short context about a brig.", LONG],
        "input": ["Which boat?", "Which ship?", "Which tide?"],
        "answers": [["ketch"], ["brig", "a brig"], ["spring tide"]],
        "all_classes": [None, None, None],
        "length": [1000, 5, 800],
    }


@pytest.fixture
def saved_longbench(tmp_path: Path) -> Path:
    """A LongBench-shaped DatasetDict saved with datasets' own save_to_disk."""
    d = tmp_path / "longbench_qasper"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(_longbench_rows())}).save_to_disk(str(d))
    return d


@pytest.fixture
def parquet_file(tmp_path: Path) -> Path:
    f = tmp_path / "my_qa.parquet"
    datasets.Dataset.from_dict({"doc": [LONG, "Tiny."], "q": ["What is kept?", "Size?"], "gold": ["tables", "tiny"],
                                "key": ["a", "b"], "scorer": ["substring", "f1"]}).to_parquet(str(f))
    return f


def _build(**cfg: Any) -> list:
    return build_samples("hf", {"name": "hf", "context_tokens": 1024, **cfg}, ByteTokenizer(), 1 << 20)


def test_longbench_saved_dataset_dict(saved_longbench):
    samples = _build(dataset=str(saved_longbench), preset="longbench")
    assert [s.sample_id for s in samples] == [f"hf_qasper/q{k}" for k in (1, 2, 3)]  # the rows' `dataset`
    long, short = samples[0], samples[1]
    assert all(s.metric == "f1" and s.max_new_tokens == 128 for s in samples)  # LongBench: qasper -> qa_f1, 128
    assert len(long.prefix_ids) == 1024 and long.metadata["truncated"]
    assert long.metadata["original_context_tokens"] > 8000 and long.metadata["truncation"] == "middle"
    text = ByteTokenizer().decode(long.prefix_ids)
    assert "START" in text and "END" in text  # middle truncation keeps both ends
    assert len(short.prefix_ids) < 1024 and not short.metadata["truncated"]
    assert short.answers == ["brig", "a brig"] and "Which ship?" in ByteTokenizer().decode(short.prefix_ids)
    assert hf.record_name({"dataset": str(saved_longbench), "preset": "longbench"}) == "hf_qasper"


def test_the_task_name_does_not_depend_on_the_container(saved_longbench, tmp_path):
    """The same rows saved with save_to_disk, as JSON Lines and as parquet under other names: one task name."""
    rows = datasets.Dataset.from_dict(_longbench_rows())
    rows.to_json(str(tmp_path / "qasper.jsonl"))
    rows.to_parquet(str(tmp_path / "export.parquet"))
    paths = [saved_longbench, tmp_path / "qasper.jsonl", tmp_path / "export.parquet"]
    assert {hf.record_name({"dataset": str(p)}) for p in paths} == {"hf_qasper"}
    assert {s.sample_id for p in paths for s in _build(dataset=str(p))} == {"hf_qasper/q1", "hf_qasper/q2",
                                                                             "hf_qasper/q3"}
    # without a `dataset` column the file or folder names it; task.dataset_name always wins
    plain = datasets.Dataset.from_dict({k: v for k, v in _longbench_rows().items() if k != "dataset"})
    plain.save_to_disk(str(tmp_path / "longbench_disk"))
    assert hf.record_name({"dataset": str(tmp_path / "longbench_disk")}) == "hf_longbench_disk"
    assert hf.record_name({"dataset": str(tmp_path / "longbench_disk"), "dataset_name": "qa"}) == "qa"


def test_parquet_with_field_mapping_and_row_metrics(parquet_file):
    samples = _build(dataset=str(parquet_file), context_field="doc", question_field="q", answers_field="gold",
                     id_field="key", metric_field="scorer", query_aware=False)
    assert [s.sample_id for s in samples] == ["hf_my_qa/a", "hf_my_qa/b"]
    assert [s.metric for s in samples] == ["substring", "f1"]
    assert "What is kept?" in ByteTokenizer().decode(samples[0].query_ids)  # asked after compression
    assert len(samples[0].prefix_ids) == 1024


def test_identity_digests_the_files_and_fingerprints(saved_longbench, parquet_file):
    cfg = {"dataset": str(saved_longbench)}
    first = identity.task_digest("hf", cfg)
    assert first["kind"] == "hf" and first["files"] >= 3 and first["fingerprints"]
    assert identity.task_digest("hf", cfg) == first
    rows = _longbench_rows()
    rows["answers"][0] = ["yawl"]
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(str(saved_longbench))
    assert identity.task_digest("hf", cfg)["digest"] != first["digest"]
    p = identity.task_digest("hf", {"dataset": str(parquet_file)})
    parquet_file.write_bytes(parquet_file.read_bytes() + b"\0")
    assert identity.task_digest("hf", {"dataset": str(parquet_file)})["digest"] != p["digest"]


def test_jsonl_files_infinitebench_preset(tmp_path):
    f = tmp_path / "passkey.jsonl"
    f.write_text('{"id": 0, "context": "noise noise. The pass key is 71432. noise.", "input": "What is the pass key?", '
                 '"answer": ["71432"], "options": []}\n')
    (s,) = _build(dataset=str(f), preset="infinitebench")
    assert s.metric == "substring" and s.max_new_tokens == 6 and s.answers == ["71432"]
    assert s.sample_id == "hf_passkey/0"
    # a glob of files is named after its folder; the subset is then given
    (g,) = _build(dataset=str(tmp_path / "*.jsonl"), preset="infinitebench", subset="passkey")
    assert g.answers == ["71432"] and hf.record_name({"dataset": str(tmp_path / "*.jsonl")}) == f"hf_{tmp_path.name}"


def test_bad_input_is_one_clear_error(tmp_path, saved_longbench):
    with pytest.raises(KVBenchError, match="needs task.dataset"):
        _build()
    with pytest.raises(KVBenchError, match="does not exist"):
        _build(dataset=str(tmp_path / "missing"))
    with pytest.raises(KVBenchError, match="valid: test"):
        _build(dataset=str(saved_longbench), split="train")
    with pytest.raises(KVBenchError, match="valid: _id"):
        _build(dataset=str(saved_longbench), context_field="text")
    with pytest.raises(KVBenchError, match="unknown task.preset"):
        _build(dataset=str(saved_longbench), preset="helm")
    with pytest.raises(KVBenchError, match="jieba"):
        _build(dataset=str(saved_longbench), preset="longbench", subset="dureader")
    # naming a metric scores a subset the preset cannot
    assert _build(dataset=str(saved_longbench), preset="longbench", subset="dureader", metric="substring")


# ------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("metric, prediction, answers, expected", [
    # ROUGE-L F1: LCS "the cat sat" = 3 of 4 / 3 words -> p=0.75, r=1
    ("rouge_l", "the cat sat down", ["the cat sat"], 2 * 0.75 / 1.75),
    ("rouge_l", "", ["x"], 0.0),
    # LongBench code_sim: the first line without a comment, difflib ratio 2*M/T = 2*9/(10+9) -> 0.95
    ("code_sim", "# comment\nreturn a+b\nmore", ["return ab"], 0.95),
    ("code_sim", "```python", ["x = 1"], 0.0),
    # retrieval: 2 of the 3 numbers in the reply are the paragraph's
    ("retrieval_score", "Paragraph 12, not 3, so 12", ["Paragraph 12"], 2 / 3),
    ("retrieval_score", "no number", ["Paragraph 12"], 0.0),
    ("count_score", "There are 7 paragraphs, 7 unique", ["7"], 1.0),
    ("count_score", "7 or 8", ["7"], 0.5),
])
def test_longbench_metrics_hand_cases(metric, prediction, answers, expected):
    assert score(metric, prediction, answers) == pytest.approx(expected)


def test_rouge_l_matches_the_rouge_score_package():
    rs = pytest.importorskip("rouge_score.rouge_scorer")
    scorer = rs.RougeScorer(["rougeL"])
    pairs = [("The quick brown fox jumps over the lazy dog.", "A quick fox jumped over a lazy dog!"),
             ("minutes were read aloud before new business", "the minutes of the meeting were read aloud"),
             ("x1 y2 z3", "z3 y2 x1")]
    for pred, ref in pairs:
        assert score("rouge_l", pred, [ref]) == pytest.approx(scorer.score(ref, pred)["rougeL"].fmeasure)


# ------------------------------------------------------------------------------------------- end to end


def _run(args: list[str]) -> None:
    from kvbench import cli

    try:
        cli.main(["model=tiny-llama", "hardware.threads=1", "engine.progress=false", "task.n_samples=1",
                  "task.max_new_tokens=2", "strategy=snapkv", *args])
    except SystemExit as exc:
        assert not exc.code


@pytest.mark.parametrize("kind", ["saved", "parquet"])
def test_runs_through_the_harness(kind, saved_longbench, parquet_file, tmp_path):
    """python -m kvbench task=hf on the tiny random model: records name the dataset, carry its digest."""
    from kvbench.results import read_store

    results = tmp_path / "results"
    if kind == "saved":
        args = [f"task.dataset={saved_longbench}", "task.preset=longbench"]
    else:
        args = [f"task.dataset={parquet_file}", "task.context_field=doc", "task.question_field=q",
                "task.answers_field=gold", "task.metric=f1"]
    _run(["task=hf", "task.context_tokens=512", f"results_dir={results}", *args])
    store = read_store(results)
    assert set(store["strategy"].str.split("(").str[0]) == {"full", "snapkv"}
    assert set(store["task"]) == {"hf_qasper" if kind == "saved" else "hf_my_qa"}
    assert set(store["metric"]) == {"f1"}
    digest = identity.task_digest("hf", {"dataset": str(saved_longbench if kind == "saved" else parquet_file)})
    assert set(store["task_digest"]) == {digest["digest"]}


def test_the_task_config_lists_every_preset_and_setting():
    """conf/task/hf.yaml is where a user reads the choices (`--cfg job` prints values, not choices)."""
    from pathlib import Path

    from kvbench.tasks.hf import HF_DEFAULTS, PRESETS

    text = (Path(__file__).resolve().parents[1] / "conf" / "task" / "hf.yaml").read_text()
    assert f"preset: {' | '.join(PRESETS)}" in text
    assert all(key in text for key in HF_DEFAULTS if key.endswith("_field"))


def test_cfg_job_prints_the_config_without_reading_the_dataset(capsys, monkeypatch, saved_longbench):
    """`--cfg job` printed the config only after building the task's samples (the up-front check of a run):
    on a real dataset, a download and a tokenization to print a YAML. The run's own check still reads it."""
    import yaml

    from kvbench import cli
    from kvbench.config import check_overrides

    read = []
    real = hf.load
    monkeypatch.setattr(hf, "load", lambda cfg: read.append(cfg) or real(cfg))
    args = ["model=tiny-llama", "task=hf", f"task.dataset={saved_longbench}", "task.preset=longbench",
            "task.context_tokens=512", "task.n_samples=2"]
    with pytest.raises(SystemExit) as exc:
        cli.main([*args, "--cfg", "job"])
    assert exc.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["task"]["dataset"] == str(saved_longbench) and cfg["task"]["n_samples"] == 2
    assert read == []
    assert check_overrides(args) == 1 and len(read) == 1  # without --cfg the samples are built before the run
