"""Leaderboard and claim check: files, byte-identical regeneration, sorting, filters, refusal to mix, and
the claim logic on hand-built summaries with known answers."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from kvbench import SPEC_VERSION, claims, leaderboard
from kvbench.errors import KVBenchError
from kvbench.labels import shorten
from kvbench.results import atomic_write_parquet, read_store

OUTPUTS = ("leaderboard.md", "leaderboard.csv", "leaderboard.html", "claim_check.md")


@pytest.fixture(scope="session")
def records(store_dir) -> pd.DataFrame:
    return read_store(store_dir)


def _copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "store", dst / "store")
    return dst


def _add_variant(results: Path, records: pd.DataFrame, **changes: str) -> None:
    """A second run's parquet file whose records differ from the fixture's in ``changes``."""
    variant = records.copy()
    for col, value in changes.items():
        variant[col] = value
    variant["config_hash"] = variant["config_hash"] + "-variant"
    atomic_write_parquet(variant, results / "store" / "zz-variant.parquet")


# ------------------------------------------------------------------------------------------- files


def test_metrics_registry_is_the_one_list():
    """Summary columns, their record fields and the sort directions all come from ``kvbench.record``."""
    from kvbench.record import AGGREGATED, FIELDS, HIGHER_IS_BETTER, MEASURED_FIELDS, METRICS
    from kvbench.report import SUMMARY_COLUMNS

    assert leaderboard.HIGHER_IS_BETTER is HIGHER_IS_BETTER
    assert set(METRICS) <= set(SUMMARY_COLUMNS)
    for m in AGGREGATED:
        assert m.field in FIELDS and m.field in MEASURED_FIELDS, m.name
    numeric_csv = {*leaderboard.CSV_TASK_COLUMNS, *leaderboard.OVERALL_COLUMNS, *leaderboard.TEST_COLUMNS}
    assert numeric_csv - {"delta_method"} <= set(HIGHER_IS_BETTER)


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path):
    from kvbench.results import atomic_write, atomic_write_text

    target = tmp_path / "leaderboard.md"
    atomic_write_text(target, "old\n")

    def torn(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, torn)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leaderboard.md"]


def test_writes_markdown_csv_html_and_claim_check(store_dir, records, tmp_path, capsys):
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path)]) == 0
    for name in OUTPUTS:
        assert (tmp_path / name).stat().st_size > 0
    labels = sorted(records["strategy"].unique())
    table = pd.read_csv(tmp_path / "leaderboard.csv")
    assert sorted(table["strategy"]) == labels  # one row per (strategy, parameters)
    for task in ("alpha", "beta"):
        for col in ("delta_pp", "delta_ci_low", "delta_ci_high", "memory_reduction", "bytes_per_token",
                    "prefill_s", "decode_ms_per_token", "n"):
            assert f"{task}.{col}" in table.columns
    assert set(table["model"]) == {"tiny-llama"} and set(table["spec_version"].astype(str)) == {SPEC_VERSION}
    assert (table["alpha.n"] == 6).all()
    full = table[table["strategy"] == "full"].iloc[0]
    assert full["alpha.delta_pp"] == 0 and full["alpha.bytes_per_token"] == pytest.approx(512.0)

    md = (tmp_path / "leaderboard.md").read_text()
    # Tables name strategies by their short label; the CSV keeps both.
    assert all(f"| {shorten(label)} |" in md for label in labels)
    assert max(len(line) for line in md.splitlines() if line.startswith("| #")) < 120  # a readable answer table
    assert sorted(table["label"]) == sorted(shorten(label) for label in labels)
    assert "## Query-agnostic" in md and "## Query-aware" not in md  # the fixture's one setting, labelled
    assert set(table["setting"]) == {"query-agnostic"}
    page = (tmp_path / "leaderboard.html").read_text()
    assert "<style>" in page and "<script>" in page and "addEventListener" in page
    assert "src=" not in page and "http" not in page  # self-contained: the only links are in-page anchors
    assert all(h.startswith('"#') for h in page.split("href=")[1:])
    # The answer table (ranked rows and the reference) and two detail tables (no offloading in the fixture).
    assert page.count("<table") == 3 and page.count("data-strategy=") == 3 * len(labels)
    assert "Claim check" in (tmp_path / "claim_check.md").read_text()
    assert str(tmp_path / "leaderboard.md") in capsys.readouterr().out


def test_regeneration_is_byte_identical(store_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    # The copy's run files are renamed so the store reads them in the opposite order: output must not care.
    files = sorted((store_dir / "store").glob("*.parquet"))
    (b / "results" / "store").mkdir(parents=True)
    for i, f in enumerate(reversed(files)):
        shutil.copy(f, b / "results" / "store" / f"{i}-{f.name}")
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(a)]) == 0
    assert leaderboard.main(["--results-dir", str(b / "results"), "--out-dir", str(b)]) == 0
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_published_tree_is_left_as_committed_without_out_dir(capsys, monkeypatch, store_dir, tmp_path):
    """Reading the committed results/ (it carries MANIFEST.sha256) rewrote its pages; now they go to the
    git-ignored results/adhoc/leaderboard/<name>, said in one line, and --out-dir naming the tree republishes."""
    from kvbench import manifest

    results = tmp_path / "results"
    shutil.copytree(store_dir, results, ignore=shutil.ignore_patterns("*.md", "*.csv", "*.html", ".*"))
    manifest.write_manifest(results)

    def committed() -> dict[Path, bytes]:  # results/adhoc/ lies inside results/, git-ignored as in the checkout
        return {p: p.read_bytes() for p in results.rglob("*") if p.is_file() and "adhoc" not in p.parts}

    before = committed()
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert leaderboard.main(["--results-dir", "results"]) == 0
    captured = capsys.readouterr()
    assert committed() == before  # nothing written into the published tree
    adhoc = Path("results/adhoc/leaderboard/results")
    assert all((tmp_path / adhoc / name).is_file() for name in OUTPUTS)
    err = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert len(err) == 1 and "published tree" in err[0] and str(adhoc) in err[0] and "--out-dir results" in err[0]
    assert str(adhoc / "leaderboard.md") in captured.out
    assert leaderboard.main(["--results-dir", "results", "--out-dir", "results"]) == 0  # as publish_results.sh
    assert (results / "leaderboard.md").read_bytes() == (tmp_path / adhoc / "leaderboard.md").read_bytes()
    assert "published tree" not in capsys.readouterr().err


def test_a_working_tree_without_a_manifest_gets_its_pages_in_place(capsys, store_dir, tmp_path):
    results = _copy_store(store_dir, tmp_path / "results")
    capsys.readouterr()
    assert leaderboard.main(["--results-dir", str(results)]) == 0
    assert (results / "leaderboard.md").is_file() and capsys.readouterr().err == ""
    assert leaderboard.default_out_dir(results) == results


def test_the_publish_scripts_name_the_tree_they_republish():
    """Each leaderboard call of the scripts that regenerate committed pages names --out-dir as its --results-dir:
    without it the board of a published tree goes to results/adhoc, and the committed pages would go stale."""
    import re

    root = Path(__file__).resolve().parents[1]
    for script in ("publish_results.sh", "reproduce_leaderboard.sh"):
        text = (root / "scripts" / script).read_text().replace("\\\n", " ")
        calls = [ln for ln in text.splitlines() if "kvbench leaderboard" in ln and "-m kvbench" in ln]
        assert calls, script
        for call in calls:
            dirs = re.search(r"--results-dir (\S+)", call), re.search(r"--out-dir (\S+)", call)
            assert dirs[0] and dirs[1] and dirs[0].group(1) == dirs[1].group(1), (script, call)


def test_cli_dispatches_the_subcommand(store_dir, tmp_path):
    from kvbench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["leaderboard", "--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--task", "alpha"])
    assert exc.value.code == 0
    assert (tmp_path / "leaderboard.md").exists()


# ----------------------------------------------------------------------------------------- sorting


def _numbers(column: pd.Series) -> list[float]:
    return [float(v) for v in column]


def test_sort_is_best_first_per_metric_and_reversible(records):
    lb = leaderboard.build(records, sort="alpha.bytes_per_token")  # fewer bytes are better
    vals = _numbers(lb.table["alpha.bytes_per_token"])
    assert vals == sorted(vals)
    lb = leaderboard.build(records, sort="alpha.memory_reduction")  # more reduction is better
    vals = _numbers(lb.table["alpha.memory_reduction"])
    assert vals == sorted(vals, reverse=True)
    lb = leaderboard.build(records, sort="alpha.memory_reduction", reverse=True)
    assert _numbers(lb.table["alpha.memory_reduction"]) == sorted(vals)
    lb = leaderboard.build(records, sort="strategy")
    assert list(lb.table["strategy"]) == sorted(lb.table["strategy"])


def test_sort_ties_fall_back_to_memory_then_label(records):
    lb = leaderboard.build(records, sort="family")
    table = lb.table
    for _, grp in table.groupby("family", sort=False):
        red = _numbers(grp["all.memory_reduction"])
        assert red == sorted(red, reverse=True)
    assert list(table["family"]) == sorted(table["family"])


def test_sort_missing_values_go_last():
    lb = leaderboard.Leaderboard(table=pd.DataFrame({"strategy": ["a", "b", "c"],
                                                     "x.delta_pp": [float("nan"), -3.0, 1.0]}),
                                 summary=pd.DataFrame(), records=pd.DataFrame(), tasks=["x"])
    for reverse in (False, True):
        out = leaderboard.sort_leaderboard(lb, "x.delta_pp", reverse).table
        assert out["strategy"].iloc[-1] == "a"


def test_unknown_sort_column_names_the_valid_ones(records, store_dir, tmp_path, capsys):
    with pytest.raises(KVBenchError, match="cannot sort by 'nope'; valid columns: setting, strategy"):
        leaderboard.build(records, sort="nope")
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--sort", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot sort by 'nope'" in err[0]


# ----------------------------------------------------------------------------------------- filters


def test_task_filter_keeps_only_those_columns(records):
    lb = leaderboard.build(records, leaderboard.Filters(tasks=("alpha",)))
    assert lb.tasks == ["alpha"]
    assert not any(c.startswith("beta.") for c in lb.table.columns)
    assert set(lb.summary["task"]) == {"alpha", claims.OVERALL}


def test_model_hardware_and_task_filters_name_what_exists(records):
    assert len(leaderboard.build(records, leaderboard.Filters(model="tiny-llama", hardware="cpu")).table) == 5
    with pytest.raises(KVBenchError, match="no records with model 'nope'; found: tiny-llama"):
        leaderboard.build(records, leaderboard.Filters(model="nope"))
    with pytest.raises(KVBenchError, match="no records with hardware 'gpu'; found: cpu"):
        leaderboard.build(records, leaderboard.Filters(hardware="gpu"))
    with pytest.raises(KVBenchError, match="no records for task nope; found: alpha, beta"):
        leaderboard.build(records, leaderboard.Filters(tasks=("nope",)))


def test_empty_store_is_a_clear_error(tmp_path, capsys):
    assert leaderboard.main(["--results-dir", str(tmp_path), "--out-dir", str(tmp_path)]) == 2
    assert "the result store is empty" in capsys.readouterr().err


# --------------------------------------------------------------------------------- refusal to mix


@pytest.mark.parametrize("changes, flag, found", [
    ({"spec_version": "2.0"}, "--spec-version", f"spec versions {SPEC_VERSION}, 2.0"),
    ({"model": "other-model"}, "--model", "models other-model, tiny-llama"),
])
def test_mixing_spec_versions_or_models_is_refused(store_dir, records, tmp_path, capsys, changes, flag, found):
    results = _copy_store(store_dir, tmp_path / "results")
    _add_variant(results, records, **changes)
    mixed = read_store(results)
    with pytest.raises(KVBenchError, match=found) as exc:
        leaderboard.build(mixed)
    assert flag in str(exc.value) and "\n" not in str(exc.value)

    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(tmp_path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and flag in err[0]
    assert not (tmp_path / "leaderboard.md").exists()

    # The flag it names selects one side, which then ranks as usual.
    value = next(iter(changes.values()))
    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(tmp_path),
                             flag, value]) == 0
    table = pd.read_csv(tmp_path / "leaderboard.csv")
    col = next(iter(changes))
    assert set(table[col].astype(str)) == {value}


def test_a_second_run_with_the_same_samples_is_not_double_counted(store_dir, records, tmp_path):
    results = _copy_store(store_dir, tmp_path / "results")
    full = records[records["strategy"] == "full"]
    _add_variant(results, full)  # e.g. `strategies=[full,h2o]` after `strategies=[full,int8]`: full twice
    once = leaderboard.build(records).table.set_index("strategy")
    twice = leaderboard.build(read_store(results)).table.set_index("strategy")
    pd.testing.assert_frame_equal(once.sort_index(), twice.sort_index())


def test_same_sample_id_at_two_lengths_is_two_samples(records):
    paired = leaderboard.paired_records(records)
    alpha_full = paired[(paired["task"] == "alpha") & (paired["strategy"] == "full")]
    assert alpha_full["sample_id"].nunique() == 6
    renamed = records.assign(sample_id=records["sample_id"].str.replace(r"-\d+-", "-", regex=True))
    again = leaderboard.paired_records(renamed)
    assert again[(again["task"] == "alpha") & (again["strategy"] == "full")]["sample_id"].nunique() == 6


# ------------------------------------------------------------------------------------- claim check


def _row(task: str, strategy: str, family: str, red: float, delta: float, lo: float, hi: float,
         kept: float = 1.0, base_acc: float = 0.8) -> dict:
    return {"task": task, "strategy": strategy, "family": family, "n": 50, "accuracy": base_acc + delta / 100,
            "delta_pp": delta, "delta_ci_low": lo, "delta_ci_high": hi,
            "relative_loss": -delta / 100 / base_acc if base_acc else float("nan"),
            "memory_reduction": red, "kept_fraction": kept}


def _summary(rows: list[dict], tasks: tuple[str, ...] = ("legal", "papers", "fiction")) -> pd.DataFrame:
    base = [_row(t, "full", "baseline", 0.0, 0.0, 0.0, 0.0) for t in tasks]
    return pd.DataFrame(base + rows)


def test_largest_reduction_within_one_point_and_within_one_percent_relative():
    s = _summary([
        _row("papers", "int8", "quantization", 0.48, -0.2, -1.5, +1.0),
        _row("papers", "int4", "quantization", 0.70, -0.9, -2.5, +0.5),   # within 1 pp, 1.1% relative
        _row("papers", "int2", "quantization", 0.85, -1.0, -3.0, +0.8),   # exactly -1: not *under* 1 point
        _row("papers", "snapkv", "eviction", 0.75, -6.0, -9.0, -3.0),
    ])
    assert claims.best_within_pp(s, "papers").strategy == "int4"
    assert claims.best_within_relative(s, "papers").strategy == "int8"
    assert claims.best_within_pp(s, "legal") is None


def test_headline_claim_point_estimate_and_confidence():
    confident = _summary([_row("legal", "int8", "quantization", 0.48, -0.2, -0.8, +0.4)])
    h = claims.headline(confident, "legal")
    assert (h.testable, h.holds, h.holds_ci, h.in_band, h.pick.strategy) == (True, True, True, True, "int8")
    assert "holds**, and with confidence" in h.sentence

    point_only = _summary([_row("legal", "int8", "quantization", 0.48, -0.2, -2.5, +2.0)])
    h = claims.headline(point_only, "legal")
    assert (h.holds, h.holds_ci) == (True, False)
    assert "undetermined at this n" in h.sentence and "-2.5" in h.sentence and h.n_needed > 0

    fails = _summary([_row("legal", "int8", "quantization", 0.48, -3.0, -5.0, -1.0),
                      _row("legal", "int8b", "quantization", 0.30, 0.0, -1.0, +1.0)])
    h = claims.headline(fails, "legal")
    assert (h.testable, h.holds, h.holds_ci, h.pick.strategy) == (True, False, False, "int8")
    assert "does not hold" in h.sentence

    above_band = _summary([_row("legal", "int2", "quantization", 0.85, -0.5, -0.9, 0.0)])
    h = claims.headline(above_band, "legal")
    assert h.holds and not h.in_band and "band itself" in h.sentence

    untestable = _summary([_row("legal", "fp8", "quantization", 0.30, 0.0, -0.5, 0.5)])
    h = claims.headline(untestable, "legal")
    assert not h.testable and "not testable" in h.sentence and "30.0%" in h.sentence


def test_relative_reading_is_undefined_when_the_baseline_scores_zero():
    s = _summary([_row("legal", "int8", "quantization", 0.48, 0.0, 0.0, 0.0, base_acc=0.0)])
    h = claims.headline(s, "legal")
    assert h.holds and h.holds_relative is None and "undefined" in h.sentence


def test_scenarios_follow_the_numbers():
    quant_wins = _summary([
        _row("papers", "int8", "quantization", 0.48, -0.1, -0.5, 0.3),
        _row("papers", "int4", "quantization", 0.72, -0.6, -1.4, 0.2),
        _row("papers", "snapkv", "eviction", 0.50, -4.0, -7.0, -1.0, kept=0.5),
        _row("papers", "h2o", "eviction", 0.70, -8.0, -12.0, -4.0, kept=0.3),
    ])
    res = claims.scenario(quant_wins, claims.SCENARIOS[1])
    assert res.holds is True and res.winner.strategy == "int4" and res.winner.family == "quantization"
    assert "2 of 2 eviction strategies are dominated" in res.evidence

    evict_wins = _summary([
        _row("papers", "int8", "quantization", 0.48, -3.0, -5.0, -1.0),
        _row("papers", "snapkv", "eviction", 0.50, -0.5, -1.0, 0.0, kept=0.5),
    ])
    res = claims.scenario(evict_wins, claims.SCENARIOS[1])
    assert res.holds is False and res.winner.family == "eviction" and "eviction beats quantization" in res.evidence

    legal = _summary([
        _row("legal", "int8", "quantization", 0.55, 0.0, -0.5, 0.5),
        _row("legal", "streaming_llm", "eviction", 0.50, -2.0, -4.0, 0.0, kept=0.5),
        _row("legal", "tiered", "tiered", 0.98, 0.0, 0.0, 0.0),
    ])
    assert claims.scenario(legal, claims.SCENARIOS[0]).holds is True
    # offloaded bytes are not saved bytes: the tiered cache never wins a memory-reduction pick
    assert claims.best_within_pp(legal, "legal").strategy == "int8"

    fiction_hurts = _summary([
        _row("fiction", "streaming_llm", "eviction", 0.50, -6.0, -9.0, -3.0, kept=0.5),
        _row("fiction", "snapkv", "eviction", 0.50, -1.0, -2.0, 0.0, kept=0.5),
        _row("legal", "streaming_llm", "eviction", 0.50, -0.5, -1.0, 0.0, kept=0.5),
    ])
    res = claims.scenario(fiction_hurts, claims.SCENARIOS[2])
    assert res.holds is True and res.winner is None and res.closest.strategy == "snapkv"
    assert "average -3.5 pp" in res.evidence and "-0.5 pp on the other tasks" in res.evidence

    fiction_fine = _summary([_row("fiction", "snapkv", "eviction", 0.50, -0.2, -1.0, 0.4, kept=0.5)])
    assert claims.scenario(fiction_fine, claims.SCENARIOS[2]).holds is False

    no_eviction = _summary([_row("fiction", "int8", "quantization", 0.48, 0.0, 0.0, 0.0)])
    res = claims.scenario(no_eviction, claims.SCENARIOS[2])
    assert res.holds is None and "not testable" in res.evidence
    assert not claims.scenario(_summary([], tasks=("legal",)), claims.SCENARIOS[2]).measured


def test_dominance_and_group_comparison():
    a = claims.Pick("a", "quantization", 0.5, -0.5, -1.0, 0.0, 0.0, 1.0, 10)
    b = claims.Pick("b", "eviction", 0.5, -2.0, -3.0, -1.0, 0.0, 0.5, 10)
    c = claims.Pick("c", "eviction", 0.9, -5.0, -7.0, -3.0, 0.0, 0.1, 10)
    assert claims.dominates(a, b) and not claims.dominates(b, a) and not claims.dominates(a, a)
    assert not claims.dominates(a, c) and not claims.dominates(c, a)
    cmp = claims.compare_groups("q", [a], "e", [b, c])
    assert cmp.b_dominated == ["b"] and cmp.a_dominated == [] and cmp.a_wins
    assert claims.matched_pair([a], [b, c]) == (a, b)
    assert b.drops_tokens and not a.drops_tokens
    nan_kept = claims.Pick("d", "eviction", 0.5, 0.0, 0.0, 0.0, 0.0, math.nan, 1)
    assert nan_kept.drops_tokens  # without the measurement, the family decides


def test_claim_check_markdown_is_generated_from_the_numbers():
    s = _summary([
        _row("papers", "int8", "quantization", 0.48, -0.1, -0.5, 0.3),
        _row("papers", "snapkv", "eviction", 0.50, -4.0, -7.0, -1.0, kept=0.5),
    ])
    text = claims.render_claims(claims.check_claims(s, {"model": "m", "spec_version": "1.0"}))
    assert "Model **m**" in text and "| papers | holds | 2 | – |" in text
    assert "| paper reading | `papers` | quantization |" in text
    worse = s.assign(delta_pp=s["delta_pp"] * 30, delta_ci_low=s["delta_ci_low"] * 30)
    text = claims.render_claims(claims.check_claims(worse))
    assert "| papers | undetermined at this n | 2 |" in text and "none within 1 point" in text


def test_fiction_evidence_breaks_the_loss_down_by_depth(records):
    as_fiction = records.assign(task=records["task"].replace({"alpha": "fiction"}))
    lb = leaderboard.build(as_fiction)
    dropping = [s for s in lb.table["strategy"] if s.startswith(("snapkv", "streaming_llm"))]
    deltas = claims.depth_deltas(lb.records, "fiction", dropping)
    assert list(deltas) == [0.1, 0.5, 0.9]
    recs = lb.records[lb.records["task"] == "fiction"]
    base = recs[recs["strategy"] == "full"].set_index("sample_id")["score"]
    expected = []
    for s in dropping:
        own = recs[recs["strategy"] == s]
        shallow = own[own["sample_meta"].str.contains('"depth": 0.1')].set_index("sample_id")["score"]
        expected.append(100 * (shallow - base[shallow.index]).mean())
    assert deltas[0.1] == pytest.approx(sum(expected) / len(expected))
    check = claims.check_claims(lb.summary, lb.meta, lb.records)
    fiction = next(r for r in check.scenarios if r.scenario.task == "fiction")
    assert fiction.holds is not None and "at depth 0.1" in fiction.evidence
    assert claims.depth_deltas(lb.records.assign(sample_meta="{}"), "fiction", dropping) == {}


# -------------------------------------------------------------------------------- query settings


@pytest.fixture(scope="session")
def store_both(store_dir, tmp_path_factory) -> Path:
    """The fixture store plus the same samples run query-aware: both settings side by side."""
    from conftest import _store_builder

    root = _store_builder().cached_store(tmp_path_factory.getbasetemp() / "kvbench-store-aware", (True,))
    both = tmp_path_factory.getbasetemp() / "kvbench-store-both"
    if not both.exists():
        (both / "store").mkdir(parents=True)
        for src in (store_dir, root):
            for f in sorted((src / "store").glob("*.parquet")):
                shutil.copy(f, both / "store" / f.name)
    return both


def test_both_settings_get_their_own_labelled_tables(store_both, tmp_path):
    assert leaderboard.main(["--results-dir", str(store_both), "--out-dir", str(tmp_path)]) == 0
    table = pd.read_csv(tmp_path / "leaderboard.csv")
    assert list(dict.fromkeys(table["setting"])) == ["query-aware", "query-agnostic"]  # aware first, grouped
    per = table.groupby("setting")["strategy"].apply(sorted)
    assert per["query-aware"] == per["query-agnostic"]
    for setting in ("query-aware", "query-agnostic"):
        rows = table[table["setting"] == setting]
        assert (rows["alpha.n"] == 6).all()  # each setting pairs with its own full baseline only
        assert rows.loc[rows["strategy"] == "full", "all.delta_pp"].iloc[0] == 0
    md = (tmp_path / "leaderboard.md").read_text()
    aware, agnostic = md.index("## Query-aware"), md.index("## Query-agnostic")
    assert aware < agnostic and "task.query_aware=false" in md[agnostic:]
    page = (tmp_path / "leaderboard.html").read_text()
    assert page.count("<table") == 6 and 'data-setting="query-agnostic"' in page
    claims_md = (tmp_path / "claim_check.md").read_text()
    assert "# Claim check — query-aware" in claims_md and "# Claim check — query-agnostic" in claims_md


def test_setting_filter_and_its_error(store_both, capsys, tmp_path):
    lb = leaderboard.build(read_store(store_both), leaderboard.Filters(setting="query-aware"))
    assert set(lb.table["setting"]) == {"query-aware"} and set(lb.records["query_aware"]) == {True}
    assert leaderboard.main(["--results-dir", str(store_both), "--out-dir", str(tmp_path), "--setting", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "query-aware" in err[0] and "query-agnostic" in err[0]


def test_paired_test_columns_are_rendered_when_the_summary_has_them(records, monkeypatch):
    # The summary's paired-test columns (discordant pairs, McNemar p, CI method) appear in the CSV for every
    # scope and next to the pooled delta in the tables; a summary without them renders as before.
    from kvbench.leaderboard import table

    real = table.summarize

    def with_tests(recs, *args, **kwargs):
        out = real(recs, *args, **kwargs)
        return out.assign(delta_method="newcombe-paired", n_only_strategy=1, n_only_baseline=3, mcnemar_p=0.62)

    monkeypatch.setattr(table, "summarize", with_tests)
    lb = leaderboard.build(records)
    for scope in ("alpha", "beta", "all"):
        for col in leaderboard.TEST_COLUMNS:
            assert f"{scope}.{col}" in lb.table.columns
    md = leaderboard.render_markdown(lb)
    assert "delta_method" in md  # the header names where the CI method is recorded
    csv = leaderboard.render_csv(lb)
    assert "newcombe-paired" in csv and "0.62" in csv


def test_html_renders_markdown_and_marks_best_first_directions(records):
    page = leaderboard.render_html(leaderboard.build(records))
    text = page.split("<body>", 1)[1].split("<script>", 1)[0]
    assert "**" not in text and "`" not in text and "*all tasks*" not in text
    assert "<strong>tiny-llama</strong>" in text and "<code>full</code>" in text
    # First click sorts best first: larger-is-better columns descend, smaller-is-better and text ascend.
    assert 'data-best="asc" data-key="rank" class="asc"' in text  # the current order, marked
    assert 'data-best="desc" data-key="all.delta_pp"' in text
    assert 'data-best="asc" data-key="alpha.bytes_per_token"' in text
    assert 'data-best="asc" data-key="label"' in text


def test_inline_markdown_escapes_html():
    assert leaderboard.inline_markdown("a <b> `x<y>` **B** *i*") == (
        "a &lt;b&gt; <code>x&lt;y&gt;</code> <strong>B</strong> <em>i</em>")


# ------------------------------------------------------------------------------------ short labels


def test_short_label_keeps_only_what_differs_from_the_defaults():
    from kvbench import strategies
    from kvbench.labels import short_label, split_label

    for name in strategies.available():  # every strategy at its defaults is just its name
        assert shorten(strategies.build(name).label()) == name
    # compression_ratio=None resolves to 0.5 when built: the recorded 0.5 is a default too.
    assert shorten("snapkv(budget_tokens=None,compression_ratio=0.5,kernel_size=7,pooling=max,window_size=32)") \
        == "snapkv"
    assert shorten(strategies.build("snapkv", {"compression_ratio": 0.75, "window_size": 16}).label()) == \
        "snapkv(compression_ratio=0.75,window_size=16)"
    inner = {"compression_ratio": 0.75, "recent_fraction": 0.25}
    nested = strategies.build("compose", {"evict": "h2o", "evict_params": inner})
    name, params = split_label(nested.label())
    assert name == "compose" and params["evict_params"] == str(inner)  # commas inside braces stay in the value
    assert shorten(nested.label()) == f"compose(evict=h2o,evict_params={inner})"
    # Unknown strategies (other branches, imported results) keep every parameter; plain names pass through.
    assert shorten("mystery(a=1,b=2)") == "mystery(a=1,b=2)" and shorten("full") == "full"
    assert short_label("int8", {"group_size": 64, "axis": "channel"}) == "int8(axis=channel)"


def test_end_of_run_table_uses_short_labels_on_one_line(records, capsys):
    from rich.console import Console

    from kvbench.report import print_table, summarize

    summary = summarize(leaderboard.paired_records(records))
    console = Console(width=175, record=True)
    print_table(summary, console)
    text = console.export_text()
    for label in ("int8(group_size=8)", "int4(group_size=8,residual_length=0)", "streaming_llm", "full"):
        assert f"│ {label} " in text  # whole, on one line
    assert "budget_tokens" not in text and "pooling=max" not in text  # defaults left out
    # Printing to a pipe, the table widens to keep even a long label on one line.
    print_table(summary)
    assert "│ snapkv(compression_ratio=0.75,kernel_size=3,window_size=4) " in capsys.readouterr().out


def test_paired_records_read_the_needle_depth_from_sample_meta():
    from kvbench.vocab import sample_depth

    assert sample_depth('{"depth": 0.25}') == 0.25
    assert sample_depth({"depths": [0.2, 0.4]}) == pytest.approx(0.3)
    assert sample_depth({"pos": 0.7}, key="pos") == 0.7
    assert pd.isna(sample_depth("not json")) and pd.isna(sample_depth({"depth": True}))


def test_each_setting_states_the_baselines_accuracy_with_its_interval(records):
    from kvbench.spec import accuracy_interval

    lb = leaderboard.build(records)
    md, page = leaderboard.render_markdown(lb), leaderboard.render_html(lb)
    for task in lb.tasks:
        base = lb.records[(lb.records["strategy"] == "full") & (lb.records["task"] == task)]
        acc, lo, hi = accuracy_interval(base["score"].to_numpy())
        shown = f"{task} {acc:.3f} [{lo:.3f}, {hi:.3f}] (n = {len(base)})"
        assert shown in md and shown in page
        assert hi > lo  # a valid interval never has zero width, even when every sample agrees
        row = lb.table[lb.table["strategy"] == "full"].iloc[0]
        assert row[f"{task}.accuracy_ci_low"] == pytest.approx(lo)
        assert row[f"{task}.accuracy_ci_high"] == pytest.approx(hi)
    assert md.count("Baseline (`full`) accuracy with its 95% interval") == len(lb.settings)


# ------------------------------------------------------------------------------- the answer table


def with_offloading_and_a_tie(records: pd.DataFrame) -> pd.DataFrame:
    """The fixture plus a ``tiered`` strategy that saves 97% *device* memory at full's scores (it would top
    any table sorted by accuracy, then memory) and a second int4 whose scores and memory equal int4's."""
    tiered = records[records["strategy"] == "full"].assign(
        strategy="tiered(hot_tokens=4)", strategy_name="tiered", family="tiered", memory_reduction=0.97,
        kv_bytes=records["kv_bytes_fp16"] * 0.03)
    int4 = records[records["strategy"].str.startswith("int4")]
    twin = int4.assign(strategy=int4["strategy"].str.replace("residual_length=0", "residual_length=1"))
    return pd.concat([records, tiered, twin], ignore_index=True)


