"""Comparison figures: every figure written as non-empty PNG + SVG from a real fixture store, the Pareto front
on a known answer, labels that never overlap, offloading drawn apart, latency by stage, needle maps with n."""

from __future__ import annotations

import ast
import itertools
import shutil
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.text import Text

from kvbench import calc, leaderboard, plots
from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.results import read_store


@pytest.fixture(scope="session")
def board(store_dir) -> leaderboard.Leaderboard:
    return leaderboard.build(read_store(store_dir))


@pytest.fixture(scope="session")
def board_both(store_dir, tmp_path_factory) -> leaderboard.Leaderboard:
    """The fixture store plus the same samples run query-aware."""
    from conftest import _store_builder

    root = _store_builder().cached_store(tmp_path_factory.getbasetemp() / "kvbench-store-aware", (True,))
    both = tmp_path_factory.getbasetemp() / "kvbench-store-both"
    if not both.exists():
        (both / "store").mkdir(parents=True)
        for src in (store_dir, root):
            for f in sorted((src / "store").glob("*.parquet")):
                shutil.copy(f, both / "store" / f.name)
    return leaderboard.build(read_store(both))


def _check_images(paths: list[Path]) -> None:
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000, path
        if path.suffix == ".png":
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert b"<svg" in data[:2000]


def _texts(ax) -> list:
    return [t for t in ax.texts if t.get_visible() and t.get_text()]


def _text_box(t, renderer):
    """The text's own box (an annotation's extent would include its leader line)."""
    return Text.get_window_extent(t, renderer)


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_writes_every_plot_as_png_and_svg(store_dir, tmp_path, capsys):
    # Through `kvbench leaderboard --plots`, which draws them from the same selection as the tables.
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--plots"]) == 0
    plots_dir = tmp_path / "plots"
    names = {p.name for p in plots_dir.iterdir()}
    for stem in ("pareto", "pareto-tasks", "latency", "memory", "needle-alpha", "needle-beta"):
        assert {f"{stem}.png", f"{stem}.svg"} <= names
    _check_images(sorted(plots_dir.iterdir()))
    assert sum(line.startswith(str(plots_dir)) for line in capsys.readouterr().out.splitlines()) == len(names)


