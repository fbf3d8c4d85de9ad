"""Text formatting shared by every report: escaping per output format and NaN-aware number formatting
(a missing figure never prints as ``nan``; an interval always reads ``estimate [low, high]``).

Names in the result store (strategy labels, families, tasks, models) come from configs, plugins and
imported results, so a report must treat them as data, never as markup. GitHub-flavoured Markdown renders
raw HTML and splits table rows on ``|`` (GFM spec, "Tables" and "Raw HTML"), so a name is written with
HTML entities for ``& < >`` and a backslash before ``|``; an HTML page escapes with :func:`html.escape`;
CSV quoting is pandas' own (``to_csv``, RFC 4180 quoting).

:class:`Markdown` and :class:`Html` are two *styles* with the same three methods (``text``, ``code``,
``bold``), so one sentence builder writes both a ``.md`` and an ``.html`` page without ever handling raw
markup itself.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

import pandas as pd

#: Shown for a missing figure (NaN, None).
MISSING = "–"
#: Columns of a store frame or summary that hold names (free text from configs, plugins, imported files).
NAME_COLUMNS = ("strategy", "family", "task", "model", "strategy_name", "label")

# Characters outside this set are never put in a code span: inside a code span GFM shows entities and
# backslashes literally, so a name holding markup is written as escaped plain text instead.
_PLAIN_CODE = re.compile(r"[A-Za-z0-9_.,:;=(){}\[\]'\"+\-/ ]*")


def is_missing(value: Any) -> bool:
    """None or a float NaN (pandas' missing values included)."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def md_text(text: Any) -> str:
    """``text`` safe anywhere in a Markdown page, table cells included: HTML entities for ``& < >``,
    ``\\|`` for a pipe, and a backslash before the inline-markup characters ``\\ ` * [ ]`` and before an
    ``_`` that could open or close emphasis (GFM never reads one inside a word, as in ``streaming_llm``)."""
    out = html.escape(str(text), quote=False)
    out = re.sub(r"([\\`*\[\]|])", r"\\\1", out)
    out = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", out)
    return out.replace("\n", " ").replace("\r", " ")


def md_code(text: Any) -> str:
    """``text`` as an inline code span when it is plain; as escaped plain text when it is not."""
    text = str(text)
    if _PLAIN_CODE.fullmatch(text):
        return f"`{text}`"
    return md_text(text)


def md_cell(text: Any) -> str:
    """A Markdown table cell that is already Markdown (may hold code spans): only its pipes are escaped,
    the one character that would move every later number into the wrong column."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def escape_names(frame: pd.DataFrame, columns: tuple[str, ...] = NAME_COLUMNS) -> pd.DataFrame:
    """A copy of ``frame`` whose name columns are Markdown-safe for renderers that interpolate names into
    Markdown themselves (``claims.render_claims``). The mapping is injective on names, so rows that paired
    before still pair; plain names (letters, digits, ``_.,=()``) come out unchanged."""
    out = frame.copy()
    for col in columns:
        if col in out.columns:
            out[col] = out[col].map(lambda v: v if is_missing(v) else md_name(str(v)))
    return out


def md_name(name: str) -> str:
    """A name for a Markdown renderer that puts it in code spans and table cells itself."""
    # Names go into code spans, where backslash escapes other than ``\|`` (tables) are shown literally:
    # escape only what breaks the page (markup, a cell boundary, a code span's end).
    return html.escape(name, quote=False).replace("|", "\\|").replace("`", "'").replace("\n", " ")


class Markdown:
    """Writes GitHub-flavoured Markdown."""

    @staticmethod
    def text(s: Any) -> str:
        return md_text(s)

    @staticmethod
    def code(s: Any) -> str:
        return md_code(s)

    @staticmethod
    def bold(s: str) -> str:
        return f"**{s}**"


class Html:
    """Writes HTML."""

    @staticmethod
    def text(s: Any) -> str:
        return html.escape(str(s), quote=True)

    @staticmethod
    def code(s: Any) -> str:
        return f"<code>{html.escape(str(s), quote=True)}</code>"

    @staticmethod
    def bold(s: str) -> str:
        return f"<strong>{s}</strong>"


# ------------------------------------------------------------------------------------------- numbers
# Every report formats its figures through these, so a missing figure never prints as "nan" and an interval
# reads the same everywhere: ``estimate [low, high]``.

#: Shown for a missing figure where the output is plain ASCII text (the end-of-run console table, the
#: scripts' Markdown reports).
MISSING_ASCII = "-"


def number(value: Any, spec: str, missing: str = MISSING) -> str:
    """``format(value, spec)``; ``missing`` for a missing figure (None, NaN)."""
    return missing if is_missing(value) else format(value, spec)


def pp(value: Any, digits: int = 1) -> str:
    """A signed number of percentage points, ``+0.0``; ``–`` when missing."""
    return MISSING if is_missing(value) else f"{float(value):+.{digits}f}"


def pct(value: Any, digits: int = 1) -> str:
    """A fraction as a percentage, ``48.4%``; ``–`` when missing."""
    return MISSING if is_missing(value) else f"{100 * float(value):.{digits}f}%"


def interval(estimate: Any, low: Any, high: Any, spec: str = "+.1f", *, unit: str = "", label: str = "",
             missing: str = MISSING) -> str:
    """``estimate[ unit] [label low, high]``, every figure formatted with ``spec`` and a missing one shown as
    ``missing``: ``-25.0 [-50.0, +0.0]``, or with ``unit=" pp", label="95% CI "``
    ``-0.5 pp [95% CI -1.5, +0.5]``."""
    e, lo, hi = (number(v, spec, missing) for v in (estimate, low, high))
    return f"{e}{unit} [{label}{lo}, {hi}]"


def delta_interval(delta: Any, low: Any, high: Any, digits: int = 1) -> str:
    """``Δ [low, high]``: ``-7.7 [-23.9, +6.8]``; ``–`` without a point estimate, and the interval left out
    when either bound is missing (a bound is never printed as a number we did not compute)."""
    if is_missing(delta):
        return MISSING
    if is_missing(low) or is_missing(high):
        return pp(delta, digits)
    return interval(delta, low, high, f"+.{digits}f")


def is_finite(value: Any) -> bool:
    return not is_missing(value) and math.isfinite(float(value))


def as_float(value: Any) -> float:
    """``float(value)``, or NaN where ``value`` is no number (None, a word): figures read from files the harness
    did not write (sample metadata, lm-eval's results) are missing rather than fatal."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