def test_answer_table_ranks_by_verdict_then_memory_and_keeps_offloading_apart(records):
    lb = leaderboard.build(with_offloading_and_a_tie(records))
    for setting in lb.settings:
        part = lb.table[lb.table["setting"] == setting]
        ranked = part[part["section"] == leaderboard.RANKED].sort_values("rank", kind="mergesort")
        open_ = ranked[ranked["all.verdict"] != leaderboard.BEYOND]
        keys = list(zip(open_["verdict_order"], -open_["all.memory_reduction"], strict=True))
        assert keys == sorted(keys)  # verdict first, then the most memory saved
        assert list(ranked["verdict_order"]) == sorted(ranked["verdict_order"])
        tiered = part[part["family"] == "tiered"].iloc[0]
        assert tiered["section"] == leaderboard.OFFLOADING and pd.isna(tiered["rank"])
        full = part[part["strategy"] == "full"].iloc[0]
        assert full["section"] == leaderboard.REFERENCE and full["all.verdict"] == ""
        # Identical score vectors at one memory level share a rank instead of being ranked by name.
        twins = ranked[ranked["strategy"].str.startswith("int4")]
        assert len(twins) == 2 and twins["rank"].nunique() == 1 and twins["tie"].all()

    md = leaderboard.render_markdown(lb)
    main = md.split("### Query-agnostic: ranked", 1)[1].split("###", 1)[0]
    rows = [ln for ln in main.splitlines() if ln.startswith("| ") and not ln.startswith("| #")]
    assert "tiered" not in main and "### Query-agnostic: offloading" in md  # its own, named section
    # full closes the table as the reference, without an interval, saving nothing against its own cache
    assert rows[-1].startswith("| ref. | full | baseline | 0.0% | reference | – |")
    assert sum(ln.startswith("| 1= |") for ln in rows) == 2  # the int4 twins are the answer, tied
    assert "tied" in leaderboard.answer_sentence(lb, "query-agnostic")


