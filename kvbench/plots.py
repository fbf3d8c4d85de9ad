"""Comparison figures over the result store: pure functions of a summary or paired-records DataFrame.

* :func:`pareto_figure` — memory saved vs accuracy delta (95% CI), every point at its exact memory saved and
  every strategy labelled (short label, placed clear of each other with leader lines), the Pareto front drawn on
  top, the legend inside the figure; offloading strategies (``tiered``) in a panel of their own, because what they
  save is *device* memory, not bytes;
* :func:`latency_figure` — what differs between strategies once the prefill is shared: compression time,
  question (query) time and decode time per token, as box plots over samples;
* :func:`memory_figure` — KV bytes held per context token per strategy, against the architecture formula
  for ``full``; the offloading tier drawn apart as device-resident bytes;
* :func:`needle_figure` — accuracy by needle depth × context length for ``full`` and the most informative
  strategies, with the sample count in each cell; depths binned (:data:`DEPTH_BINS`) when they are many;
* :func:`needle_map_figure` — the same grid as the paired loss against ``full`` (points, n pairs per cell).

Every figure takes a DataFrame (``summary`` rows of :func:`kvbench.report.summarize` with a ``setting``
column, or paired records as :func:`kvbench.selection.paired_records` returns them, with ``setting`` and
``depth`` columns); selecting the records is :mod:`kvbench.selection`'s job and the command line is
``kvbench leaderboard --plots``. Figures are built on :class:`matplotlib.figure.Figure` with an explicit
Agg canvas instead of pyplot, so importing this module never changes the global backend (a notebook keeps
its inline display) and no figure is left registered in pyplot's global state.

Why one module of this length: the five figures share the palettes, the figure and saving helpers, the label
placement and the setting/scope handling at the top, and each figure is one section that reads on its own; split
apart, every section would import the same private helpers back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.vocab import BASELINE, OFFLOADING_FAMILIES, OVERALL, QUERY_AWARE, SETTINGS, in_setting, ordered_settings

FAMILY_MARKERS = {"baseline": "*", "quantization": "o", "eviction": "v", "tiered": "s", "recompute": "D",
                  "composite": "P", "reference": "X"}
# Fixed colours per family (Okabe–Ito, colour-blind safe), so a family looks the same in every figure.
FAMILY_COLORS = {"baseline": "#000000", "quantization": "#0072B2", "eviction": "#D55E00", "tiered": "#009E73",
                 "recompute": "#CC79A7", "composite": "#E69F00", "reference": "#56B4E9"}
SETTING_COLORS = {SETTINGS[0]: "#0072B2", SETTINGS[1]: "#E69F00"}

# A fixed salt makes SVG element ids repeatable, and no creation date is written, so redrawing the same
# store gives the same SVG file.
matplotlib.rcParams["svg.hashsalt"] = "kvbench"
_SVG_METADATA = {"Date": None}
_PNG_METADATA = {"Software": None}


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, out_dir: str | Path, name: str, dpi: int = 120) -> list[Path]:
    """Write ``<name>.png`` (at ``dpi``) and ``<name>.svg``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    fig.savefig(png, dpi=dpi, metadata=_PNG_METADATA)
    fig.savefig(svg, metadata=_SVG_METADATA)
    return [png, svg]


def family_color(family: str) -> str:
    return FAMILY_COLORS.get(family, "#777777")


def family_marker(family: str) -> str:
    return FAMILY_MARKERS.get(family, "o")


def _tasks(frame: pd.DataFrame) -> list[str]:
    return sorted(t for t in frame["task"].astype(str).unique() if t != OVERALL)


def _settings(frame: pd.DataFrame) -> list[str | None]:
    """The query settings in ``frame``, query-aware first; ``[None]`` when it has no setting column."""
    if "setting" not in frame.columns:
        return [None]
    return ordered_settings(frame["setting"]) or [None]


def _offloading(family: Any) -> bool:
    return str(family) in OFFLOADING_FAMILIES


# --------------------------------------------------------------------------------------------- pareto


