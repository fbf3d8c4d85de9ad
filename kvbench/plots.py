"""Comparison plots over the result store (matplotlib, Agg canvas; PNG and SVG).

* :func:`pareto_figure` — memory reduction vs accuracy delta, one panel per task, one marker per family,
  the Pareto-optimal strategies connected;
* :func:`latency_figure` — prefill seconds and decode ms/token per strategy, with the ``full`` baseline;
* :func:`needle_figure` — accuracy by context length × needle depth for one strategy next to ``full``;
* :func:`memory_figure` — measured KV bytes against context length per strategy, with the projected line
  (the strategy's bytes per token × length) and, for ``full``, the architecture formula of
  :func:`kvbench.calc.kv_bytes`.

Figures are built on :class:`matplotlib.figure.Figure` with an explicit Agg canvas instead of pyplot, so
importing this module never changes the global backend (a notebook keeps its inline display) and no
figure is left registered in pyplot's global state. ``python -m kvbench.plots`` (or ``kvbench
leaderboard --plots``) writes all of them into ``results/plots/``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvbench.claims import DEPTH_KEYS, OVERALL, sample_depth
from kvbench.errors import KVBenchError
from kvbench.report import BASELINE

FAMILY_MARKERS = {"baseline": "*", "quantization": "o", "eviction": "v", "tiered": "s", "recompute": "D",
                  "composite": "P", "reference": "X"}

# A fixed salt makes SVG element ids repeatable, and no creation date is written, so redrawing the same
# store gives the same SVG file.
matplotlib.rcParams["svg.hashsalt"] = "kvbench"
_SVG_METADATA = {"Date": None}
_PNG_METADATA = {"Software": None}


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, out_dir: str | Path, name: str) -> list[Path]:
    """Write ``<name>.png`` and ``<name>.svg``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    fig.savefig(png, dpi=120, metadata=_PNG_METADATA)
    fig.savefig(svg, metadata=_SVG_METADATA)
    return [png, svg]


def _family_marker(family: str) -> str:
    return FAMILY_MARKERS.get(family, "o")


def _family_colors(families: Sequence[str]) -> dict[str, Any]:
    cmap = matplotlib.colormaps["tab10"]
    return {fam: cmap(i % 10) for i, fam in enumerate(sorted(set(families)))}


def _tasks(summary: pd.DataFrame) -> list[str]:
    return sorted(t for t in summary["task"].astype(str).unique() if t != OVERALL)


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


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