def test_answer_sentence_and_first_row_agree_with_the_claim_check(records):
    lb = leaderboard.build(with_offloading_and_a_tie(records.assign(
        strategy=records["strategy"].where(~records["strategy"].str.startswith("int4"), "int4"))))
    setting = "query-agnostic"
    check = claims.check_claims(lb.summary[lb.summary["setting"] == setting])
    best = check.settings[0].best_pp[claims.OVERALL]  # nothing holds at n = 12: the point-estimate pick
    assert check.settings[0].headline[claims.OVERALL].verdict != claims.HOLDS
    first = lb.table[(lb.table["setting"] == setting) & (lb.table["rank"] == 1)]
    assert list(first["strategy"]) == [best.strategy]
    sentence = leaderboard.answer_sentence(lb, setting)
    assert f"`{shorten(best.strategy)}`" in sentence and claims.UNDETERMINED in sentence
    assert leaderboard.claim_verdicts(lb.summary, setting)[best.strategy] == leaderboard.UNDECIDED_IN


# ------------------------------------------------------------------------------------ partial results


def test_an_interrupted_runs_finished_samples_are_shown_marked_partial(store_dir, tmp_path):
    """A run stopped after 3 of its 6 samples has records.jsonl but no parquet in the store (the store is
    written when a run ends): `kvbench leaderboard` still ranks those samples, and says they are partial."""
    import json

    results = _copy_store(store_dir, tmp_path / "results")
    stopped = next((results / "store").glob("beta-*.parquet"))
    run = pd.read_parquet(stopped)
    stopped.unlink()
    done = sorted(run["sample_id"].unique())[:3]
    run_dir = results / "runs" / stopped.stem
    run_dir.mkdir(parents=True)
    finished = run[run["sample_id"].isin(done)].to_dict("records")
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in finished))

    out = tmp_path / "board"
    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(out)]) == 0
    table = pd.read_csv(out / "leaderboard.csv")
    assert (table["beta.n"] == 3).all() and (table["alpha.n"] == 6).all()  # today: no beta at all
    assert table["partial"].all()  # every row rests on some of the stopped run's samples
    md = (out / "leaderboard.md").read_text()
    assert "| full (partial) |" in md and "3 record(s)" not in md
    assert f"**Partial**: {len(finished)} record(s) come from runs that have not finished" in md
    # Once the run publishes its parquet, nothing is partial any more.
    from kvbench.results import atomic_write_parquet

    atomic_write_parquet(run[run["sample_id"].isin(done)], stopped)
    lb = leaderboard.build(leaderboard.read_records(results))
    assert "partial" not in lb.table.columns or not lb.table["partial"].any()


