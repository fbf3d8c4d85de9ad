"""``kvbench design``: the confirmatory study registered for another model and hardware."""

from __future__ import annotations

import pytest
import yaml

from kvbench import design_cli, registration
from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir


@pytest.fixture
def planned(monkeypatch):
    calls = []

    def fake(planning, alpha, margin_pp, look_every, spending, beta):
        calls.append((dict(planning), alpha, margin_pp, look_every, spending, beta))
        return 7 * look_every

    monkeypatch.setattr(registration, "planned_contexts", fake)
    return calls


def test_files_follow_the_template_with_the_users_settings(planned) -> None:
    template = yaml.safe_load((conf_dir() / "design" / "confirm.yaml").read_text())
    design, sweep = design_cli.make_files(
        "llama8b", ["model=local", "model.path=/models/Llama-3.1-8B", "hardware=server-gpu-80g",
                    "task.questions_per_context=4"], {"discordance": 0.03, "design_effect": None, "power": 0.9}, 10)
    plan = planned[0][0]
    assert plan["discordance"] == 0.03 and plan["power"] == 0.9 and plan["questions_per_context"] == 4
    assert plan["design_effect"] == template["planning"]["design_effect"]
    assert design["planned_contexts"] == 70 and design["look_every"] == 10 and design["sweep"] == "llama8b"
    for key in ("members", "margin_pp", "statistic", "futility", "scopes", "multiplicity", "alpha"):
        assert design[key] == template[key]
    assert "reader" not in design  # another machine's reader: its records name it
    o = design_cli._override_map(sweep["overrides"])
    assert o["results_dir"] == "results/llama8b" and o["model.path"] == "/models/Llama-3.1-8B"
    assert o["task.n_samples"] == "70" and o["task.first_context"] == "0"
    assert int(o["task.seed"]) != template["samples"]["seed"] == 4049
    assert set(design["samples"]) == set(template["samples"])
    assert "kvbench design" in plan["source"]


def test_cost_is_a_roofline_on_the_profile(planned) -> None:
    design, sweep = design_cli.make_files("l8", ["hardware=server-gpu-80g"], {}, None)
    text = design_cli.cost_text(design, sweep, "llama-3-8b")
    hours = float(text.split(" = ")[1].split(" device-hours")[0])
    assert "server-gpu-80g" in text and hours > 0


@pytest.mark.parametrize("name", ["confirm", "Bad Name", ""])
def test_bad_names_refused(name: str, planned) -> None:
    with pytest.raises(KVBenchError, match="design name"):
        design_cli.make_files(name, [], {}, None)


def test_cli_bad_input_is_one_line(capsys, planned) -> None:
    assert design_cli.main(["x1", "model=nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench design: error:")
    assert not (conf_dir() / "design" / "x1.yaml").exists()
    assert design_cli.main(["x1", "--run"]) == 2
    assert not (conf_dir() / "design" / "x1.yaml").exists()