def pareto_front(x: Sequence[float], y: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats on both axes (both maximised), in increasing ``x``.

    A point is dominated when another has ``x`` and ``y`` at least as large and one of them larger.
    NaN points are never on the front.
    """
    pts = [(float(a), float(b), i) for i, (a, b) in enumerate(zip(x, y, strict=True))
           if not (math.isnan(a) or math.isnan(b))]
    front = []
    for a, b, i in pts:
        if not any(c >= a and d >= b and (c > a or d > b) for c, d, _ in pts):
            front.append((a, b, i))
    # Equal points are all optimal; order by x, then y, then index for a deterministic line.
    return [i for _, _, i in sorted(front)]


# Candidate label offsets in pixels, nearest first: eight directions on growing rings.
_RINGS = (7, 14, 24, 36, 50, 66, 84, 106, 130, 160)
_DIRECTIONS = ((1, 0.35), (1, -0.35), (0, 1), (0, -1), (-1, 0.35), (-1, -0.35), (1, 1), (-1, 1), (1, -1), (-1, -1))


def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def label_points(ax, xs: Sequence[float], ys: Sequence[float], labels: Sequence[str], colors: Sequence[str],
                 bars: Sequence[tuple[float, float, float]] = (), fontsize: float = 7.5) -> list[Any]:
    """Label every point without overlap: each label takes the nearest free spot on rings around its point
    (clear of other labels and markers, inside the axes, off the CI bars where possible), tied to its point
    by a leader line when it had to move away. Deterministic, so figures redraw identically.

    ``bars``: (x, y_low, y_high) of vertical CI bars to keep labels off. Works in display pixels after a
    layout pass, and places each label as an offset in points, which layout changes do not disturb.
    """
    fig = ax.figure
    fig.canvas.draw()  # settle the constrained layout first: pixel positions must be final
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    frame = ax.get_window_extent(renderer)
    pts = [(i, *to_px((x, y))) for i, (x, y) in enumerate(zip(xs, ys, strict=True))
           if not (math.isnan(x) or math.isnan(y))]
    markers = [(px - 5, py - 5, px + 5, py + 5) for _, px, py in pts]
    bar_boxes = []
    for x, lo, hi in bars:
        if not (math.isnan(x) or math.isnan(lo) or math.isnan(hi)):
            (bx, by0), (_, by1) = to_px((x, lo)), to_px((x, hi))
            bar_boxes.append((bx - 1.5, min(by0, by1), bx + 1.5, max(by0, by1)))
    placed: list[tuple[float, float, float, float]] = []
    texts = []
    px_to_pt = 72 / fig.dpi
    # Top points first (the front and the lossless strategies), then left to right.
    for i, px, py in sorted(pts, key=lambda t: (-round(t[2], 1), t[1], t[0])):
        probe = ax.text(0, 0, labels[i], fontsize=fontsize)
        ext = probe.get_window_extent(renderer)
        probe.remove()
        w, h = ext.width, ext.height
        own = (px - 5, py - 5, px + 5, py + 5)
        choice, fallback = None, None
        for strict in (True, False):
            for r in _RINGS:
                if strict and r > 50:
                    break  # better across a CI bar than far from the point
                for dx, dy in _DIRECTIONS:
                    cx, cy = px + dx * r, py + dy * r
                    x0 = cx if dx > 0 else (cx - w if dx < 0 else cx - w / 2)
                    y0 = cy if dy > 0 else (cy - h if dy < 0 else cy - h / 2)
                    box = (x0, y0, x0 + w, y0 + h)
                    if box[0] < frame.x0 + 2 or box[2] > frame.x1 - 2 or box[1] < frame.y0 + 2 or box[3] > frame.y1 - 2:
                        continue
                    if any(_overlaps(box, o) for o in placed) or any(
                            _overlaps(box, m) for m in markers if m != own):
                        continue
                    if fallback is None:
                        fallback = (box, dx, dy, r)
                    if strict and any(_overlaps(box, b) for b in bar_boxes):
                        continue
                    choice = (box, dx, dy, r)
                    break
                if choice:
                    break
            if choice:
                break
        box, dx, dy, r = choice or fallback or ((px, py, px + w, py + h), 1, 0.35, _RINGS[0])
        placed.append(box)
        ha = "left" if dx > 0 else ("right" if dx < 0 else "center")
        va = "bottom" if dy > 0 else ("top" if dy < 0 else "center")
        arrow = {"arrowstyle": "-", "color": "#999999", "lw": 0.5, "shrinkA": 1, "shrinkB": 4} if r > 14 else None
        t = ax.annotate(labels[i], (xs[i], ys[i]), xytext=(dx * r * px_to_pt, dy * r * px_to_pt),
                        textcoords="offset points", ha=ha, va=va, fontsize=fontsize, color=colors[i], zorder=6,
                        arrowprops=arrow)
        t.set_in_layout(False)
        texts.append(t)
    return texts


def _pareto_panel(ax, rows: pd.DataFrame, fontsize: float = 7.5, markersize: float = 7) -> Callable[[], list[Any]]:
    """Points, CIs and the front of the non-offloading strategies in ``rows`` on ``ax``; returns the call
    that labels them, to be made once the figure's layout is complete."""
    # Exact x: memory saved is a measured quantity, so points that share it share a vertical line; their labels,
    # not the points, move apart (label_points), and the CI bars are thin enough to read through each other.
    x = 100 * rows["memory_reduction"].to_numpy(dtype=float)
    y = rows["delta_pp"].to_numpy(dtype=float)
    lo = rows["delta_ci_low"].to_numpy(dtype=float)
    hi = rows["delta_ci_high"].to_numpy(dtype=float)
    fams = rows["family"].astype(str).to_numpy()
    colors = [family_color(f) for f in fams]
    for i in range(len(rows)):
        ax.errorbar(x[i], y[i], yerr=[[abs(y[i] - lo[i])], [abs(hi[i] - y[i])]], fmt=family_marker(fams[i]),
                    color=colors[i], ecolor=colors[i], elinewidth=0.9, capsize=2, markersize=markersize,
                    markeredgecolor="white", markeredgewidth=0.5, alpha=0.95, zorder=3)
    front = pareto_front(x, y)
    if front:
        # A staircase: between two optimal points, the better accuracy holds until the next saving.
        fx, fy = x[front], y[front]
        ax.step(fx, fy, where="post", color="black", linewidth=1.6, alpha=0.75, zorder=5, solid_capstyle="round")
        ax.scatter(x[front], y[front], s=3 * markersize ** 2, facecolors="none", edgecolors="black", linewidths=1.2,
                   zorder=5)
    # Headroom above the best point and below the worst CI: labels need room where the points crowd.
    top, bottom = np.nanmax(np.r_[hi, y]), np.nanmin(np.r_[lo, y])
    span = max(top - bottom, 10.0)
    ax.set_ylim(bottom - 0.06 * span, top + 0.12 * span)
    labels = [shorten(s) for s in rows["strategy"]]
    return lambda: label_points(ax, x, y, labels, colors, bars=list(zip(x, lo, hi, strict=True)), fontsize=fontsize)


def _offload_panel(ax, rows: pd.DataFrame, fontsize: float = 7.5) -> None:
    x = 100 * rows["memory_reduction"].to_numpy(dtype=float)
    y = rows["delta_pp"].to_numpy(dtype=float)
    lo = rows["delta_ci_low"].to_numpy(dtype=float)
    hi = rows["delta_ci_high"].to_numpy(dtype=float)
    for i, fam in enumerate(rows["family"].astype(str)):
        ax.errorbar(x[i], y[i], yerr=[[abs(y[i] - lo[i])], [abs(hi[i] - y[i])]], fmt=family_marker(fam),
                    color=family_color(fam), elinewidth=0.9, capsize=2, markersize=7, zorder=3)
    for xi, yi, s in zip(x, y, rows["strategy"], strict=True):
        ax.annotate(shorten(s), (xi, yi), textcoords="offset points", xytext=(4, -9), ha="right", va="top",
                    fontsize=fontsize, color=family_color("tiered"))
    ax.set_xlim(min(80.0, np.nanmin(x) - 5) if len(x) else 80.0, 100.5)
    ax.set_title("offloading:\ndevice mem.", fontsize=fontsize)
    ax.set_xlabel("device mem.\nsaved (%)", fontsize=fontsize)
    ax.tick_params(labelsize=fontsize - 0.5)
    ax.grid(alpha=0.3)
    ax.axhline(0, color="#bbbbbb", linewidth=0.8, zorder=0)


#: Panel sizes in inches. One scope: a large, self-explaining figure. Several scopes (per task): the figure
#: spans a two-column paper's full text width (7 in, settings side by side), so printed text stays >= 6 pt.
PANEL_LARGE = {"width": 8.6, "height": 5.4, "font": 7.5, "marker": 7, "title": 10, "axis": 10}
PANEL_PAPER = {"width": 7.0, "height": 2.9, "font": 6.0, "marker": 4.5, "title": 8, "axis": 7}
#: PNG resolution of the paper-sized figure: 300 dpi is what journals ask of line art.
PAPER_DPI = 300


def pareto_figure(summary: pd.DataFrame, scopes: Sequence[str] | None = None,
                  settings: Sequence[str | None] | None = None,
                  pooled: Mapping[str | None, str] | None = None) -> Figure:
    """Memory saved (x) vs accuracy delta with its 95% CI (y), each strategy labelled: one panel per scope
    (default: the pooled ``all`` rows when present, else every task) and query setting — scopes in rows,
    settings in columns; a single scope stacks its settings so the figure stays narrow. Several scopes get
    paper-sized panels (:data:`PANEL_PAPER`).

    Offloading strategies sit in a narrow panel to the right of each panel: their x is device memory.
    Every point sits at its exact memory reduction (points sharing one share a vertical line; labels are offset
    with leader lines instead). ``pooled``: the title of the pooled scope per setting (what it pools and leaves
    out, e.g. ``legal, papers pooled at 4,096 tokens; not pooled: fiction at 2,048 tokens``); default
    "all tasks (pooled)".
    """
    settings = list(settings) if settings is not None else _settings(summary)
    if scopes is None:
        scopes = [OVERALL] if (summary["task"] == OVERALL).any() else _tasks(summary)
    scopes = list(scopes)
    if not scopes or summary.empty:
        raise KVBenchError("nothing to plot: the summary has no tasks")
    panels = [(scope, setting) for scope in scopes for setting in settings]
    cols_n = len(settings) if len(scopes) > 1 else 1
    rows_n = math.ceil(len(panels) / cols_n)
    size = PANEL_PAPER if len(scopes) > 1 else PANEL_LARGE
    width = size["width"] * (cols_n if size is PANEL_LARGE else 1)  # the paper figure's width is the page's
    fig = new_figure(width, size["height"] * rows_n + 0.5)
    axes = fig.subplots(rows_n, 2 * cols_n, squeeze=False, width_ratios=[7, 1] * cols_n, sharey="row")
    families: set[str] = set()
    label_jobs = []
    for k, (scope, setting) in enumerate(panels):
        r, c = divmod(k, cols_n)
        ax, off = axes[r, 2 * c], axes[r, 2 * c + 1]
        sub = in_setting(summary, setting)
        sub = sub[sub["task"] == scope].sort_values("strategy", kind="mergesort")
        sub = sub.dropna(subset=["memory_reduction", "delta_pp"])
        families |= set(sub["family"].astype(str))
        kept, moved = sub[~sub["family"].map(_offloading)], sub[sub["family"].map(_offloading)]
        ax.axhline(0, color="#bbbbbb", linewidth=0.8, zorder=0)
        ax.axhline(-1, color="#bbbbbb", linewidth=0.8, linestyle=":", zorder=0)
        if not kept.empty:
            xs = 100 * kept["memory_reduction"].to_numpy(dtype=float)
            ax.set_xlim(min(0.0, float(np.nanmin(xs))) - 4, min(100.0, float(np.nanmax(xs)) + 6))
            label_jobs.append(_pareto_panel(ax, kept, fontsize=size["font"], markersize=size["marker"]))
        if moved.empty:
            off.set_visible(False)
        else:
            _offload_panel(off, moved, fontsize=size["font"])
        scope_name = (pooled or {}).get(setting, "all tasks (pooled)") if scope == OVERALL else scope
        ax.set_title(scope_name if setting is None else f"{scope_name} — {setting}", fontsize=size["title"])
        ax.tick_params(labelsize=size["axis"])
        # Axis titles once per row and column on the paper grid: the panels share their scales.
        if r == rows_n - 1 or size is PANEL_LARGE:
            ax.set_xlabel("KV bytes saved vs dense 16-bit (%)", fontsize=size["axis"])
        if c == 0 or size is PANEL_LARGE:
            ax.set_ylabel(f"accuracy Δ vs {BASELINE} (pp, 95% CI)", fontsize=size["axis"])
        ax.grid(alpha=0.3)
    for k in range(len(panels), rows_n * cols_n):
        r, c = divmod(k, cols_n)
        axes[r, 2 * c].set_visible(False)
        axes[r, 2 * c + 1].set_visible(False)
    handles = [matplotlib.lines.Line2D([], [], linestyle="none", marker=family_marker(f), color=family_color(f),
                                       markersize=size["marker"], label=f) for f in sorted(families)]
    handles.append(matplotlib.lines.Line2D([], [], color="black", linewidth=1.6, marker="o",
                                           markersize=size["marker"] + 2, markerfacecolor="none", label="Pareto front"))
    # At most four keys a row: eight (every family and the front) overflow the figure's width on both sides.
    ncols = min(len(handles), 4)
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=size["axis"], frameon=False)
    fig.suptitle("Accuracy vs KV memory (dotted: −1 pp; points at their exact memory saved, labels offset)",
                 fontsize=size["title"] + 1)
    for job in label_jobs:
        job()
    return fig


