"""kvbench calibrate: the search order, both criteria, the printed choice and bad input, with a stub evaluator."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import calibrate
from kvbench.errors import KVBenchError

TASK = {"name": "custom", "needles": ["access_code"], "answer_prefix": False, "distractors": 2, "n_samples": 6}


def _stub(accuracy):
    """An evaluator returning ``accuracy(task_cfg)`` as n 0/1 scores (no model)."""
    calls = []

    def evaluate(cfg):
        calls.append((tuple(cfg.needles), bool(cfg.answer_prefix), int(cfg.distractors)))
        n = int(cfg.n_samples)
        hits = round(accuracy(cfg) * n)
        return [1.0] * hits + [0.0] * (n - hits)

    return evaluate, calls


def test_order_is_most_discriminating_first():
    order = calibrate.candidates(["access_code"], False, 2)
    assert order[0] == calibrate.Setting(("access_code",), True, 2)  # the answer prefix is tried first
    assert [s.distractors for s in order] == sorted((s.distractors for s in order), reverse=True)
    at_two = [s for s in order if s.distractors == 2]
    assert at_two[0].needles == ("access_code",) and not at_two[-1].answer_prefix
    assert {s.needles for s in order} >= {("access_code",), ("notice",)}


def test_stops_at_the_first_setting_that_meets_the_point_target():
    # the baseline reaches 5/6 only with one distractor or fewer and the answer prefix on
    evaluate, calls = _stub(lambda c: 5 / 6 if c.distractors <= 1 and c.answer_prefix else 0.5)
    chosen, trials = calibrate.calibrate(OmegaConf.create(TASK), evaluate, target=0.8, max_trials=200)
    assert chosen == calibrate.Setting(("access_code",), True, 1)
    assert len(trials) == len(calls) and trials[-1].meets and not any(t.meets for t in trials[:-1])
    assert trials[-1].accuracy == pytest.approx(5 / 6) and trials[-1].low < 0.8 < trials[-1].high


def test_wilson_criterion_needs_the_lower_bound():
    # 6/6 has a Wilson lower bound of 0.61: the point estimate passes, the bound does not
    evaluate, _ = _stub(lambda c: 1.0)
    chosen, _ = calibrate.calibrate(OmegaConf.create(TASK), evaluate, criterion="point")
    assert chosen is not None
    chosen, trials = calibrate.calibrate(OmegaConf.create(TASK), evaluate, criterion="wilson", max_trials=3)
    assert chosen is None and len(trials) == 3
    # 20/20: lower bound 0.839 >= 0.8
    evaluate, _ = _stub(lambda c: 1.0)
    chosen, _ = calibrate.calibrate(OmegaConf.create({**TASK, "n_samples": 20}), evaluate, criterion="wilson")
    assert chosen == calibrate.Setting(("access_code",), True, 2)


def test_bad_target_or_criterion():
    evaluate, _ = _stub(lambda c: 1.0)
    with pytest.raises(KVBenchError, match="valid: point, wilson"):
        calibrate.calibrate(OmegaConf.create(TASK), evaluate, criterion="bayes")
    with pytest.raises(KVBenchError, match="--target"):
        calibrate.calibrate(OmegaConf.create(TASK), evaluate, target=1.5)


def test_command_prints_the_chosen_settings(tmp_path: Path, capsys):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text. " * 50)
    evaluate, calls = _stub(lambda c: 1.0 if c.distractors == 0 else 0.0)
    argv = ["task=custom", f"task.corpus={corpus}", "task.distractors=1", "--n", "5", "--max-trials", "100"]
    assert calibrate.main(argv, make_evaluator=lambda cfg: evaluate) == 0
    out = capsys.readouterr().out
    assert "chosen: task.needles=[access_code] task.answer_prefix=true task.distractors=0" in out
    assert f"run:    python -m kvbench task=custom task.corpus={corpus}" in out
    assert all(c[2] in (0, 1) for c in calls)
    # never reached: exit status 1 and a hint; bad input: one line, status 2
    never, _ = _stub(lambda c: 0.0)
    assert calibrate.main([*argv[:3], "--max-trials", "2"], make_evaluator=lambda cfg: never) == 1
    assert "no setting reached 0.8 in 2 trial(s)" in capsys.readouterr().out
    assert calibrate.main(["task=ruler"], make_evaluator=lambda cfg: never) == 2
    assert "valid: custom, legal, papers, fiction" in capsys.readouterr().err


def test_overrides_may_follow_the_options(tmp_path: Path, capsys):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text. " * 50)
    seen = []

    def make(cfg):
        seen.append(cfg)
        return _stub(lambda c: 1.0)[0]

    argv = ["task=custom", "--n", "3", f"task.corpus={corpus}", "--max-trials", "2", "task.distractors=1"]
    assert calibrate.main(argv, make_evaluator=make) == 0
    assert seen[0].task.corpus == str(corpus) and seen[0].task.n_samples == 3
    assert f"run:    python -m kvbench task=custom task.corpus={corpus} task.distractors=1" in capsys.readouterr().out


def test_cli_dispatches_calibrate():
    from kvbench.cli import SUBCOMMANDS

    assert SUBCOMMANDS["calibrate"] == "kvbench.calibrate"
