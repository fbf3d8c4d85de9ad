"""Short strategy labels for figures and tables: the name plus the parameters that differ from its defaults.

A strategy's full label (:meth:`strategies.base.Strategy.label`) spells out every parameter, which wraps a
table cell over four lines and runs out of a plot's panel. What a reader needs is what was *changed*:
``snapkv`` at its defaults, ``snapkv(compression_ratio=0.75)`` otherwise. The full parameters stay in the
leaderboard CSV and the store. One function serves the leaderboard, the plots and the end-of-run table.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from kvbench import strategies
from kvbench.errors import KVBenchError


@functools.cache
def default_params(name: str) -> dict[str, str]:
    """A strategy's parameters at its defaults, as label text (``str`` of each value); empty when unknown.

    Built from an instance rather than the dataclass fields, because some defaults are resolved when the
    strategy is built (``compression_ratio=None`` means 0.5) and labels record the resolved value.
    """
    try:
        return {k: str(v) for k, v in strategies.build(name).params().items()}
    except (KVBenchError, TypeError, ValueError):
        return {}


def split_label(label: str) -> tuple[str, dict[str, str]]:
    """``"snapkv(budget_tokens=None,compression_ratio=0.5)"`` -> ``("snapkv", {...})``, values as text.

    Commas inside brackets (``evict_params={a: 1, b: 2}``) belong to their value.
    """
    label = str(label)
    if not (label.endswith(")") and "(" in label):
        return label, {}
    name, inner = label[:-1].split("(", 1)
    parts, depth, cur = [], 0, ""
    for ch in inner:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    params = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if sep:
            params[key.strip()] = value
    return name, params


def short_label(name: str, params: Mapping[str, Any] | None = None,
                defaults: Mapping[str, Any] | None = None) -> str:
    """``name`` plus the parameters that differ from ``defaults`` (the strategy's own when omitted)."""
    params = dict(params or {})
    defaults = default_params(name) if defaults is None else {k: str(v) for k, v in defaults.items()}
    changed = [f"{k}={params[k]}" for k in sorted(params) if str(params[k]) != defaults.get(k)]
    return f"{name}({','.join(changed)})" if changed else name


def shorten(label: str) -> str:
    """The short label of a full strategy label (as the store and summaries key strategies)."""
    name, params = split_label(label)
    return short_label(name, params)