# -------------------------------------------------------------------------------------------- latency

LATENCY_PANELS = (("compress_s", 1e3, "compression (ms)"), ("query_s", 1e3, "question tokens (ms)"),
                  ("decode_ms_per_token", 1.0, "decode (ms / token)"))


def latency_figure(records: pd.DataFrame, tasks: Sequence[str] | None = None) -> Figure:
    """Per-strategy box plots (median, quartiles, 5–95% whiskers, samples of every task pooled) of what
    differs between strategies: building the compressed cache, processing the question, decoding.

    The prefill is shared by every strategy of a sample (one full-attention pass), so it is one number,
    given in the title instead of as identical bars.
    """
    tasks = list(tasks) if tasks is not None else _tasks(records)
    df = records[records["task"].isin(tasks)]
    panels = [p for p in LATENCY_PANELS if p[0] in df.columns and df[p[0]].notna().any()]
    if df.empty or not panels:
        raise KVBenchError("nothing to plot: no records with latency fields")
    settings = _settings(df)
    # Slowest decode at the top: the order a reader scans for cost.
    order = (df.groupby("strategy")["decode_ms_per_token"].median().sort_values(ascending=False, kind="mergesort")
             if "decode_ms_per_token" in df.columns else pd.Series(index=sorted(df["strategy"].unique())))
    labels = list(order.index)
    fams = df.drop_duplicates("strategy").set_index("strategy")["family"].astype(str)
    fig = new_figure(4.2 * len(panels) + 1.2, 0.34 * len(labels) * max(1, len(settings)) ** 0.5 + 1.8)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    height = 0.75 / len(settings)
    for ax, (col, scale, title) in zip(axes, panels, strict=True):
        for k, setting in enumerate(settings):
            sub = in_setting(df, setting)
            data = [scale * sub.loc[sub["strategy"] == s, col].dropna().to_numpy(dtype=float) for s in labels]
            pos = np.arange(len(labels)) + (k - (len(settings) - 1) / 2) * height
            keep = [i for i, d in enumerate(data) if d.size]
            if not keep:
                continue
            color = SETTING_COLORS.get(setting, "#0072B2") if setting else "#0072B2"
            ax.boxplot([data[i] for i in keep], positions=pos[keep], orientation="horizontal", widths=height * 0.85,
                       whis=(5, 95), showfliers=False, patch_artist=True, manage_ticks=False,
                       boxprops={"facecolor": color, "alpha": 0.45, "edgecolor": color},
                       medianprops={"color": "black", "linewidth": 1.2}, whiskerprops={"color": color},
                       capprops={"color": color})
        values = scale * df[col].dropna().to_numpy(dtype=float)
        if values.size and np.nanmin(values) > 0 and np.nanmax(values) / np.nanmin(values) > 50:
            ax.set_xscale("log")  # compression spans microseconds (none) to seconds (tiered writes)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), [shorten(s) for s in labels], fontsize=8)
    for tick, s in zip(axes[0].get_yticklabels(), labels, strict=True):
        tick.set_color(family_color(str(fams.get(s, ""))))
    axes[0].set_ylim(len(labels) - 0.5, -0.5)
    # Two keys: the box colour is the query setting (when there are two), the label colour the family.
    handles = []
    if len(settings) > 1:
        handles += [matplotlib.patches.Patch(color=SETTING_COLORS.get(s, "#777777"), alpha=0.45, label=f"box: {s}")
                    for s in settings]
    present = sorted({str(fams.get(s, "")) for s in labels} - {""})
    handles += [matplotlib.lines.Line2D([], [], linestyle="none", marker="s", markersize=8, color=family_color(f),
                                        label=f"label: {f}") for f in present]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8,
                   frameon=False)
    fig.suptitle(f"Latency per strategy, {', '.join(tasks)} pooled (box: quartiles, whiskers: 5–95%)"
                 f"{_prefill_note(df)}", fontsize=10)
    return fig