def test_claim_check_quotes_the_command_that_measured_the_store(store_dir, tmp_path):
    cmd = "ROUNDS=3 scripts/reproduce_headline.sh"
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path), "--measured-by", cmd]) == 0
    assert f"Measured by: {cmd}" in (tmp_path / "claim_check.md").read_text()
    assert leaderboard.main(["--results-dir", str(store_dir), "--out-dir", str(tmp_path)]) == 0
    assert "Measured by" not in (tmp_path / "claim_check.md").read_text()


def test_pooled_documents_count_the_records_the_pooled_column_pools():
    """Pooled columns use one context length (fiction at 2K is left out of a 4K pool): the documents shown beside
    the pooled n are those of the pooled records, never more than the questions when each has its own document."""
    from test_claims import _records

    parts = [_records({"full": [1] * 6, "int8": [1] * 6}, task=t, context=4096, docs=[f"{t}{i}" for i in range(6)])
             for t in ("legal", "papers")]
    parts.append(_records({"full": [1] * 5, "int8": [1] * 5}, task="fiction", context=2048,
                          docs=[f"f{i}" for i in range(5)]))
    recs = pd.concat(parts, ignore_index=True).assign(
        dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0, params="{}")
    recs["strategy_name"] = recs["strategy"]
    table = leaderboard.build(recs).table.set_index("strategy")
    assert table.loc["int8", "all.n"] == 12 and table.loc["int8", "all.documents"] == 12
    assert table.loc["full", "all.documents"] == 12  # the reference row too, though it has no comparison


