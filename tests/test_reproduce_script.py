"""scripts/reproduce_leaderboard.sh: the sweep it would run (--dry-run), its rounds, and its input checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "reproduce_leaderboard.sh"


def _dry(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **env}, timeout=120)


def _sweep_commands(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith("+ ") and " -m kvbench strategies=" in ln]


def test_one_run_per_task_and_setting_by_default():
    proc = _dry(N_SAMPLES="7", TASKS="legal papers")
    assert proc.returncode == 0, proc.stderr
    cmds = _sweep_commands(proc.stdout)
    assert len(cmds) == 4
    assert all("task.n_samples=7" in c and "max_new_samples" not in c for c in cmds)
    assert {("task=legal" in c, "task.query_aware=true" in c) for c in cmds} == {
        (True, True), (True, False), (False, True), (False, False)}


def test_rounds_add_at_most_round_samples_per_run_and_keep_the_run_identity():
    proc = _dry(N_SAMPLES="5", ROUND="2", TASKS="fiction", SETTINGS="false")
    assert proc.returncode == 0, proc.stderr
    cmds = _sweep_commands(proc.stdout)
    assert len(cmds) == 3  # ceil(5 / 2) rounds of one run each
    # Same task.n_samples every round, so every round extends the same run (its id hashes n_samples).
    assert all("task.n_samples=5" in c and "engine.max_new_samples=2" in c for c in cmds)
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("round ")] == [
        "round 1 of 3", "round 2 of 3", "round 3 of 3"]


@pytest.mark.parametrize("env, expected", [
    ({"ROUND": "-1"}, "ROUND must be a non-negative integer"),
    ({"N_SAMPLES": "0"}, "N_SAMPLES must be a positive integer"),
    ({"JOBS": "x"}, "JOBS must be a positive integer"),
    ({"SETTINGS": "maybe"}, "valid: true, false"),
])
def test_bad_environment_is_one_line_and_exit_2(env, expected):
    proc = _dry(**env)
    assert proc.returncode == 2
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