def _prefill_note(records: pd.DataFrame) -> str:
    base = records[records["strategy"] == BASELINE]
    if base.empty or "prefill_s" not in base.columns:
        return ""
    parts = [f"{t}: {g['prefill_s'].median():.2f} s at {int(g['context_tokens'].median()):,} tokens"
             for t, g in base.groupby("task", sort=True)]
    return "\nshared full-attention prefill, median per sample — " + "; ".join(parts)


# --------------------------------------------------------------------------------------------- memory


def model_arch(model: str) -> Any | None:
    """The architecture of a recorded model for the formula line, or None when it cannot be resolved.

    Names go through :func:`kvbench.calc.resolve_model`: the presets (the embedded ``smollm2-135m``
    among them) or a path to a config.json / model directory. Other names (``tiny-llama``, hub ids) get
    no formula line rather than a guessed architecture.
    """
    from kvbench import calc

    try:
        return calc.resolve_model(model)
    except (KVBenchError, OSError, ValueError):
        return None


def memory_figure(records: pd.DataFrame, arch: Any | None = None, dtype: str | None = None) -> Figure:
    """KV bytes held per context token per strategy (mean over samples), most compact at the bottom, with the
    saving against ``full`` written on each bar.

    Offloading strategies are drawn apart, hatched: their bar is the device-resident hot tier only; the
    rest of their cache sits in host memory or on disk. A vertical line marks the architecture formula
    ``2 × layers × kv_heads × head_dim × bytes/element`` at the run's dtype (``arch`` defaults to the
    recorded model's, when resolvable), which ``full`` must meet.
    """
    from kvbench import calc

    df = records.dropna(subset=["kv_bytes", "context_tokens"])
    if df.empty:
        raise KVBenchError("nothing to plot: no records with kv_bytes")
    per = df.groupby("strategy").agg(bpt=("bytes_per_token", "mean"), family=("family", "first"),
                                     red=("memory_reduction", "mean"))
    per["off"] = per["family"].map(_offloading)
    per = per.sort_values(["off", "bpt"], ascending=[True, False], kind="mergesort")
    kept, moved = per[~per["off"]], per[per["off"]]
    order = list(kept.index) + list(moved.index)
    ypos = np.arange(len(order), dtype=float)
    ypos[len(kept):] += 0.8  # a gap before the offloading group
    fig = new_figure(8.5, 0.3 * len(order) + 2.2)
    ax = fig.subplots()
    scale = 1 / 1024
    for y, s in zip(ypos, order, strict=True):
        r = per.loc[s]
        ax.barh(y, r["bpt"] * scale, height=0.7, color=family_color(r["family"]), alpha=0.85,
                hatch="///" if r["off"] else None, edgecolor="white" if not r["off"] else "black", linewidth=0.5)
        note = f"{100 * r['red']:.0f}% saved" + (" (device)" if r["off"] else "")
        ax.text(r["bpt"] * scale, y, f" {note}", va="center", fontsize=7.5)
    ax.set_yticks(ypos, [shorten(s) + (" — hot tier on device" if per.loc[s, "off"] else "") for s in order],
                  fontsize=8)
    for tick, s in zip(ax.get_yticklabels(), order, strict=True):
        tick.set_color(family_color(per.loc[s, "family"]))
    ax.set_ylim(ypos[-1] + 0.6, -0.6)
    model = str(df["model"].iloc[0]) if "model" in df else ""
    arch = arch if arch is not None else (model_arch(model) if model else None)
    dtype = dtype or (str(df["dtype"].iloc[0]) if "dtype" in df else None)
    if arch is not None and dtype:
        try:
            bpe = calc.dtype_bytes(dtype)
        except KVBenchError:
            bpe = None
        if bpe is not None:
            formula = calc.kv_bytes(arch, 1, 1, bpe) * scale
            ax.axvline(formula, color="black", linewidth=1.0, linestyle="--",
                       label=f"{BASELINE}: architecture formula ({dtype})")
            ax.legend(fontsize=8, loc="lower right")
    xmax = float(per["bpt"].max()) * scale
    ax.set_xlim(0, xmax * 1.22)
    ax.set_xlabel("KV cache held per context token (KiB, mean over samples)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("KV memory per token (hatched: offloading — only the device-resident part)", fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------- needle


def needle_table(records: pd.DataFrame, strategy: str, task: str | None = None) -> pd.DataFrame:
    """Mean score and sample count per (setting, depth, context length) for one strategy: columns setting,
    depth, length, accuracy, n. Empty when the records carry no depth."""
    cols = ["setting", "depth", "length", "accuracy", "n"]
    df = records if task is None else records[records["task"] == task]
    df = df[df["strategy"] == strategy]
    if "depth" not in df.columns:
        return pd.DataFrame(columns=cols)
    df = df[df["depth"].notna()]
    if df.empty:
        return pd.DataFrame(columns=cols)
    df = df.assign(length=df["context_tokens"].astype(int),
                   setting=df["setting"] if "setting" in df.columns else QUERY_AWARE)
    out = df.groupby(["setting", "depth", "length"], sort=True)["score"].agg(["mean", "size"]).reset_index()
    return out.rename(columns={"mean": "accuracy", "size": "n"})[cols]


def _length_bins(lengths: Sequence[int], max_bins: int = 6) -> dict[int, str]:
    """Column label per context length: exact when few, else quantile bins (templates vary lengths a bit)."""
    uniq = sorted(set(lengths))
    if len(uniq) <= max_bins:
        return {v: f"{v:,}" for v in uniq}
    edges = np.unique(np.quantile(uniq, np.linspace(0, 1, max_bins + 1)).round().astype(int))
    out = {}
    for v in uniq:
        i = min(int(np.searchsorted(edges, v, side="right")) - 1, len(edges) - 2)
        out[v] = f"{edges[i]:,}–{edges[i + 1]:,}"
    return out


#: Rows of a needle heatmap at most: more distinct depths than this (a task that draws each needle's depth at
#: random has one per sample) are grouped into this many equal-width bins, each cell with its n.
DEPTH_BINS = 10


def depth_bins(depths: Sequence[float], max_bins: int = DEPTH_BINS) -> dict[float, str]:
    """Row label per needle depth: each depth its own row when there are at most ``max_bins``, else equal-width
    bins over [0, 1] (a depth is a fraction of the context; widened to hold any outside it), labelled by range."""
    uniq = sorted({float(d) for d in depths})
    if len(uniq) <= max_bins:
        return {d: f"{d:.2f}" for d in uniq}
    lo, hi = min(0.0, uniq[0]), max(1.0, uniq[-1])
    width = (hi - lo) / max_bins
    out = {}
    for d in uniq:
        i = min(math.floor((d - lo) / width + 1e-9), max_bins - 1)  # 0.3 / 0.1 is 2.999…: the edge opens a bin
        out[d] = f"{lo + i * width:.1f}–{lo + (i + 1) * width:.1f}"
    return out


def _grid(table: pd.DataFrame, value: str, rows: dict[float, str], cols: dict[int, str]) -> tuple[np.ndarray, ...]:
    """(values, counts) of a heatmap: ``table``'s (depth, length) cells grouped into the row and column labels,
    each value the mean over its cells weighted by their ``n`` (so a bin's figure is its samples' mean)."""
    row_labels, col_labels = list(dict.fromkeys(rows.values())), list(dict.fromkeys(cols.values()))
    val = np.full((len(row_labels), len(col_labels)), np.nan)
    cnt = np.zeros((len(row_labels), len(col_labels)), dtype=int)
    keyed = table.assign(row=table["depth"].astype(float).map(rows), col=table["length"].map(cols))
    for (r, c), g in keyed.groupby(["row", "col"], sort=False):
        i, j = row_labels.index(r), col_labels.index(c)
        cnt[i, j] = int(g["n"].sum())
        val[i, j] = float((g[value] * g["n"]).sum() / cnt[i, j])
    return val, cnt


def tasks_with_depth(records: pd.DataFrame) -> list[str]:
    """Tasks whose records carry a needle depth."""
    if "depth" not in records.columns:
        return []
    return sorted(str(t) for t, g in records.groupby("task", sort=True) if g["depth"].notna().any())


def informative_strategies(records: pd.DataFrame, task: str, k: int = 3) -> list[str]:
    """The ``k`` strategies whose needle accuracy on ``task`` says most about depth: largest spread of
    accuracy across depth × length cells, then most samples that disagree with ``full``.

    ``full`` and offloading strategies are left out (an exact offloaded cache reads 1.00 everywhere, as does
    any strategy that loses nothing), and so is a strategy that fails every cell alike (0.00 everywhere).
    """
    df = records[(records["task"] == task) & records["depth"].notna()] if "depth" in records else records[:0]
    if df.empty:
        return []
    base = df[df["strategy"] == BASELINE].set_index("sample_id")["score"]
    scored = []
    for strategy, g in df.groupby("strategy", sort=True):
        if strategy == BASELINE or _offloading(g["family"].iloc[0]):
            continue
        cells = g.groupby(["depth", "context_tokens"])["score"].mean()
        spread = float(cells.max() - cells.min()) if len(cells) else 0.0
        paired = g.set_index("sample_id")["score"].reindex(base.index).dropna()
        disagree = float((paired != base.reindex(paired.index)).mean()) if len(paired) else 0.0
        if spread == 0.0 and disagree in (0.0, 1.0):
            continue  # flat: identical to full, or wrong everywhere
        scored.append((-spread, -disagree, str(strategy)))
    return [s for _, _, s in sorted(scored)[:k]]


def _depth_length_axes(ax: Any, columns: list[str], depths: list[str], r: int, c: int, settings: list[str],
                       setting: str, name: str) -> None:
    """Ticks, labels and title of one depth × length heatmap panel (row ``r``, column ``c`` of the grid)."""
    ax.set_xticks(range(len(columns)), columns, fontsize=7)
    ax.set_yticks(range(len(depths)), depths, fontsize=7)
    if r == len(settings) - 1:
        ax.set_xlabel("context tokens", fontsize=8)
    if c == 0:
        ax.set_ylabel(f"{setting}\nneedle depth" if len(settings) > 1 else "needle depth (0 = start)", fontsize=8)
    ax.set_title(shorten(name), fontsize=9)


def needle_figure(records: pd.DataFrame, strategies: Sequence[str] | str, task: str | None = None) -> Figure | None:
    """Heatmaps of accuracy by needle depth (rows) × context length (columns), one panel per strategy with
    ``full`` first, one row of panels per query setting; each cell shows the accuracy and its ``n``.

    Returns None when the records carry no needle depth for these strategies.
    """
    strategies = [strategies] if isinstance(strategies, str) else list(strategies)
    names = [BASELINE, *[s for s in strategies if s != BASELINE]]
    tables = {s: needle_table(records, s, task) for s in names}
    if all(t.empty for t in tables.values()) or all(tables[s].empty for s in names[1:]):
        return None
    every = pd.concat([t for t in tables.values() if not t.empty])
    rows = depth_bins(every["depth"].tolist())
    depths = list(dict.fromkeys(rows.values()))
    settings = ordered_settings(every["setting"])
    # Columns per setting: a query-aware prefix holds the question too, so its lengths differ a little.
    bins = {st: _length_bins(every.loc[every["setting"] == st, "length"].tolist()) for st in settings}
    ncols = max(len(set(b.values())) for b in bins.values())
    fig = new_figure(1.2 + len(names) * (1.0 + 0.75 * ncols), 1.0 + len(settings) * (0.9 + 0.42 * len(depths)))
    axes = fig.subplots(len(settings), len(names), squeeze=False, sharey=True)
    cmap = matplotlib.colormaps["viridis"]
    im = None
    for r, setting in enumerate(settings):
        for c, name in enumerate(names):
            ax = axes[r, c]
            t = tables[name]
            acc, cnt = _grid(t[t["setting"] == setting], "accuracy", rows, bins[setting])
            im = ax.imshow(acc, cmap=cmap, vmin=0, vmax=1, aspect="auto")
            for (i, j), v in np.ndenumerate(acc):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}\nn={cnt[i, j]}", ha="center", va="center", fontsize=7,
                            color="white" if v < 0.55 else "black")
            _depth_length_axes(ax, list(dict.fromkeys(bins[setting].values())), depths, r, c, settings, setting,
                               name)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="accuracy")
    fig.suptitle(f"Needle accuracy by depth × length{f' — {task}' if task else ''}", fontsize=10)
    return fig