def test_plots_only_filters_and_errors(store_dir, tmp_path, capsys):
    argv = ["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--plots-only", "--task", "beta"]
    assert leaderboard.main(argv) == 0
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert "needle-beta.svg" in names and "needle-alpha.svg" not in names
    assert not (tmp_path / "leaderboard.md").exists()
    assert leaderboard.main([*argv, "--needle-strategy", "streaming_llm"]) == 0  # a short label is enough
    assert leaderboard.main(["--results-dir", str(store_dir), "--model", "nope", "--plots"]) == 2
    assert leaderboard.main([*argv, "--needle-strategy", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no records with model 'nope'" in err[0]
    assert "no strategy 'nope'" in err[1] and "snapkv(" in err[1]


def test_plots_module_is_pure_figures():
    # No command line of its own and no reach into the leaderboard: filters live in kvbench.selection.
    tree = ast.parse(Path(plots.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "kvbench.leaderboard" not in imported and "argparse" not in imported
    assert not hasattr(plots, "main")


def test_svg_is_repeatable(board, tmp_path):
    a = plots.save_figure(plots.pareto_figure(board.summary), tmp_path / "a", "pareto")
    b = plots.save_figure(plots.pareto_figure(board.summary), tmp_path / "b", "pareto")
    assert a[1].read_bytes() == b[1].read_bytes()


def test_pareto_front_known_answer():
    x = [0.0, 50.0, 50.0, 70.0, 80.0, 30.0, float("nan")]
    y = [0.0, -1.0, -3.0, -0.5, -9.0, 1.0, 5.0]
    # (50,-1) is beaten by (70,-0.5); (50,-3) too; (0,0) by (30,1); NaN is never on the front.
    assert plots.pareto_front(x, y) == [5, 3, 4]


def test_pareto_labels_every_strategy_once_without_overlap(board):
    fig = plots.pareto_figure(board.summary, scopes=["alpha", "beta"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels][:2] == ["alpha — query-agnostic", "beta — query-agnostic"]
    for ax, task in zip(panels, ("alpha", "beta"), strict=False):
        labels = sorted(shorten(s) for s in board.summary.loc[board.summary["task"] == task, "strategy"])
        texts = _texts(ax)
        assert sorted(t.get_text() for t in texts) == labels
        boxes = [_text_box(t, renderer) for t in texts]
        frame = ax.get_window_extent(renderer)
        for a, b in itertools.combinations(boxes, 2):
            assert not _boxes_overlap(a, b)
        assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"baseline", "quantization", "eviction", "Pareto front"} <= legend


def test_pareto_draws_offloading_apart_as_device_memory(board):
    summary = board.summary
    tiered = summary[summary["strategy"] == "full"].assign(strategy="tiered(recent_tokens=8)", family="tiered",
                                                           memory_reduction=0.97)
    fig = plots.pareto_figure(pd.concat([summary, tiered], ignore_index=True))
    main, side = [ax for ax in fig.axes if ax.get_visible()][:2]
    assert "tiered(recent_tokens=8)" not in {t.get_text() for t in _texts(main)}
    assert {t.get_text() for t in _texts(side)} == {"tiered(recent_tokens=8)"}
    assert "device mem" in side.get_title()
    assert main.get_xlim()[1] <= 100  # the main axis stays within bytes saved
    # Without an offloading strategy the side panel is hidden.
    fig = plots.pareto_figure(summary)
    assert not fig.axes[1].get_visible()


def test_pareto_rows_per_setting(board_both):
    fig = plots.pareto_figure(board_both.summary)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and "pooled" in ax.get_title()]
    assert titles == ["all tasks (pooled) — query-aware", "all tasks (pooled) — query-agnostic"]


def test_points_sit_at_their_exact_memory_saved(board):
    """Strategies at one memory level share a vertical line: no point is shifted sideways on the x axis."""
    summary = board.summary
    twin = summary[summary["strategy"].str.startswith("int8")].assign(strategy="int8_twin")
    with_twin = pd.concat([summary, twin], ignore_index=True)
    fig = plots.pareto_figure(with_twin)
    ax = fig.axes[0]
    rows = with_twin[(with_twin["task"] == "all") & (with_twin["family"] != "tiered")]
    exact = {round(100 * float(v), 9) for v in rows["memory_reduction"]}
    xs = [round(float(x), 9) for line in ax.get_lines() if line.get_marker() not in (None, "None", "")
          for x in line.get_xdata()]
    assert xs and set(xs) <= exact
    assert "spread sideways" not in fig.get_suptitle()


def _inside(inner, outer) -> bool:
    return outer.x0 - 0.5 <= inner.x0 and inner.x1 <= outer.x1 + 0.5 and outer.y0 - 0.5 <= inner.y0 \
        and inner.y1 <= outer.y1 + 0.5


def test_pareto_legend_lies_inside_the_figure(board_both):
    """Every family the committed leaderboard has (eight legend keys with the front) on the large, pooled figure
    and on the paper-sized per-task one: the legend box lies inside the figure's bounds, none of it clipped."""
    summary = board_both.summary
    extra = [summary[summary["strategy"] == "full"].assign(strategy=f"x_{fam}", family=fam, memory_reduction=0.6)
             for fam in ("composite", "recompute", "reference", "tiered")]
    summary = pd.concat([summary, *extra], ignore_index=True)
    for fig in (plots.pareto_figure(summary), plots.pareto_figure(summary, scopes=board_both.tasks)):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        assert len(legend.get_texts()) == 8
        assert _inside(legend.get_window_extent(renderer), fig.bbox)


def test_pareto_names_the_pooled_scope(board_both):
    pooled = {"query-aware": "alpha, beta pooled at 128 tokens", "query-agnostic": "alpha pooled at 64 tokens"}
    fig = plots.pareto_figure(board_both.summary, pooled=pooled)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and "pooled" in ax.get_title()]
    assert titles == ["alpha, beta pooled at 128 tokens — query-aware", "alpha pooled at 64 tokens — query-agnostic"]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(-100, 0)), min_size=1, max_size=14))
def test_label_points_never_overlap_each_other(points):
    fig = plots.new_figure(7, 4.5)
    ax = fig.subplots()
    ax.set_xlim(-5, 105)
    ax.set_ylim(-110, 10)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.scatter(xs, ys)
    labels = [f"strategy_{i}(x={i})" for i in range(len(points))]
    texts = plots.label_points(ax, xs, ys, labels, ["black"] * len(points))
    fig.canvas.draw()
    assert sorted(t.get_text() for t in texts) == sorted(labels)
    renderer = fig.canvas.get_renderer()
    boxes = [_text_box(t, renderer) for t in texts]
    # Fourteen long labels fit in this panel; when a panel is too crowded the last labels may touch.
    for a, b in itertools.combinations(boxes, 2):
        assert not _boxes_overlap(a, b)


