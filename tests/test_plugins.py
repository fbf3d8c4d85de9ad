"""A strategy from outside the repository: the worked example of docs/checklists/strategy.md, installed as a
package announcing the ``kvbench.strategies`` entry point (a ``*.dist-info`` on ``sys.path``), runs by name."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

import strategies
from kvbench import cli
from kvbench.results import read_store

ROOT = Path(__file__).resolve().parents[1]
CHECKLIST = ROOT / "docs" / "checklists" / "strategy.md"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _worked_example() -> str:
    text = CHECKLIST.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{CHECKLIST} has no ```python worked example"
    return blocks[-1]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``kvb_example`` with ``recent = kvb_example.recent:Recent`` as a kvbench.strategies entry point."""
    site = tmp_path / "site"
    pkg = site / "kvb_example"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "recent.py").write_text(_worked_example())
    info = site / "kvb_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvb-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvbench.strategies]\nrecent = kvb_example.recent:Recent\n")
    monkeypatch.syspath_prepend(str(site))
    yield "recent"
    strategies._REGISTRY.pop("recent", None)  # leave the registry as other tests expect it
    strategies._SCANNED_PATH.clear()
    for name in [m for m in sys.modules if m.split(".")[0] == "kvb_example"]:
        del sys.modules[name]


def test_entry_point_strategy_is_discovered_beside_the_built_ins(plugin):
    assert plugin in strategies.available()
    assert "int8" in strategies.available()
    s = strategies.build(plugin, {"window": 8})
    assert s.label() == "recent(window=8)"


def test_plugin_strategy_runs_end_to_end_by_name(plugin, tmp_path):
    results = tmp_path / "results"
    cli.main(["model=tiny-llama", "task=jsonl", f"task.path={FIXTURE}", "task.n_samples=1", "task.max_new_tokens=2",
              "strategy=recent", "strategy.window=16", "engine.progress=false", "hardware.threads=1",
              f"results_dir={results}"])
    store = read_store(results)
    assert set(store["strategy"]) == {"full", "recent(window=16)"}
    rec = store[store["strategy"] == "recent(window=16)"].iloc[0]
    assert rec["kv_bytes"] < store[store["strategy"] == "full"].iloc[0]["kv_bytes"]


def test_plugin_parameters_are_checked_like_built_ins(plugin, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["model=tiny-llama", "strategy=recent", "strategy.windw=3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("did you mean 'window'?") and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        cli.main(["model=tiny-llama", "strategy=recent", "strategy.window=abc"])
    assert "strategy.window=abc: expected an integer" in capsys.readouterr().err