# ----------------------------------------------------------------------------------------- needle map


def needle_map_table(records: pd.DataFrame, strategy: str, task: str | None = None) -> pd.DataFrame:
    """Paired needle map of one strategy against ``full``: per (setting, depth, context length) the mean score
    of each on the same samples, the difference in points and the number of pairs ``n``.

    Columns setting, depth, length, full, strategy, delta_pp, n; empty when the records carry no depth or no
    sample was run by both."""
    cols = ["setting", "depth", "length", "full", "strategy", "delta_pp", "n"]
    df = records if task is None else records[records["task"] == task]
    if "depth" not in df.columns or df.empty:
        return pd.DataFrame(columns=cols)
    df = df[df["depth"].notna()].assign(setting=df["setting"] if "setting" in df.columns else QUERY_AWARE)
    keys = ["setting", "sample_id", "depth", "context_tokens"]
    base = df[df["strategy"] == BASELINE][[*keys, "score"]]
    other = df[df["strategy"] == strategy][[*keys, "score"]]
    pairs = base.merge(other, on=keys, suffixes=("_full", "_strategy"))
    if pairs.empty:
        return pd.DataFrame(columns=cols)
    out = pairs.groupby(["setting", "depth", "context_tokens"], sort=True).agg(
        full=("score_full", "mean"), strategy=("score_strategy", "mean"), n=("score_full", "size")).reset_index()
    out = out.rename(columns={"context_tokens": "length"}).assign(length=lambda d: d["length"].astype(int))
    return out.assign(delta_pp=100 * (out["strategy"] - out["full"]))[cols]


