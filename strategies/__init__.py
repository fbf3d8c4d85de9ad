"""Strategy registry: every module in this package defining a ``Strategy`` subclass with a ``name`` is one.

A new strategy is one file here plus one YAML in ``conf/strategy/``; nothing else is edited.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from kvbench.errors import KVBenchError
from strategies.base import LayerCapture, LayerStore, Strategy

__all__ = ["LayerCapture", "LayerStore", "Strategy", "available", "build", "strategy_class"]

_REGISTRY: dict[str, type[Strategy]] = {}


def _discover() -> None:
    if _REGISTRY:
        return
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_") or mod.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Strategy) and obj.__module__ == module.__name__
                    and "name" in vars(obj)):
                _REGISTRY[obj.name] = obj


def available() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def strategy_class(name: str) -> type[Strategy]:
    _discover()
    if name not in _REGISTRY:
        raise KVBenchError(f"unknown strategy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


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