def _board_records(parts: list[pd.DataFrame]) -> pd.DataFrame:
    recs = pd.concat(parts, ignore_index=True).assign(dtype="float32", config_hash="abc", run_id="r-m-abc", seed=0,
                                                      params="{}")
    recs["strategy_name"] = recs["strategy"]
    return recs


def _two_lengths(scores: dict[str, list[float]], reduction: dict[str, float] | None = None) -> pd.DataFrame:
    """legal and papers at 4,096 tokens, fiction at 2,048: the committed leaderboard's shape."""
    from test_claims import _records

    n = len(next(iter(scores.values())))
    parts = [_records(scores, task=t, context=c, reduction=reduction, docs=[f"{t}{i}" for i in range(n)])
             for t, c in (("legal", 4096), ("papers", 4096), ("fiction", 2048))]
    return _board_records(parts)


def test_every_table_heading_names_its_context_lengths_and_the_pooled_scope():
    lb = leaderboard.build(_two_lengths({"full": [1] * 6, "int8": [1] * 6}))
    scope = lb.pooled_scope("query-aware")
    assert scope.tasks == ("legal", "papers") and scope.tokens == 4096
    assert scope.left_out == (("fiction", "2,048 tokens"),)
    md, page = leaderboard.render_markdown(lb), leaderboard.render_html(lb)
    headings = [ln for ln in md.splitlines() if ln.startswith("### ")]
    assert len(headings) == 3 and all("4,096" in h for h in headings)  # answer, per task, latency
    pooled = "legal, papers pooled at 4,096 tokens; not pooled: fiction at 2,048 tokens"
    assert headings[0] == f"### Query-aware: ranked ({pooled})"
    assert headings[1] == "### Query-aware: per task (context tokens: fiction 2,048; legal 4,096; papers 4,096)"
    assert "legal, papers pooled at 4,096 tokens" in leaderboard.answer_sentence(lb, "query-aware")
    assert page.count("<h3") == 3 and f"ranked ({pooled})</h3>" in page
    # The claim check names the same scope: what its pooled rows pool and leave out.
    assert ("Pooled scope *all tasks at 4,096 tokens (pooled)*: legal, papers; not pooled: fiction (2,048 tokens)."
            in leaderboard.render_claim_check(lb))