def needle_map_figure(records: pd.DataFrame, strategies: Sequence[str] | str, task: str | None = None) -> Figure | None:
    """Needle-in-a-haystack map of the paired loss: for each strategy, accuracy minus ``full``'s on the same
    samples (points) by needle depth (rows) × context length (columns), one row of panels per query setting,
    each cell annotated with the difference and its number of pairs ``n`` (``conf/sweep/needle_map.yaml``).

    Complements :func:`needle_figure` (absolute accuracy): a cell where ``full`` also fails shows 0 here rather
    than the strategy's failure. Returns None when no strategy has paired records with a depth."""
    strategies = [strategies] if isinstance(strategies, str) else [s for s in strategies if s != BASELINE]
    tables = {s: needle_map_table(records, s, task) for s in strategies}
    names = [s for s in strategies if not tables[s].empty]
    if not names:
        return None
    every = pd.concat([tables[s] for s in names])
    rows = depth_bins(every["depth"].tolist())
    depths = list(dict.fromkeys(rows.values()))
    lengths = _length_bins(every["length"].tolist())
    columns = list(dict.fromkeys(lengths.values()))
    settings = ordered_settings(every["setting"])
    fig = new_figure(1.4 + len(names) * (1.0 + 0.75 * len(columns)), 1.0 + len(settings) * (0.9 + 0.42 * len(depths)))
    axes = fig.subplots(len(settings), len(names), squeeze=False, sharey=True)
    cmap = matplotlib.colormaps["RdBu"]
    im = None
    for r, setting in enumerate(settings):
        for c, name in enumerate(names):
            ax, t = axes[r, c], tables[name]
            # A bin's Δ is the mean over its pairs: the per-cell differences weighted by their n.
            delta, cnt = _grid(t[t["setting"] == setting], "delta_pp", rows, lengths)
            im = ax.imshow(delta, cmap=cmap, vmin=-100, vmax=100, aspect="auto")
            for (i, j), v in np.ndenumerate(delta):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:+.0f}\nn={cnt[i, j]}", ha="center", va="center", fontsize=7,
                            color="white" if abs(v) > 60 else "black")
            _depth_length_axes(ax, columns, depths, r, c, settings, setting, name)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="Δ accuracy vs full (pp)")
    fig.suptitle(f"Needle map: paired loss vs full by depth × length{f' — {task}' if task else ''}", fontsize=10)
    return fig


