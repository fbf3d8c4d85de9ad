"""The headline command on the real embedded model at short context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def _kvbench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvbench", "strategy=int8", "task=legal", "task.context_tokens=768",
           "task.n_samples=2", "engine.progress=false", f"results_dir={tmp_path}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ), timeout=900)


def test_headline_command_end_to_end_and_resume(smollm, tmp_path):
    first = _kvbench(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    run_dir = Path(first.stdout.strip().splitlines()[-1].split("results: ", 1)[1])
    summary = pd.read_csv(run_dir / "summary.csv")
    int8 = summary[summary["strategy"].str.startswith("int8")].iloc[0]
    full = summary[summary["strategy"] == "full"].iloc[0]
    assert 0.47 <= int8["memory_reduction"] <= 0.50  # 8 bits + a float16 scale per 64 values, vs 16 bits
    assert full["memory_reduction"] == pytest.approx(0.0)  # bf16 cache = the 16-bit reference
    assert int8["n"] == 2 and full["accuracy"] >= 0.5
    for name in ("config.yaml", "environment.json", "records.jsonl", "summary.csv"):
        assert (run_dir / name).is_file()
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["packages"]["torch"] and env["torch_threads"] >= 1
    assert (tmp_path / "store" / f"{run_dir.name}.parquet").is_file()

    records = (run_dir / "records.jsonl").read_text()
    again = _kvbench(tmp_path)  # identical config: every sample is finished, nothing is recomputed
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run_dir / "records.jsonl").read_text() == records