def test_rows_that_fail_rank_by_their_loss_not_by_memory():
    """int2 saves more and loses 50 points, snapkv saves less and loses 20: both fail, and the smaller loss comes
    first. Among undetermined rows the larger saving still comes first (the page's question)."""
    n = 40
    scores = {"full": [1] * n, "int2": [1] * (n // 2) + [0] * (n // 2), "snapkv": [1] * 32 + [0] * 8,
              "int8": [1] * n, "int4": [1] * 39 + [0]}
    lb = leaderboard.build(_two_lengths(scores, {"int2": 0.8, "snapkv": 0.5, "int8": 0.48, "int4": 0.7}))
    rank = lb.table.set_index("strategy")["rank"]
    verdict = lb.table.set_index("strategy")["all.verdict"]
    assert verdict["int2"] == verdict["snapkv"] == leaderboard.BEYOND == "fails"
    assert rank["snapkv"] < rank["int2"]
    assert verdict["int4"] == leaderboard.UNDECIDED_OUT and verdict["int8"] == leaderboard.UNDECIDED_IN
    assert rank["int8"] < rank["int4"] < rank["snapkv"]


def test_verdicts_use_the_spec_and_claim_check_words():
    from kvbench import paired

    assert leaderboard.WITHIN == paired.HOLDS and leaderboard.BEYOND == paired.FAILS
    assert all(v.startswith("undetermined") for v in (leaderboard.UNDECIDED_IN, leaderboard.UNDECIDED_OUT))
    spec = (Path(__file__).resolve().parents[1] / "docs" / "measurement-spec.md").read_text()
    assert "| holds |" in spec and "| fails |" in spec and "| undetermined |" in spec


def test_offloading_is_never_in_a_memory_column(records):
    lb = leaderboard.build(with_offloading_and_a_tie(records))
    md = leaderboard.render_markdown(lb)
    for title in ("per task", "memory and latency per task"):
        table = md.split(f"### Query-agnostic: {title} (", 1)[1].split("\n### ", 1)[0]
        header = next(ln for ln in table.splitlines() if ln.startswith("| strategy"))
        row = next(ln for ln in table.splitlines() if ln.startswith("| tiered"))
        cells = dict(zip(header.split(" | "), row.split(" | "), strict=True))
        memory = [h for h in cells if "mem. saved" in h or "KV B/tok" in h]
        assert memory and all(cells[h] == "–" for h in memory), cells
        assert "Offloading (`tiered(hot_tokens=4)`) is left out of the memory columns" in table
    page = leaderboard.render_html(lb)
    tasks = page.split('id="table-query-agnostic-tasks"', 1)[1].split("</table>", 1)[0]
    tiered = tasks.split('data-strategy="tiered(hot_tokens=4)">', 1)[1].split("</tr>", 1)[0]
    assert '<td class="num" data-v="">–</td>' in tiered  # sorts as missing, too


def test_no_answer_is_named_when_full_itself_is_below_the_floor():
    """full at 0/4 on the pooled tasks (the 0/2 sweep of the issue, two tasks): no answer, no highlighted row; at
    2/6 (Wilson 0.097–0.70) its interval still reaches below the floor; at 4/4 (0.51–1) the answer is named."""
    lb = leaderboard.build(_two_lengths({"full": [0, 0], "int8": [0, 0]}))
    sentence = leaderboard.answer_sentence(lb, "query-aware")
    assert sentence.startswith("No answer: `full` itself scores 0.000 [0.000, 0.490] (n = 4)")
    assert "**" not in sentence and "`int8`" not in sentence
    assert f"below a lower end of {leaderboard.BASELINE_FLOOR:g}" in sentence
    page = leaderboard.render_html(lb)
    assert 'class="answer"' not in page
    half = leaderboard.build(_two_lengths({"full": [1, 0, 0], "int8": [1, 0, 0]}))
    assert not leaderboard.answer_shown(half, "query-aware")
    fine = leaderboard.build(_two_lengths({"full": [1, 1], "int8": [1, 1]}))
    assert leaderboard.answer_shown(fine, "query-aware")
    assert leaderboard.answer_sentence(fine, "query-aware").startswith("**Answer")
    assert 'class="answer"' in leaderboard.render_html(fine)
