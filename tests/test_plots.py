"""Comparison plots: every figure written as non-empty PNG + SVG from a real fixture store, the Pareto front
on a known answer, and the needle heatmap's fallbacks."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kvbench import calc, leaderboard, plots
from kvbench.results import read_store


@pytest.fixture(scope="session")
def board(store_dir) -> leaderboard.Leaderboard:
    return leaderboard.build(read_store(store_dir))


def _check_images(paths: list[Path]) -> None:
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000, path
        if path.suffix == ".png":
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
        else:
            assert b"<svg" in data[:2000]


def test_writes_every_plot_as_png_and_svg(store_dir, tmp_path, capsys):
    # Through `kvbench leaderboard --plots`, which draws them from the same selection as the tables.
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--plots"]) == 0
    plots_dir = tmp_path / "plots"
    names = {p.name for p in plots_dir.iterdir()}
    for stem in ("pareto", "latency", "memory", "needle-alpha", "needle-beta"):
        assert {f"{stem}.png", f"{stem}.svg"} <= names
    _check_images(sorted(plots_dir.iterdir()))
    assert sum(line.startswith(str(plots_dir)) for line in capsys.readouterr().out.splitlines()) == len(names)


def test_plots_command_filters_and_errors(store_dir, tmp_path, capsys):
    assert plots.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--task", "beta"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert "needle-beta.svg" in names and "needle-alpha.svg" not in names
    assert plots.main(["--results-dir", str(store_dir), "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no records with model 'nope'" in err[0]


def test_svg_is_repeatable(board, tmp_path):
    a = plots.save_figure(plots.pareto_figure(board.summary), tmp_path / "a", "pareto")
    b = plots.save_figure(plots.pareto_figure(board.summary), tmp_path / "b", "pareto")
    assert a[1].read_bytes() == b[1].read_bytes()


def test_pareto_front_known_answer():
    x = [0.0, 50.0, 50.0, 70.0, 80.0, 30.0, float("nan")]
    y = [0.0, -1.0, -3.0, -0.5, -9.0, 1.0, 5.0]
    # (50,-1) is beaten by (70,-0.5); (50,-3) too; (0,0) by (30,1); NaN is never on the front.
    assert plots.pareto_front(x, y) == [5, 3, 4]


def test_pareto_panels_and_markers_per_family(board):
    fig = plots.pareto_figure(board.summary)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["alpha", "beta"]
    legend = {t.get_text() for t in axes[0].get_legend().get_texts()}
    assert {"baseline", "quantization", "eviction", "Pareto front"} <= legend


def test_memory_plot_formula_line_matches_measured_full(board):
    # The fixture's tiny Llama: 2 layers, 2 KV heads, head_dim 16, float32 cache.
    from kvbench.models import tiny_llama

    arch = calc.arch_from_config(tiny_llama().config, name="tiny-llama")
    fig = plots.memory_figure(board.records, arch=arch)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert "full: architecture formula (float32)" in labels
    full = board.records[board.records["strategy"] == "full"]
    for length, kv in zip(full["context_tokens"], full["kv_bytes"], strict=True):
        assert kv == calc.kv_bytes(arch, int(length), 1, calc.dtype_bytes("float32"))
    # A model calc cannot resolve gets no formula line rather than a guessed one.
    fig = plots.memory_figure(board.records)
    assert not any("formula" in line.get_label() for line in fig.axes[0].get_lines())


def test_needle_heatmap_with_one_length_and_without_depth(board):
    recs = board.records
    one_length = recs[recs["context_tokens"] == recs["context_tokens"].min()]
    strategy = plots.default_needle_strategy(board.summary, "alpha")
    assert strategy is not None and strategy != "full"
    table = plots.needle_table(one_length, strategy, "alpha")
    assert set(table["length"]) == {int(recs["context_tokens"].min())} and len(set(table["depth"])) == 3
    assert plots.needle_figure(one_length, strategy, "alpha") is not None
    no_depth = recs.assign(sample_meta="{}")
    assert plots.needle_figure(no_depth, strategy, "alpha") is None
    assert plots.tasks_with_depth(no_depth) == []


def test_sample_depth_reads_scalars_lists_and_json():
    assert plots.sample_depth('{"depth": 0.25}') == 0.25
    assert plots.sample_depth({"depths": [0.2, 0.4]}) == pytest.approx(0.3)
    assert plots.sample_depth({"pos": 0.7}, key="pos") == 0.7
    assert pd.isna(plots.sample_depth("not json")) and pd.isna(plots.sample_depth({"depth": True}))


def test_length_bins_group_many_lengths():
    bins = plots._length_bins(list(range(1000, 1020)), max_bins=4)
    assert len(set(bins.values())) <= 4 and bins[1000] != bins[1019]
    assert plots._length_bins([512, 1024]) == {512: "512", 1024: "1,024"}
