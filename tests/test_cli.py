"""Bad input: one line naming the valid choices, non-zero exit, no traceback, no partial record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVBENCH_CACHE": os.environ.get("KVBENCH_CACHE", str(Path.home() / ".cache/kvbench"))}
    return subprocess.run([sys.executable, "-m", "kvbench", *args, f"results_dir={tmp_path}/results"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.parametrize("args, expected", [
    (["strategy=nope"], "unknown strategy 'nope'; valid:"),
    (["task=nope"], "unknown task 'nope'; valid:"),
    (["model=nope"], "unknown model 'nope'; valid:"),
    (["hardware=nope"], "unknown hardware 'nope'; valid:"),
    (["strategies=[int8,nope]"], "unknown strategy 'nope'; valid:"),
    (["strategy=int8", "strategy.bits=4"], "has no parameter 'bits'; valid: group_size"),
    (["model=tiny-llama", "strategy=int8", "strategy.group_size=5"], "int8.group_size must be one of"),
    (["model=tiny-llama", "task.n_samples=0"], "n_samples must be >= 1"),
    (["model=tiny-llama", "task.context_tokens=100000"], "exceeds the model's maximum context of 2048"),
    (["model=tiny-llama", "engine.prefill=sideways"], "valid: shared, chunked"),
    (["model=tiny-llama", "engine.max_new_samples=-1"], "engine.max_new_samples must be >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected, tmp_path):
    proc = _run(*args, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "results" / "store").exists()