def pareto_figure(summary: pd.DataFrame, tasks: Sequence[str] | None = None) -> Figure:
    """Memory reduction (x) vs accuracy delta with its CI (y); one panel per task, one marker per family."""
    tasks = list(tasks) if tasks is not None else _tasks(summary)
    if not tasks:
        raise KVBenchError("nothing to plot: the summary has no tasks")
    rows, cols = _grid(len(tasks))
    fig = new_figure(5.2 * cols, 4.2 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colors = _family_colors(summary["family"].astype(str))
    for ax, task in zip(axes, tasks, strict=False):
        sub = summary[summary["task"] == task].sort_values("strategy", kind="mergesort")
        x = 100 * sub["memory_reduction"].to_numpy(dtype=float)
        y = sub["delta_pp"].to_numpy(dtype=float)
        lo = sub["delta_ci_low"].to_numpy(dtype=float)
        hi = sub["delta_ci_high"].to_numpy(dtype=float)
        fams = sub["family"].astype(str).to_numpy()
        for fam in sorted(set(fams)):
            m = fams == fam
            ax.errorbar(x[m], y[m], yerr=[np.abs(y[m] - lo[m]), np.abs(hi[m] - y[m])], fmt=_family_marker(fam),
                        color=colors[fam], ecolor=colors[fam], elinewidth=0.8, capsize=2, markersize=7,
                        alpha=0.9, label=fam, linestyle="none")
        front = pareto_front(x, y)
        if front:
            ax.plot(x[front], y[front], color="black", linewidth=1, zorder=1, label="Pareto front")
            labels = sub["strategy"].to_numpy()
            for i in front:
                ax.annotate(_short(labels[i]), (x[i], y[i]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        if len(x):
            # Room on the right for the labels of the most compressed points.
            lo_x, hi_x = np.nanmin(x), np.nanmax(x)
            pad = max(5.0, 0.08 * (hi_x - lo_x))
            ax.set_xlim(lo_x - pad, hi_x + 3 * pad)
        ax.axhline(0, color="grey", linewidth=0.6)
        ax.axhline(-1, color="grey", linewidth=0.6, linestyle=":")
        ax.set_title(task)
        ax.set_xlabel("memory reduction vs dense 16-bit (%)")
        ax.set_ylabel(f"accuracy Δ vs {BASELINE} (pp, 95% CI)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    fig.suptitle("Accuracy vs KV memory (dotted: −1 pp)")
    return fig


def _short(label: str, width: int = 28) -> str:
    """A strategy label for tick marks and legends: unset (``None``) parameters dropped, then truncated."""
    if "(" in label and label.endswith(")"):
        name, params = label[:-1].split("(", 1)
        kept = [p for p in params.split(",") if not p.endswith("=None")]
        label = f"{name}({','.join(kept)})" if kept else name
    return label if len(label) <= width else label[: width - 1] + "…"


# -------------------------------------------------------------------------------------------- latency


def latency_figure(summary: pd.DataFrame, tasks: Sequence[str] | None = None) -> Figure:
    """Prefill s and decode ms/token per strategy (bars per task), with the ``full`` value as a line."""
    tasks = list(tasks) if tasks is not None else _tasks(summary)
    sub = summary[summary["task"].isin(tasks)]
    labels = sorted(sub["strategy"].unique(), key=lambda s: (s != BASELINE, s))
    fig = new_figure(12, 0.32 * len(labels) * max(1, len(tasks)) ** 0.5 + 2)
    axes = fig.subplots(1, 2, sharey=True)
    cmap = matplotlib.colormaps["tab10"]
    height = 0.8 / max(1, len(tasks))
    ypos = np.arange(len(labels))
    for ax, col, title in ((axes[0], "prefill_s", "prefill (s, median)"),
                           (axes[1], "decode_ms_per_token", "decode (ms/token, median)")):
        for k, task in enumerate(tasks):
            t = sub[sub["task"] == task].set_index("strategy")
            vals = [float(t[col].get(s, np.nan)) if s in t.index else np.nan for s in labels]
            ax.barh(ypos + (k - (len(tasks) - 1) / 2) * height, vals, height=height, color=cmap(k % 10),
                    label=task)
            if BASELINE in t.index and not math.isnan(float(t.loc[BASELINE, col])):
                ax.axvline(float(t.loc[BASELINE, col]), color=cmap(k % 10), linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ypos, [_short(s, 40) for s in labels], fontsize=7)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=7, title=f"task (dashed: {BASELINE})", title_fontsize=7, loc="upper left",
                   bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.suptitle("Latency per strategy")
    return fig


# --------------------------------------------------------------------------------------------- needle


def needle_table(records: pd.DataFrame, strategy: str, task: str | None = None,
                 depth_key: str | None = None) -> pd.DataFrame:
    """Mean score per (depth, context length) for ``strategy`` and ``full``: columns depth, length, which,
    accuracy, n. Empty when the records carry no depth."""
    df = records if task is None else records[records["task"] == task]
    df = df[df["strategy"].isin([strategy, BASELINE])].copy()
    if df.empty:
        return pd.DataFrame(columns=["depth", "length", "which", "accuracy", "n"])
    df["depth"] = [round(sample_depth(m, depth_key), 3) for m in df["sample_meta"]]
    df = df[df["depth"].notna()]
    if df.empty:
        return pd.DataFrame(columns=["depth", "length", "which", "accuracy", "n"])
    df["length"] = df["context_tokens"].astype(int)
    df["which"] = np.where(df["strategy"] == BASELINE, BASELINE, strategy)
    out = df.groupby(["which", "depth", "length"], sort=True)["score"].agg(["mean", "size"]).reset_index()
    return out.rename(columns={"mean": "accuracy", "size": "n"})


def _length_bins(lengths: Sequence[int], max_bins: int = 8) -> dict[int, str]:
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


def needle_figure(records: pd.DataFrame, strategy: str, task: str | None = None,
                  depth_key: str | None = None) -> Figure | None:
    """Heatmaps of accuracy by context length × depth: ``full``, the strategy, and their difference.

    Returns None when the records carry no needle depth. A store with one context length gives
    single-column maps (depth is still resolved).
    """
    tab = needle_table(records, strategy, task, depth_key)
    if tab.empty or strategy not in set(tab["which"]):
        return None
    bins = _length_bins(tab["length"].tolist())
    tab = tab.assign(col=tab["length"].map(bins))
    # Re-aggregate within bins, weighting by sample counts.
    tab = tab.assign(total=tab["accuracy"] * tab["n"])
    agg = tab.groupby(["which", "depth", "col"], sort=False)[["total", "n"]].sum().reset_index()
    agg["accuracy"] = agg["total"] / agg["n"]
    depths = sorted(agg["depth"].unique())
    cols = list(dict.fromkeys(bins[v] for v in sorted(bins)))

    def grid(which: str) -> np.ndarray:
        g = np.full((len(depths), len(cols)), np.nan)
        for r in agg[agg["which"] == which].itertuples():
            g[depths.index(r.depth), cols.index(r.col)] = r.accuracy
        return g

    base, strat = grid(BASELINE), grid(strategy)
    fig = new_figure(3 * (2.4 + 0.8 * len(cols)), max(3.0, 1.6 + 0.45 * len(depths)))
    axes = fig.subplots(1, 3)
    panels = ((base, f"{BASELINE}", "viridis", 0, 1, "{:.2f}"),
              (strat, _short(strategy, 40), "viridis", 0, 1, "{:.2f}"),
              (100 * (strat - base), "difference (pp)", "RdBu", -100, 100, "{:+.0f}"))
    for ax, (data, title, cmap, vmin, vmax, cell) in zip(axes, panels, strict=True):
        im = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        for (i, j), v in np.ndenumerate(data):
            if not math.isnan(v):
                ax.text(j, i, cell.format(v), ha="center", va="center", fontsize=7,
                        color="white" if cmap == "viridis" and v < 0.5 else "black")
        ax.set_xticks(range(len(cols)), cols, rotation=30, fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("needle depth (0 = start)")
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle(f"Needle accuracy by length × depth{f' — {task}' if task else ''}")
    return fig


def tasks_with_depth(records: pd.DataFrame, depth_key: str | None = None) -> list[str]:
    """Tasks whose records carry a needle depth."""
    out = []
    for task, grp in records.groupby("task", sort=True):
        if any(not math.isnan(sample_depth(m, depth_key)) for m in grp["sample_meta"].head(50)):
            out.append(str(task))
    return out


def default_needle_strategy(summary: pd.DataFrame, task: str) -> str | None:
    """The most compressed non-baseline strategy on ``task`` (where depth effects show most); among equally
    compressed ones the one losing most accuracy, then the first label."""
    sub = summary[(summary["task"] == task) & (summary["strategy"] != BASELINE)]
    sub = sub.dropna(subset=["memory_reduction"])
    if sub.empty:
        return None
    order = sub.assign(_d=sub["delta_pp"].fillna(0.0)).sort_values(
        ["memory_reduction", "_d", "strategy"], ascending=[False, True, True], kind="mergesort")
    return str(order["strategy"].iloc[0])


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
    """Measured KV bytes per sample vs context length, per strategy, with projected lines.

    Dashed lines: each strategy's mean measured bytes per token × length. For ``full``, a solid black
    line: the architecture formula ``2 × layers × kv_heads × head_dim × length × bytes/element`` at the
    run's dtype (``arch`` defaults to the recorded model's, when resolvable).
    """
    from kvbench import calc

    df = records.dropna(subset=["kv_bytes", "context_tokens"])
    if df.empty:
        raise KVBenchError("nothing to plot: no records with kv_bytes")
    labels = sorted(df["strategy"].unique(), key=lambda s: (s != BASELINE, s))
    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    ncolors = 10 if len(labels) <= 10 else 20
    fig = new_figure(11, 6)
    ax = fig.subplots()
    xmax = float(df["context_tokens"].max())
    # Whole token counts: the formula is defined per token, and fractional lengths would make it step.
    xs = np.unique(np.linspace(0, xmax * 1.05, 60).round().astype(int))
    for i, label in enumerate(labels):
        sub = df[df["strategy"] == label]
        color = cmap(i % ncolors)
        fam = str(sub["family"].iloc[0]) if "family" in sub else ""
        ax.scatter(sub["context_tokens"], sub["kv_bytes"] / 2**20, color=color, marker=_family_marker(fam),
                   s=28, label=_short(label, 48), zorder=3)
        per_token = float(sub["bytes_per_token"].mean())
        ax.plot(xs, per_token * xs / 2**20, color=color, linestyle="--", linewidth=0.8)
    model = str(df["model"].iloc[0]) if "model" in df else ""
    arch = arch if arch is not None else (model_arch(model) if model else None)
    dtype = dtype or (str(df["dtype"].iloc[0]) if "dtype" in df else None)
    if arch is not None and dtype:
        try:
            bpe = calc.dtype_bytes(dtype)
        except KVBenchError:
            bpe = None
        if bpe is not None:
            formula = [0.0 if x == 0 else calc.kv_bytes(arch, int(x), 1, bpe) / 2**20 for x in xs]
            ax.plot(xs, formula, color="black",
                    linewidth=1.2, label=f"{BASELINE}: architecture formula ({dtype})")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("KV cache (MiB held)")
    ax.set_title("KV memory vs context length (dashed: measured bytes/token × length)")
    ax.grid(alpha=0.3)
    ax.set_xlim(0, xmax * 1.05)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return fig


# -------------------------------------------------------------------------------------------- writing


def write_all(records: pd.DataFrame, summary: pd.DataFrame, out_dir: str | Path,
              needle_strategy: str | None = None, needle_tasks: Sequence[str] | None = None,
              depth_key: str | None = None) -> list[Path]:
    """Every plot into ``out_dir`` as PNG + SVG: pareto, latency, memory, and one needle heatmap per task
    with depth metadata (for ``needle_strategy``, default the most compressed strategy there)."""
    paths: list[Path] = []
    for name, fig in (("pareto", pareto_figure(summary)), ("latency", latency_figure(summary)),
                      ("memory", memory_figure(records))):
        paths += save_figure(fig, out_dir, name)
    for task in needle_tasks if needle_tasks is not None else tasks_with_depth(records, depth_key):
        strategy = needle_strategy or default_needle_strategy(summary, task)
        if strategy is None:
            continue
        fig = needle_figure(records, strategy, task, depth_key)
        if fig is not None:
            paths += save_figure(fig, out_dir, f"needle-{task}")
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvbench.plots",
                                description="Draw the comparison plots (PNG + SVG) from the result store.")
    p.add_argument("--results-dir", default="results", help="directory holding store/ (default results)")
    p.add_argument("--out-dir", default=None, help="where to write (default <results-dir>/plots)")
    p.add_argument("--model", default=None, help="plot only this model's records")
    p.add_argument("--task", action="append", default=None, help="plot only these tasks (repeatable, commas)")
    p.add_argument("--hardware", default=None, help="plot only records of this hardware profile")
    p.add_argument("--spec-version", default=None, help="plot only records of this spec version")
    p.add_argument("--dtype", default=None, help="plot only records run in this dtype")
    p.add_argument("--needle-strategy", default=None,
                   help="strategy label for the needle heatmap (default: the most compressed per task)")
    p.add_argument("--depth-key", default=None,
                   help=f"sample_meta key holding the needle depth (default: first of {', '.join(DEPTH_KEYS)})")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvbench.plots``; returns the exit status (0 ok, 2 bad input)."""
    from kvbench.leaderboard import build, filters_from_args, run_cli
    from kvbench.results import read_store

    def produce(args: argparse.Namespace) -> list[Path]:
        lb = build(read_store(args.results_dir), filters_from_args(args))
        return write_all(lb.records, lb.summary, Path(args.out_dir or Path(args.results_dir) / "plots"),
                         needle_strategy=args.needle_strategy, depth_key=args.depth_key)

    return run_cli("plots", build_parser(), argv, produce)


if __name__ == "__main__":
    sys.exit(main())