def test_latency_shows_what_differs_with_spread(board_both):
    fig = plots.latency_figure(board_both.records)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["compression (ms)", "question tokens (ms)", "decode (ms / token)"]
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert sorted(ticks) == sorted(shorten(s) for s in board_both.records["strategy"].unique())
    assert "prefill" in fig.get_suptitle() and "alpha" in fig.get_suptitle()
    # One box per (strategy, setting): the spread over samples, not one bar per task.
    n_boxes = sum(1 for p in fig.axes[2].patches if p.get_visible())
    assert n_boxes == 2 * len(ticks)
    # The legend keys both encodings: box colour = setting, label colour = family (every family present).
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    families = set(board_both.records["family"].astype(str))
    assert legend == {"box: query-aware", "box: query-agnostic"} | {f"label: {f}" for f in families}
    colors = {t.get_text(): t.get_color() for t in fig.axes[0].get_yticklabels()}
    fams = board_both.records.drop_duplicates("strategy").set_index("strategy")["family"]
    assert all(colors[shorten(s)] == plots.family_color(f) for s, f in fams.items())


def test_per_task_pareto_fits_a_paper_page(board_both, tmp_path):
    """Two settings side by side fit a two-column paper's text width (7 in), text no smaller than 6 pt, and
    the PNG is written at print resolution."""
    fig = plots.pareto_figure(board_both.summary, scopes=board_both.tasks)
    width, height = fig.get_size_inches()
    assert width <= 7.2 and height <= 2.9 * len(board_both.tasks) + 0.5
    fig.canvas.draw()
    texts = [t for ax in fig.axes if ax.get_visible() for t in ax.texts if t.get_text()]
    assert texts and min(t.get_fontsize() for t in texts) >= 6
    assert min(t.get_fontsize() for t in fig.legends[0].get_texts()) >= 6
    paths = plots.write_all(board_both.records, board_both.summary, tmp_path)
    from PIL import Image

    png = next(p for p in paths if p.name == "pareto-tasks.png")
    assert Image.open(png).size[0] == round(width * plots.PAPER_DPI)


def test_memory_figure_formula_line_and_offloading_apart(board):
    # The fixture's tiny Llama: 2 layers, 2 KV heads, head_dim 16, float32 cache.
    from kvbench.models import tiny_llama

    arch = calc.arch_from_config(tiny_llama().config, name="tiny-llama")
    fig = plots.memory_figure(board.records, arch=arch)
    ax = fig.axes[0]
    (formula,) = [line for line in ax.get_lines() if "formula" in line.get_label()]
    assert formula.get_label() == "full: architecture formula (float32)"
    full = board.records[board.records["strategy"] == "full"]
    per_token = calc.kv_bytes(arch, 1, 1, calc.dtype_bytes("float32"))
    assert formula.get_xdata()[0] == pytest.approx(per_token / 1024)
    assert (full["bytes_per_token"] == per_token).all()
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(ticks) == sorted(shorten(s) for s in board.records["strategy"].unique())
    # A model calc cannot resolve gets no formula line rather than a guessed one.
    fig = plots.memory_figure(board.records)
    assert not any("formula" in line.get_label() for line in fig.axes[0].get_lines())
    # An offloading strategy is drawn last, hatched, named as device memory.
    tiered = full.assign(strategy="tiered", family="tiered", bytes_per_token=16.0, memory_reduction=0.97)
    fig = plots.memory_figure(pd.concat([board.records, tiered], ignore_index=True))
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[-1] == "tiered — hot tier on device"
    assert fig.axes[0].patches[-1].get_hatch()


def test_needle_maps_most_informative_strategies_with_n(board_both):
    recs = board_both.records
    picks = plots.informative_strategies(recs, "alpha")
    assert picks and "full" not in picks and len(picks) <= 3
    fig = plots.needle_figure(recs, picks, "alpha")
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [shorten(s) for s in ["full", *picks]] * 2  # a row per setting
    assert panels[0].get_ylabel().startswith("query-aware") and panels[len(picks) + 1].get_ylabel().startswith(
        "query-agnostic")
    cells = [t.get_text() for t in panels[0].texts]
    assert cells and all(t.endswith("n=1") for t in cells)  # one sample per (depth, length) in the fixture


