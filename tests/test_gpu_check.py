"""scripts/gpu_check.sh on CPU: its syntax, its dry run (the commands it would run) and its input checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **env}, timeout=300)


def test_syntax() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_prints_the_test_path_and_the_8k_harness_at_batch_4_and_16() -> None:
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    cmds = [ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("+ ")]
    assert "tests/test_gpu_path.py" in cmds[0] and "tests/test_arch_matrix.py" in cmds[0]
    harness = [c for c in cmds if "scripts/bench_harness.py" in c]
    assert len(harness) == 2
    for c, b in zip(harness, ("4", "16"), strict=True):
        assert "--context 8192" in c and f"--batch-size {b} " in c and f"results/perf/gpu/batch{b}" in c
    assert cmds[-1] == "write results/perf/gpu.md"


@pytest.mark.parametrize("args, env, expected", [
    (("--bogus",), {}, "unknown argument --bogus; valid: --dry-run"),
    (("--dry-run",), {"BATCHES": "4 x"}, "BATCHES must be positive integers"),
    (("--dry-run",), {"CONTEXT": "0"}, "CONTEXT must be a positive integer"),
])
def test_bad_input_is_one_line_and_exit_2(args, env, expected) -> None:
    proc = _run(*args, **env)
    assert proc.returncode == 2 and proc.stderr.startswith(f"gpu_check.sh: {expected}")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path) -> None:
    proc = _run(OUT=str(tmp_path))
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "gpu.md").exists()
