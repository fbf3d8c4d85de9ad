"""The needle-in-a-haystack map: the named sweep and its paired depth x length heatmap with n per cell."""

from __future__ import annotations

import pandas as pd

from kvbench import plots


def _records() -> pd.DataFrame:
    """Hand-made paired records: 2 depths x 2 lengths x 2 samples; snapkv loses both samples at depth 0.0 /
    2048 and one at depth 1.0 / 1024, and full fails one sample at depth 1.0 / 2048 that snapkv gets."""
    rows = []
    for depth in (0.0, 1.0):
        for length in (1024, 2048):
            for k in range(2):
                sid = f"s-{depth}-{length}-{k}"
                full = 0.0 if (depth, length, k) == (1.0, 2048, 0) else 1.0
                snap = 0.0 if (depth, length) == (0.0, 2048) or (depth, length, k) == (1.0, 1024, 0) else 1.0
                for strategy, score in (("full", full), ("snapkv", snap)):
                    rows.append({"task": "ruler_niah_single_2", "strategy": strategy, "sample_id": sid,
                                 "depth": depth, "context_tokens": length, "score": score,
                                 "setting": "query-aware", "family": "eviction"})
    return pd.DataFrame(rows)


def test_needle_map_table_is_paired_with_n_per_cell():
    t = plots.needle_map_table(_records(), "snapkv").set_index(["depth", "length"])
    assert t["n"].tolist() == [2, 2, 2, 2]
    assert t.loc[(0.0, 2048), "delta_pp"] == -100.0
    assert t.loc[(1.0, 1024), "delta_pp"] == -50.0
    assert t.loc[(1.0, 2048), "delta_pp"] == 50.0  # full failed a sample snapkv answered
    assert t.loc[(0.0, 1024), "delta_pp"] == 0.0
    assert plots.needle_map_table(_records(), "nope").empty


def test_needle_map_figure_cells_show_delta_and_n():
    fig = plots.needle_map_figure(_records(), ["full", "snapkv"], "ruler_niah_single_2")
    (ax,) = [a for a in fig.axes if a.get_title()]
    assert ax.get_title() == "snapkv"
    cells = sorted(t.get_text() for t in ax.texts)
    assert cells == sorted(["+0\nn=2", "-100\nn=2", "-50\nn=2", "+50\nn=2"])
    assert plots.needle_map_figure(_records().assign(depth=float("nan")), ["snapkv"]) is None


def test_needle_map_sweep_is_depths_by_lengths():
    from kvbench.sweep import load_sweep

    sweep = load_sweep("needle_map")
    assert sweep.name == "needle_map" and sweep.n_jobs == 6  # 3 lengths x 2 query settings
    job = sweep.blocks[0].jobs[0]
    assert "task=ruler" in job and "task.subtask=niah_single_2" in job
    assert any(o.startswith("task.depths=[0.0,") for o in job)
    lengths = {o for b in sweep.blocks for j in b.jobs for o in j if o.startswith("task.context_tokens=")}
    assert lengths == {"task.context_tokens=1024", "task.context_tokens=2048", "task.context_tokens=4096"}


def test_needle_map_sweep_samples_cover_every_depth():
    """task.n_samples in the sweep is a multiple of the depth grid, so every cell gets the same n."""
    import yaml

    from kvbench.config import conf_dir

    data = yaml.safe_load((conf_dir() / "sweep" / "needle_map.yaml").read_text())
    over = dict(o.split("=", 1) for o in data["overrides"])
    depths = yaml.safe_load(over["task.depths"])
    assert int(over["task.n_samples"]) % len(depths) == 0 and int(over["task.n_samples"]) >= len(depths)