def test_informative_strategies_skip_flat_and_offloading(board):
    recs = board.records
    alpha = recs[recs["task"] == "alpha"]
    same = alpha[alpha["strategy"] == "full"].assign(strategy="copy_of_full", family="quantization")
    wrong = same.assign(strategy="always_wrong", score=0.0)
    offl = alpha[alpha["strategy"] == "snapkv(compression_ratio=0.75,kernel_size=3,window_size=4)"]
    offl = offl.assign(strategy="tiered", family="tiered")
    picks = plots.informative_strategies(pd.concat([recs, same, wrong, offl], ignore_index=True), "alpha", k=10)
    assert not {"full", "copy_of_full", "always_wrong", "tiered"} & set(picks)


def test_needle_heatmap_with_one_length_and_without_depth(board):
    recs = board.records
    one_length = recs[recs["context_tokens"] == recs["context_tokens"].min()]
    picks = plots.informative_strategies(recs, "alpha")
    table = plots.needle_table(one_length, picks[0], "alpha")
    assert set(table["length"]) == {int(recs["context_tokens"].min())} and len(set(table["depth"])) == 3
    assert plots.needle_figure(one_length, picks, "alpha") is not None
    no_depth = recs.assign(depth=float("nan"))
    assert plots.needle_figure(no_depth, picks, "alpha") is None
    assert plots.tasks_with_depth(no_depth) == []


def test_resolve_strategy_by_short_or_full_label(board):
    full_label = "snapkv(budget_tokens=None,compression_ratio=0.75,kernel_size=3,pooling=max,window_size=4)"
    recs = board.records
    stored = [s for s in recs["strategy"].unique() if s.startswith("snapkv")][0]
    assert plots.resolve_strategy(recs, stored) == stored
    assert plots.resolve_strategy(recs, shorten(stored)) == stored
    with pytest.raises(KVBenchError, match="valid: "):
        plots.resolve_strategy(recs, full_label + "x")


def test_length_bins_group_many_lengths():
    bins = plots._length_bins(list(range(1000, 1020)), max_bins=4)
    assert len(set(bins.values())) <= 4 and bins[1000] != bins[1019]
    assert plots._length_bins([512, 1024]) == {512: "512", 1024: "1,024"}


def test_depth_bins_group_many_depths_and_keep_few_exact():
    assert plots.depth_bins([0.0, 0.5, 1.0]) == {0.0: "0.00", 0.5: "0.50", 1.0: "1.00"}
    many = [i / 97 for i in range(98)]
    bins = plots.depth_bins(many)
    assert len(set(bins.values())) == plots.DEPTH_BINS
    assert bins[0.0] == "0.0–0.1" and bins[1.0] == "0.9–1.0" and plots.depth_bins([*many, 0.3])[0.3] == "0.3–0.4"


def test_needle_maps_bin_depths_with_n_per_cell(board_both):
    """A task whose needle depth differs per sample (the committed stores: ~100 distinct depths) draws at most
    DEPTH_BINS rows, each cell with the number of samples it holds, and the figure stays a page's size."""
    recs = board_both.records
    alpha = recs[recs["task"] == "alpha"].copy()
    # Spread the fixture's samples over 60 distinct depths each (copies of each sample at new depths).
    copies = []
    for k in range(20):
        copy = alpha.assign(depth=(alpha["depth"] * 0.5 + k / 40).round(3), sample_id=alpha["sample_id"] + f"#{k}")
        copies.append(copy)
    spread = pd.concat(copies, ignore_index=True)
    assert spread["depth"].nunique() > plots.DEPTH_BINS
    picks = plots.informative_strategies(spread, "alpha")
    for fig in (plots.needle_figure(spread, picks, "alpha"), plots.needle_map_figure(spread, picks, "alpha")):
        panels = [ax for ax in fig.axes if ax.get_title()]
        assert all(len(ax.get_yticks()) <= plots.DEPTH_BINS for ax in panels)
        per_panel = [sum(int(t.get_text().rsplit("n=", 1)[1]) for t in ax.texts) for ax in panels]
        n_setting = spread[spread["strategy"] == "full"].groupby("setting")["sample_id"].nunique()
        assert sorted(set(per_panel)) == sorted(set(n_setting))  # every sample in exactly one cell
        width, height = fig.get_size_inches() * fig.dpi
        assert max(width, height) <= 3000


#: The committed figures: every PNG a results directory holds (the leaderboard's and the headline's).
COMMITTED = sorted((Path(__file__).resolve().parents[1] / "results").glob("**/plots/*.png"))


@pytest.mark.parametrize("png", COMMITTED, ids=[str(p.relative_to(p.parents[2])) for p in COMMITTED])
def test_committed_figures_fit_a_page(png):
    """At most 3,000 px on each side (a needle map drew one row per distinct depth: 798 × 29,157 px)."""
    from PIL import Image

    assert max(Image.open(png).size) <= 3000
