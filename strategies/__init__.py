"""Strategy registry: every module in this package defining a ``Strategy`` subclass with a ``name`` is one, and so
is every class another installed package announces under the entry-point group ``kvbench.strategies``::

    # the other package's pyproject.toml
    [project.entry-points."kvbench.strategies"]
    my_strategy = "my_pkg.my_module:MyStrategy"

A new built-in strategy is one file here plus one YAML in ``conf/strategy/`` that pulls in the schema generated
from its dataclass (see docs/checklists/strategy.md); a plugin strategy needs no YAML. The shortest one is a
:class:`ScorerStrategy` with a single ``score`` method.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from importlib.metadata import entry_points
from typing import Any

from kvbench.strategies._eviction import ScorerStrategy
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy

from kvbench.errors import KVBenchError

__all__ = ["LayerCapture", "LayerStore", "ScorerStrategy", "Strategy", "attention_guided", "available", "build",
           "family_names", "strategy_class"]

ENTRY_POINT_GROUP = "kvbench.strategies"
_REGISTRY: dict[str, type[Strategy]] = {}
_PLUGINS: dict[str, str] = {}  # entry point -> the strategy name it registered
_SCANNED_PATH: list[tuple[str, ...]] = []  # sys.path at the last entry-point scan


def _is_strategy(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, Strategy) and "name" in vars(obj)


def _discover() -> None:
    if not _REGISTRY:
        for mod in pkgutil.iter_modules(__path__):
            if mod.name.startswith("_") or mod.name == "base":
                continue
            module = importlib.import_module(f"{__name__}.{mod.name}")
            for obj in vars(module).values():
                if _is_strategy(obj) and obj.__module__ == module.__name__:
                    _REGISTRY[obj.name] = obj
    _discover_plugins()


def _discover_plugins() -> None:
    """Entry points of group ``kvbench.strategies``, scanned again whenever ``sys.path`` has changed (a package
    put on it after the first look). A plugin cannot replace a built-in strategy."""
    path = tuple(sys.path)
    if _SCANNED_PATH and _SCANNED_PATH[0] == path:
        return
    _SCANNED_PATH[:] = [path]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ep.name}={ep.value}"
        if _PLUGINS.get(key) in _REGISTRY:
            continue
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not take the built-in strategies down with it
            raise KVBenchError(f"strategy plugin {ep.name} = {ep.value!r} failed to import: {exc}") from None
        if not _is_strategy(obj) or not dataclasses.is_dataclass(obj):
            raise KVBenchError(f"strategy plugin {ep.name} = {ep.value!r} is not a Strategy dataclass with a name")
        if obj.name in _REGISTRY and _REGISTRY[obj.name] is not obj:
            raise KVBenchError(f"strategy plugin {ep.value!r} reuses the name {obj.name!r} of "
                               f"{_REGISTRY[obj.name].__module__}; rename it")
        _REGISTRY[obj.name] = obj
        _PLUGINS[key] = obj.name


def available() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    _discover()
    if name not in _REGISTRY:
        raise KVBenchError(f"unknown strategy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def family_names(family: str) -> list[str]:
    """Registered strategies of ``family`` (plugins included), sorted: lists of "every eviction strategy"
    derive from this, so a new one is never silently left out."""
    return [n for n in available() if strategy_class(n).family == family]


def attention_guided(name: str) -> bool:
    """Whether strategy ``name`` chooses what to keep from attention scores (its ``attention_guided``);
    ``False`` for a name no longer registered (records of an uninstalled plugin)."""
    _discover()
    cls = _REGISTRY.get(name)
    return bool(cls is not None and cls.attention_guided)


def build(name: str, params: dict[str, Any] | None = None) -> Strategy:
    """Instantiate a strategy by name, validating parameter names and values."""
    cls = strategy_class(name)
    params = dict(params or {})
    valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise KVBenchError(
            f"strategy {name!r} has no parameter {', '.join(unknown)}; valid: {', '.join(valid) or '(none)'}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise KVBenchError(f"strategy {name!r}: {exc}") from None
