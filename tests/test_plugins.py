"""A strategy from outside the repository: the worked examples of docs/checklists/strategy.md, installed as a
package announcing the ``kvbench.strategies`` entry point (a ``*.dist-info`` on ``sys.path``), run by name; the
one-method scorer passes the registry-wide and parity tests with no other file edited."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvbench import cli, strategies
from kvbench.results import read_store

ROOT = Path(__file__).resolve().parents[1]
CHECKLIST = ROOT / "docs" / "checklists" / "strategy.md"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_longbench.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _worked_example(marker: str = "class Recent(Strategy)") -> str:
    text = CHECKLIST.read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in b]
    assert blocks, f"{CHECKLIST} has no ```python worked example with {marker!r}"
    return blocks[-1]


def _install(site: Path, module: str, source: str, name: str, cls: str) -> None:
    """Package ``kvb_example`` with ``module`` announcing strategy ``name`` (``cls``) as an entry point."""
    pkg = site / "kvb_example"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / f"{module}.py").write_text(source)
    info = site / "kvb_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvb-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvbench.strategies]\n{name} = kvb_example.{module}:{cls}\n")


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``kvb_example`` with ``recent = kvb_example.recent:Recent`` as a kvbench.strategies entry point."""
    site = tmp_path / "site"
    _install(site, "recent", _worked_example(), "recent", "Recent")
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


#: The test files parametrized over the registry: a new strategy is checked by them without being named there.
REGISTRY_WIDE = ["tests/test_eviction.py", "tests/test_parity_eviction.py", "tests/test_config.py",
                 "tests/test_batching.py", "tests/test_device_placement.py"]


def test_one_method_scorer_passes_the_registry_wide_and_parity_tests(tmp_path):
    """Issue 27: the checklist's one-method scorer, as a package and nothing else, is run by the registry-wide
    tests and the parity test (its declared ``reference``), and passes them."""
    site = tmp_path / "site"
    _install(site, "keydiff", _worked_example("(ScorerStrategy)"), "keydiff", "KeyDiff")
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "keydiff",
                           f"--junitxml={report}", *REGISTRY_WIDE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    ran = {c.get("name", "").split("[")[0] for c in cases if c.find("skipped") is None}
    assert {"test_registered_with_yaml_defaults", "test_eviction_shrinks_tensors_and_leaves_inputs_alone",
            "test_shared_prefill_path_then_question_and_decoding", "test_chunked_prefill_compacts_to_budget",
            "test_every_eviction_strategy_has_a_reference", "test_kept_index_sets_equal_the_papers",
            "test_strategy_config_is_its_dataclass", "test_batch_gives_the_records_of_batch_one",
            "test_every_strategy_keeps_its_tensors_on_the_device"} <= ran, ran
