"""tracking=mlflow: one MLflow run per kvbench run (identity as parameters and tags, per-strategy figures as
metrics, the run directory as artifacts), read back with mlflow.search_runs; tracking=none writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench import tracking


def _run(args: list[str]) -> int:
    from kvbench import cli

    try:
        cli.main(["model=tiny-llama", "hardware.threads=1", "engine.progress=false",
                  "task.max_new_tokens=2", *args])
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_metric_names_are_ones_mlflow_accepts():
    assert tracking.metric_key("int8(axis=token,group_size=64)", "delta_pp") == "int8_axis_token_group_size_64/delta_pp"
    assert tracking.metric_key("snapkv(compression_ratio=0.5)", "delta_pp") == "snapkv_compression_ratio_0.5/delta_pp"
    assert tracking.metric_key("legal", "query-agnostic", "full", "accuracy") == "legal/query-agnostic/full/accuracy"


def test_tracking_uri_defaults_to_a_file_store_under_results(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(None, tmp_path) == (tmp_path.resolve() / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracker:5000")
    assert tracking.tracking_uri(None, tmp_path) == "http://tracker:5000"
    assert tracking.tracking_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"


def test_bad_choice_or_missing_mlflow_is_one_line(tmp_path, capsys, monkeypatch):
    assert _run(["tracking=wandb", f"results_dir={tmp_path}"]) == 2
    assert "unknown tracking 'wandb'; valid: mlflow, none" in capsys.readouterr().err
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert _run(["tracking=mlflow", "strategy=int8", "task.n_samples=1", f"results_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "tracking=mlflow needs MLflow" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_a_run_is_logged_once_and_read_back_with_search_runs(tmp_path, monkeypatch):
    """python -m kvbench tracking=mlflow strategy=int8 task.n_samples=1 (on the tiny model)."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = tmp_path / "results"
    args = ["tracking=mlflow", "strategy=int8", "task.n_samples=1", f"results_dir={results}"]
    assert _run(args) == 0
    (run_dir,) = (results / "runs").iterdir()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked to
    mlflow.set_tracking_uri((results / "mlruns").as_uri())
    runs = mlflow.search_runs(experiment_names=["kvbench"])
    assert len(runs) == 1
    row = runs.iloc[0]
    identity = json.loads((run_dir / "identity.json").read_text())
    assert row["tags.kvbench.run_id"] == run_dir.name and row["status"] == "FINISHED"
    assert row["tags.kvbench.config_hash"] == identity["config_hash"]
    assert row["params.model"] == "tiny-llama" and row["params.task_config.n_samples"] == "1"
    assert row["params.model_digest"] == identity["model_digest"]
    import pandas as pd

    from kvbench.labels import shorten

    summary = pd.read_csv(run_dir / "summary.csv")
    for _, s in summary.iterrows():  # metrics by the short label the tables show; the full label a parameter
        short = shorten(s["strategy"])
        assert row[f"metrics.{tracking.metric_key(short, 'accuracy')}"] == pytest.approx(s["accuracy"])
        assert row[f"metrics.{tracking.metric_key(short, 'kv_mib')}"] == pytest.approx(s["kv_mib"])
        assert row[f"params.strategy.{tracking.metric_key(short)}"] == s["strategy"]
    assert "metrics.int8/accuracy" in runs.columns
    artifacts = {Path(a.path).name for a in mlflow.MlflowClient().list_artifacts(row["run_id"], "run")}
    assert {"identity.json", "config.yaml", "summary.csv", "records.jsonl"} <= artifacts
    assert not any(name.startswith(".") for name in artifacts)  # no lock, no claims: transient files
    # docs/tracking.md's reading example, as written, on this store
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tracking.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'mlflow.set_tracking_uri("file:///path/to/results/mlruns")' in example
    scope: dict = {}
    exec(example.replace("file:///path/to/results/mlruns", (results / "mlruns").as_uri()), scope)  # noqa: S102
    assert len(scope["runs"]) == 1
    last = example.strip().splitlines()[-1]  # the frame the example ends on: every column it names is there
    shown = eval(last, scope)  # noqa: S307
    assert list(shown.iloc[0]) == [run_dir.name, identity["task"], pytest.approx(row["metrics.int8/accuracy"]),
                                   pytest.approx(row["metrics.int8/delta_pp"])]
    # the same kvbench run again (resumed): the same MLflow run
    assert _run(args) == 0
    assert len(mlflow.search_runs(experiment_names=["kvbench"])) == 1


def test_no_tracking_by_default(tmp_path):
    results = tmp_path / "results"
    assert _run(["strategy=int8", "task.n_samples=1", f"results_dir={results}"]) == 0
    assert (results / "runs").is_dir() and not (results / "mlruns").exists()