# -------------------------------------------------------------------------------------------- writing


def resolve_strategy(records: pd.DataFrame, name: str) -> str:
    """The stored label for ``name``, given as a full label or a short one (``snapkv``)."""
    labels = sorted(records["strategy"].astype(str).unique())
    if name in labels:
        return name
    hits = [s for s in labels if shorten(s) == name]
    if len(hits) == 1:
        return hits[0]
    raise KVBenchError(f"no strategy {name!r} in the selection; valid: {', '.join(shorten(s) for s in labels)}")


def write_all(records: pd.DataFrame, summary: pd.DataFrame, out_dir: str | Path,
              needle_strategies: Sequence[str] | None = None, needle_tasks: Sequence[str] | None = None,
              pooled: Mapping[str | None, str] | None = None) -> list[Path]:
    """Every figure into ``out_dir`` as PNG + SVG: ``pareto`` (pooled scope, titled by ``pooled`` per setting, or
    the tasks when nothing is pooled), ``pareto-tasks`` (one panel per task), ``latency``, ``memory``, and
    ``needle-<task>`` for each task with depth metadata (``needle_strategies``, default the most informative ones
    there) and its paired-loss map ``needle-map-<task>``."""
    chosen = [resolve_strategy(records, s) for s in needle_strategies or []]
    paths: list[Path] = []
    figures = [("pareto", pareto_figure(summary, pooled=pooled))]
    if (summary["task"] == OVERALL).any():
        figures.append(("pareto-tasks", pareto_figure(summary, scopes=_tasks(summary))))
    figures += [("latency", latency_figure(records)), ("memory", memory_figure(records))]
    for name, fig in figures:
        paths += save_figure(fig, out_dir, name, dpi=PAPER_DPI if name == "pareto-tasks" else 120)
    for task in needle_tasks if needle_tasks is not None else tasks_with_depth(records):
        picks = chosen or informative_strategies(records, task)
        fig = needle_figure(records, picks, task) if picks else None
        if fig is not None:
            paths += save_figure(fig, out_dir, f"needle-{task}")
        delta = needle_map_figure(records, picks, task) if picks else None
        if delta is not None:
            paths += save_figure(delta, out_dir, f"needle-map-{task}")
    return paths
