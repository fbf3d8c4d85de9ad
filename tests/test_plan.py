"""`kvbench plan`: questions per claim from assumptions and from a store; bad input is one line, exit 2."""

from __future__ import annotations

import re

import pytest
from test_claims import _records

from kvbench import plan, stats


def test_assumed_discordance_gives_connor_s_count(capsys):
    assert plan.main(["--discordance", "0.0196", "--baseline-accuracy", "1"]) == 0
    out = capsys.readouterr().out
    n = stats.questions_needed(0.0098, 0.0098, 0, 0.01, 1.0)
    assert n == stats.paired_n(0.0098, 0.0098, 0.01) and f"{n:,} questions" in out
    assert "zero flips alone need 381 questions" in out
    assert plan.main(["--discordance", "0.0196", "--deff", "2"]) == 0
    assert f"{2 * n:,} questions" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--discordance", "2"], "--discordance must be in [0, 1]"),
    (["--discordance", "0"], "--discordance 0 needs --observed N"),
    (["--discordance", "0.1", "--deff", "0.5"], "--deff must be >= 1"),
    (["--discordance", "0.01", "--net-loss", "5"], "--net-loss cannot exceed the discordance"),
    (["--discordance", "x"], "invalid float value: 'x'"),
    (["--nope"], "unrecognized arguments: --nope"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        code = plan.main(args)
        raise SystemExit(code)
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("kvbench plan: error:") and expected in err[0]


def test_store_plan_lists_every_headline_member_and_scenario(tmp_path, capsys):
    recs = _records({"full": [1] * 8, "int8": [1] * 8, "snapkv": [0] * 8},
                    reduction={"int8": 0.48, "snapkv": 0.5}, docs=[f"d{i // 2}" for i in range(8)])
    recs = recs.assign(dtype="float32", config_hash="abc", run_id="legal-m-abc", seed=0, query_aware=False,
                       strategy_name=recs["strategy"], params="{}")
    (tmp_path / "store").mkdir()
    recs.to_parquet(tmp_path / "store" / "legal-m-abc.parquet")
    assert plan.main(["--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [re.split(r"\s{2,}", ln) for ln in out.splitlines() if ln.startswith("query-agnostic  headline")]
    by_strategy = {r[3]: r for r in rows}
    assert set(by_strategy) == {"int8", "snapkv"}
    int8 = by_strategy["int8"]  # zero flips in 8 questions from 4 documents: undetermined
    assert int8[4:6] == ["undetermined at this n", "8 / 4"]
    # planned at the discordance's upper bound, at least the zero-flip n times the design effect
    assert int(int8[6].replace(",", "")) > int(int8[7].replace(",", "")) >= 381
    assert by_strategy["snapkv"][4] == "fails"
    assert "legal analysis" in out
