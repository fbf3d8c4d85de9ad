"""The quick start as a new user meets it off a terminal (issue 40): a first line before the model loads, a line
per finished sample with its ETA, the verdict beside Δ, Ctrl-C as one line with resumable results, and ad-hoc
runs kept out of the committed store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvbench.config import compose_config

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"


def _cmd(results: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvbench", "model=tiny-llama", "task=jsonl", f"task.path={FIXTURE}",
            "task.n_samples=4", "hardware.threads=1", "engine.warmup=false", f"results_dir={results}", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_run_off_a_terminal_says_what_runs_then_a_line_per_sample(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run(_cmd(results, "task.max_new_tokens=2"), capture_output=True, text=True, cwd=ROOT,
                          env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("kvbench: tiny_longbench, 4 question(s) x 2 strategies (full, int8) on tiny-llama")
    assert f"into {results}" in lines[0] and ("expected ~" in lines[0] or "no measured rate" in lines[0])
    progress = [ln for ln in lines if "samples stored" in ln]
    assert [ln.split(" of ")[0] for ln in progress] == [f"kvbench: {i}" for i in (1, 2, 3, 4)]
    assert all("eta " in ln for ln in progress)
    header = next(ln for ln in lines if "delta pp (95% CI)" in ln)
    assert "verdict (1 pp)" in header
    assert any("│ int8" in ln and "undetermined at this n" in ln for ln in lines)


def test_ctrl_c_is_one_line_and_the_run_resumes(tmp_path):
    results = tmp_path / "results"
    cmd = _cmd(results, "task.max_new_tokens=48", "task.context_tokens=1900")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    for line in proc.stdout:  # interrupt once the first sample is stored
        if "1 of 4 samples stored" in line:
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "kvbench: interrupted; every finished sample is kept, and the same command resumes from there"]
    [run] = (results / "runs").iterdir()
    kept = [json.loads(ln) for ln in (run / "records.jsonl").read_text().splitlines()]
    assert 2 <= len(kept) < 8 and len(kept) % 2 == 0  # whole samples only: full and int8 of each

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert again.returncode == 0, again.stderr
    records = [json.loads(ln) for ln in (run / "records.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({(r["sample_id"], r["strategy"]) for r in records}) == 8
    assert records[: len(kept)] == kept  # the finished samples were kept, not recomputed


def test_ad_hoc_runs_stay_out_of_the_committed_store():
    assert compose_config(["strategy=int8", "task=legal"]).results_dir == "results/adhoc"
    assert "results/adhoc/" in (ROOT / ".gitignore").read_text().splitlines()
    for sweep in ("leaderboard", "headline"):
        text = (ROOT / "conf" / "sweep" / f"{sweep}.yaml").read_text()
        assert f"results_dir={'results' if sweep == 'leaderboard' else 'results/headline'} " in text


def test_the_first_line_counts_the_questions_and_contexts_the_task_really_holds(tmp_path):
    """15 questions on 6 contexts asked 3 per context with ``task.n_samples=10``: the line says 15 on 6, not the
    config's 30 on 10, and the estimate rests on those counts."""
    from kvbench.models import ByteTokenizer
    from kvbench.runner import announce, resolve_strategies
    from kvbench.tasks.base import build_samples

    f = tmp_path / "own.jsonl"
    per_context = (3, 3, 3, 2, 2, 2)
    f.write_text("".join(json.dumps({"id": f"c{c}q{q}", "context": f"document {c} " * 40, "input": f"q{q}?",
                                     "answers": ["a"]}) + "\n" for c, k in enumerate(per_context) for q in range(k)))
    cfg = compose_config(["model=tiny-llama", "task=jsonl", f"task.path={f}", "task.questions_per_context=3",
                          "task.n_samples=10", f"results_dir={tmp_path / 'results'}"])
    strategies = resolve_strategies(cfg)
    samples = build_samples("jsonl", cfg.task, ByteTokenizer(), 1 << 20)
    assert announce(cfg, strategies, samples).startswith("kvbench: own, 15 question(s) on 6 context(s) x ")
    assert announce(cfg, strategies).startswith("kvbench: own, 30 question(s) on 10 context(s) x ")  # unbuilt


def test_a_closed_stdout_ends_quietly_with_status_0():
    # `kvbench --help | head -3`: the reader closing the pipe is not an error (CI's wheel check runs it under
    # pipefail); the same entry wrapper as the console script, in its own process (it redirects fd 1).
    import subprocess
    import sys

    code = ("from kvbench.cli import interruptible\n"
            "def entry():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "interruptible(entry)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
