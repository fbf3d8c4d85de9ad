"""kvbench's import graph (issue 27 §2): no import circle and no back-edge, read from the source with ``ast``.

Nodes are the modules of ``kvbench/`` and ``strategies/``; an edge is any import of one of them — at the top,
inside a function (lazy) or under ``TYPE_CHECKING`` — since each is a dependency a reader must follow. A
module's own parent packages are left out (Python imports them first anyway), and the ``strategies`` package
imports every strategy module (its registry does, through importlib).

* **circle**: a cycle among modules.
* **back-edge**: an import from ``strategies/`` of a kvbench module that itself depends on ``strategies``
  (``strategies._tiers`` → ``kvbench.hardware`` → ``kvbench.config`` → ``strategies`` was one): strategies may use
  kvbench's core (errors, quantizers, capture, paths, ...), never the harness built on top of them. Found as a
  cycle once the ``strategies`` package is collapsed into one node.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvbench", "strategies")
STRATEGIES = "kvbench.strategies"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[0] == "strategies":  # installed as kvbench.strategies (pyproject's package-dir)
                parts.insert(0, "kvbench")
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolved against the importing module's package
            anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join(anchor + ([base] if base else []))
        return [base] + [f"{base}.{a.name}" for a in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """``module -> modules it imports`` over kvbench/ and strategies/ (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name in modules and name != module and name not in ancestors:
                    graph[module].add(name)
    graph[STRATEGIES] |= {m for m in modules if m.startswith(STRATEGIES + ".")}  # the registry's importlib loop
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        return list(exc.args[1])
    return None


def _collapsed(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    def node(m: str) -> str:
        return package if m == package or m.startswith(package + ".") else m

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(node(m), set()).update(node(d) for d in deps if node(d) != node(m))
    return out


def test_the_graph_is_read_from_real_imports():
    """Guards the reader: known edges must be found, or 'no cycle' would prove nothing."""
    graph = import_graph()
    assert "kvbench.baselines" in graph["kvbench.loop"]  # top-level `from ... import ... as ...`
    assert STRATEGIES in graph["kvbench.config"]  # a lazy import inside a function
    assert "kvbench.record" in graph["kvbench.baselines"]
    assert STRATEGIES + ".knorm" in graph[STRATEGIES] and "kvbench.paths" in graph["kvbench.hardware"]
    assert _cycle({"a": {"b"}, "b": {"a"}}) is not None


def test_no_import_circle():
    cycle = _cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", [STRATEGIES])
def test_no_back_edge_into_the_layers_above(package):
    cycle = _cycle(_collapsed(import_graph(), package))
    assert cycle is None, f"back-edge: {package} imports a module that imports {package}: " + " -> ".join(cycle or [])


def test_every_package_ships_in_the_wheel():
    """Every directory of kvbench/ holding an ``__init__.py`` is named in pyproject's ``packages``: a new subpackage
    left out installs a wheel whose imports fail (``kvbench.results`` once did, only in CI's fresh-venv check)."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "kvbench").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - declared == set(), f"pyproject.toml's packages misses {sorted(found - declared)}"
