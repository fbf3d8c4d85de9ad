"""``kvbench advise`` (issue 54): the projection against kvbench.calc's arithmetic, the evidence rules (a task's own
verdict or "never measured", never another task's), the recommendation rule, bad input, and docs/advise.md."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench import advise, calc
from kvbench.hardware import GB, HardwareProfile, load_profile
from kvbench.leaderboard.table import BEYOND, UNDECIDED_IN, UNDECIDED_OUT, WITHIN

ROOT = Path(__file__).resolve().parents[1]
SMOL_ELEMENTS = calc.preset("smollm2-135m").kv_elements_per_token  # 11,520: 2 bytes per element = 23,040 B/token


def table(rows: list[dict]) -> pd.DataFrame:
    """A leaderboard.csv-shaped table: ``rows`` give strategy, bytes per token and per-task (n, Δ, low, high)."""
    out = []
    for r in rows:
        row = {"setting": "query-agnostic", "strategy": r["strategy"], "label": r["strategy"], "name": r["strategy"],
               "family": r.get("family", "quantization"), "model": "smollm2-135m"}
        for task in ("legal", "fiction"):
            row[f"{task}.bytes_per_token"] = r["bytes"]
            row[f"{task}.kept_fraction"] = 1.0
            n, delta, lo, hi = r.get(task, (math.nan,) * 4)
            row.update({f"{task}.n": n, f"{task}.delta_pp": delta, f"{task}.delta_ci_low": lo,
                        f"{task}.delta_ci_high": hi})
        out.append(row)
    return pd.DataFrame(out)


@pytest.fixture
def measured() -> list[advise.Measured]:
    t = table([
        {"strategy": "full", "bytes": 2.0 * SMOL_ELEMENTS},
        {"strategy": "aa", "bytes": 1.0 * SMOL_ELEMENTS, "fiction": (100, 0.0, -0.5, 0.5)},      # holds, fiction only
        {"strategy": "bb", "bytes": 0.25 * SMOL_ELEMENTS, "legal": (100, -30.0, -40.0, -20.0)},  # smallest, fails
        {"strategy": "cc", "bytes": 1.0 * SMOL_ELEMENTS, "legal": (100, -0.5, -3.0, 2.0)},       # undetermined > −1
    ])
    return advise.measured_from_table(t, "query-agnostic", lambda label, task: "4,096", "test", ["legal", "fiction"])


def deployment(**kw) -> advise.Deployment:
    base = {"arch": calc.preset("llama-3.1-8b"), "hardware": load_profile("server-gpu-80g"), "context": 32_768,
            "task": "legal"}
    return advise.Deployment(**{**base, **kw})


def by_name(a: advise.Advice) -> dict[str, advise.Row]:
    return {r.strategy.short: r for r in a.rows}


def test_interval_verdict_uses_the_one_point_margin():
    assert advise.interval_verdict(-0.9, 0.5, 0.0) == WITHIN
    assert advise.interval_verdict(-3.0, -1.0, -2.0) == BEYOND
    assert advise.interval_verdict(-3.0, 1.0, -0.5) == UNDECIDED_IN
    assert advise.interval_verdict(-3.0, 1.0, -1.0) == UNDECIDED_OUT


def test_fits_and_speed_are_calc_and_the_roofline(measured):
    d = deployment()
    rows = by_name(advise.advise(d, measured))
    arch, hw = d.arch, d.hardware
    # By hand: 80 GiB less 10%, 8,030,261,248 bf16 weights, 2 × 32 × 8 × 128 × 2 B = 131,072 B/token.
    usable = 80 * 2**30 * 0.9
    weights = 8_030_261_248 * 2
    per_seq = 131_072 * 32_768
    assert rows["full"].fits == math.floor((usable - weights) / per_seq) == 14
    assert rows["aa"].fits == math.floor((usable - weights) / (per_seq / 2))
    assert rows["full"].memory_saved == 0 and rows["aa"].memory_saved == pytest.approx(0.5)
    # One decode step of 14 sequences: memory-bound on the H100's 3.35 TB/s.
    b = rows["full"].batch
    nbytes = weights + b * per_seq
    # Every one of the 32 query heads scores and mixes each of the 32 layers' 32,768 held tokens (4 × head_dim
    # FLOPs); grouped-query attention shares KV heads, it does not skip query heads.
    flops = b * (2 * arch.params + 4 * 128 * 32_768 * 32 * 32)
    assert nbytes / (hw.device_mem_bw_gbps * GB) > flops / hw.peak_flops
    assert rows["full"].decode_bound == "memory"
    assert rows["full"].tokens_per_s == pytest.approx(b / (nbytes / (hw.device_mem_bw_gbps * GB)))


def test_never_measured_on_the_task_says_so_and_borrows_nothing(measured):
    a = advise.advise(deployment(), measured)
    aa = by_name(a)["aa"]
    assert aa.evidence is None and aa.verdict == advise.NOT_MEASURED and not aa.admissible
    cells = advise._cells(1, aa, a.deployment)
    assert "never measured on legal" in cells and WITHIN not in cells  # fiction's "holds" is not borrowed
    assert "never measured on legal" in advise.render_markdown(a)


def test_recommendation_never_picks_failing_or_unmeasured_evidence(measured):
    # 8 users at 32K: full serves them on 80 GB, and full's exact cache comes before faster undetermined rows.
    a = advise.advise(deployment(concurrency=8), measured)
    assert a.recommendation.strategy.short == "full"
    assert "the faster" in a.reason and "bb" in a.reason  # the fastest row is named with its verdict
    # 20 users do not fit the exact cache: the admissible strategy that serves them is chosen, never bb (fails)
    # or aa (no legal evidence), although both fit as many.
    a = advise.advise(deployment(concurrency=20), measured)
    assert a.recommendation.strategy.short == "cc" and by_name(a)["cc"].serves
    assert "another model than Llama-3.1-8B" in a.reason and "n = 100" in a.reason
    # 100 users: nothing admissible serves them; the one serving most is named, and the sentence says so.
    a = advise.advise(deployment(concurrency=100), measured)
    assert a.recommendation.strategy.short == "cc" and "of 100 sequences" in a.reason


def test_other_model_is_labelled_and_the_same_model_is_not(measured):
    a = advise.advise(deployment(), measured)
    assert "(other model)" in " ".join(advise._cells(1, by_name(a)["cc"], a.deployment))
    same = advise.advise(deployment(arch=calc.preset("smollm2-135m"), context=4096), measured)
    assert "(other model)" not in " ".join(advise._cells(1, by_name(same)["cc"], same.deployment))


def test_latency_target_shrinks_the_batch(measured):
    free = by_name(advise.advise(deployment(), measured))["full"]
    d = deployment(latency_ms=advise.decode_step(deployment(), 2.0, 1.0, 2)[0] * 1000)
    tight = by_name(advise.advise(d, measured))["full"]
    assert free.batch == 14 and tight.batch == 2 and tight.ms_per_step <= d.latency_ms


def test_weights_that_do_not_fit_say_so_and_name_what_would(measured):
    a = advise.advise(deployment(arch=calc.preset("llama-3-70b"), context=12_000), measured)
    assert a.recommendation is None and "weights alone" in a.reason
    # By hand: 2 × 80 GiB × 0.9 less 141.1 GB of bf16 weights holds 3 exact 12K sequences (3.93 GB each); one
    # card with int8 weights (70.6 GB) holds 1.
    two = advise.advise(deployment(arch=calc.preset("llama-3-70b"), context=12_000, devices=2), measured)
    assert by_name(two)["full"].fits == math.floor((2 * 80 * 2**30 * 0.9 - 2 * 70_553_706_496)
                                                   / (327_680 * 12_000)) == 3
    assert [how for how, _ in a.alternatives] == ["devices=2", "weight_dtype=int8"]
    (_, sharded), (_, int8) = a.alternatives
    assert sharded.deployment.devices == 2 and by_name(sharded)["full"].fits == 3
    assert by_name(int8)["full"].fits == math.floor((80 * 2**30 * 0.9 - 70_553_706_496) / (327_680 * 12_000)) == 1
    assert "with devices=2 use full (3 sequences" in a.reason and "with weight_dtype=int8 use full (1 sequence " \
        in a.reason and "devices=N" not in a.reason
    assert advise.WEIGHT_NOTE in int8.notes and advise.WEIGHT_NOTE not in sharded.notes
    text = advise.render_markdown(a)
    assert "## With `devices=2`" in text and "## With `weight_dtype=int8`" in text
    csv = pd.read_csv(__import__("io").StringIO(advise.render_csv(a)))
    assert list(csv.drop_duplicates("variant")["variant"]) == ["as asked", "devices=2", "weight_dtype=int8"]
    assert csv.groupby("variant")["recommended"].sum().to_dict() == {"as asked": 0, "devices=2": 1,
                                                                     "weight_dtype=int8": 1}


def test_alternatives_prefer_serving_the_load_and_give_up_honestly(measured):
    # 8 users of Llama-3-70B at 12K: 2 cards hold 3 exact sequences, 3 cards (210 GB usable) hold 17 — the fewest
    # devices that serve the whole load are chosen over the fewest that fit something.
    a = advise.advise(deployment(arch=calc.preset("llama-3-70b"), context=12_000, concurrency=8), measured)
    how, alt = a.alternatives[0]
    assert how == "devices=3" and alt.recommendation.serves
    # Weights fit but nothing admissible does (Llama-3.1-8B at 128K on 24 GiB: cc's 8.6 GB and full's 17.2 GB
    # exceed the 7.1 GB left; bb fits but fails): the alternatives still apply.
    a = advise.advise(deployment(hardware=load_profile("consumer-gpu-24g"), context=131_072), measured)
    assert a.recommendation is None and by_name(a)["bb"].fits >= 1
    assert [how for how, _ in a.alternatives] == ["devices=2", "weight_dtype=int8"]
    assert a.alternatives[1][1].recommendation.strategy.short == "cc"  # int8 weights leave 15.2 GB: cc fits, full not
    # On a host more memory means another machine: no devices=N; 141 GB of weights fit no int4 host of 23 GB.
    a = advise.advise(deployment(arch=calc.preset("llama-3-70b"), context=12_000, hardware=load_profile("cpu")),
                      measured)
    assert a.alternatives == [] and "devices=N" in a.reason
    # Something fits as asked: nothing else is tried.
    assert advise.advise(deployment(), measured).alternatives == []


def test_offloading_is_left_out_with_a_note():
    t = table([{"strategy": "full", "bytes": 2.0 * SMOL_ELEMENTS},
               {"strategy": "tiered", "bytes": 0.1 * SMOL_ELEMENTS, "family": "tiered",
                "legal": (100, 0.0, -1.0, 1.0)}])
    ms = advise.measured_from_table(t, "query-agnostic", lambda *_: "4,096", "test", ["legal"])
    a = advise.advise(deployment(), ms)
    assert [r.strategy.short for r in a.rows] == ["full"] and any("tiered" in n for n in a.notes)


def test_hardware_section_names_every_profile(measured):
    t = table([{"strategy": "full", "bytes": 2.0 * SMOL_ELEMENTS},
               {"strategy": "cc", "bytes": 1.0 * SMOL_ELEMENTS, "legal": (100, -0.5, -3.0, 2.0)}])
    t["all.n"], t["all.delta_pp"], t["all.delta_ci_low"], t["all.delta_ci_high"] = 100, -0.5, -3.0, 2.0
    records = pd.DataFrame({"strategy": ["cc"], "task": ["legal"], "context_tokens": [4096]})
    lines = advise.hardware_section(t, records, ["legal"], "query-agnostic", "smollm2-135m", 4096)
    for name in ("cpu", "consumer-gpu-24g", "server-gpu-80g", "laptop-16g"):
        assert any(line.startswith(f"| {name} |") for line in lines)


def test_laptop_profile_cites_its_sources():
    p = load_profile("laptop-16g")
    assert p.memory_bytes == 16 * 2**30 and p.host_link_bw_gbps is None and len(p.sources) >= 2
    assert isinstance(p, HardwareProfile)


# -- the command line ---------------------------------------------------------------------------------------
def test_done_when_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    argv = ["model=llama-3-70b", "task.context_tokens=12000", "hardware=server-gpu-80g", "task=legal",
            f"out={tmp_path}", f"results_root={ROOT / 'results'}"]
    assert advise.main(argv) == 0
    out = capsys.readouterr().out
    assert "**Recommendation.**" in out and "| rank | strategy | fits |" in out
    # 141 GB of bf16 weights fit no 80 GB card: the recommendation names what would fit, each ranked in full.
    assert "with devices=2 use " in out and "## With `devices=2`" in out
    csv = pd.read_csv(tmp_path / "advise.csv")
    tables = out.count("| rank | strategy |")
    assert tables == 1 + csv["variant"].nunique() - 1 == 3
    assert len(csv) == out.count("\n| ") - tables and set(csv["model"]) == {"Llama-3-70B"}
    assert csv.loc[csv["strategy"] == "full", "verdict"].eq(advise.EXACT).all()
    assert (tmp_path / "advise.md").read_text() in out


@pytest.mark.parametrize("override, fragment", [
    ("model=nope", "llama-3-70b"),
    ("hardware=nope", "server-gpu-80g"),
    ("strategies=[nope]", "int8"),
    ("setting=nope", "query-aware"),
    ("concurrency=0", "concurrency"),
    ("weight_dtype=fp7", "bf16"),
    ("model=local", "model.path must be given"),
])
def test_bad_input_is_one_line_exit_2(override, fragment, capsys, tmp_path):
    assert advise.main([override, "out=null", f"results_root={ROOT / 'results'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("valid" in err or "must be" in err)
    assert fragment in err


# -- docs/advise.md -----------------------------------------------------------------------------------------
def _docs():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import advise_docs
    finally:
        sys.path.pop(0)
    return advise_docs


def test_docs_page_is_what_the_script_writes_and_its_figures_hold():
    docs = _docs()
    text = docs.render()
    assert (ROOT / "docs" / "advise.md").read_text() == text, "rerun scripts/advise_docs.py"
    # Figures by hand: Llama-3-70B's 327,680 B/token × 12,000 = 3.93 GB; Llama-3.1-8B at 32K on 80 GiB: 14 exact
    # sequences, on 24 GiB: 1.
    assert "holds 3.93 GB of KV cache per sequence" in text
    assert "| Llama-3.1-8B | 32,768 | server-gpu-80g | 14 |" in text
    assert "| Llama-3.1-8B | 32,768 | consumer-gpu-24g | 1 |" in text
    assert math.floor((24 * 2**30 * 0.9 - 2 * 8_030_261_248) / (131_072 * 32_768)) == 1
    # Llama-3-70B on one 80 GB card fits nothing; 2 cards hold 3 exact 12K sequences, 3 cards 23: the fewest
    # cards that serve the page's 8 users is 3.
    assert [math.floor((n * 80 * 2**30 * 0.9 - 2 * 70_553_706_496) / (327_680 * 12_000)) for n in (2, 3)] == [3, 23]
    assert "server-gpu-80g; with devices=3 use full (8 sequences" in text
    for model, context, _ in docs.DEPLOYMENTS:
        for profile in docs.PROFILES:
            assert f"| {calc.preset(model).name} | {context:,} | {profile} |" in text


# -- the leaderboard's "By hardware profile" section ---------------------------------------------------------
def test_leaderboard_pages_carry_the_hardware_section_from_advise(store_dir):
    """Markdown and HTML show, per committed profile, what advise's own code recommends from the page's table."""
    import html

    from kvbench import leaderboard
    from kvbench.results import read_store

    records = read_store(store_dir).assign(model="smollm2-135m")  # a geometry kvbench.calc knows
    lb = leaderboard.build(records)
    setting = lb.settings[0]
    rows = advise.hardware_rows(lb.table, lb.records[lb.records["setting"] == setting], lb.tasks, setting,
                                "smollm2-135m", lb.pooled_scope(setting).tokens)
    assert [r["hardware"] for r in rows] == advise.shipped_profiles()
    md, page = leaderboard.render_markdown(lb), leaderboard.render_html(lb)
    assert "### By hardware profile (smollm2-135m," in md and f'id="table-{setting}-hardware"' in page
    for r in rows:
        assert f"| {r['hardware']} | {r['recommendation']} | {r['fits (recommended)']} |" in md
        assert html.escape(r["why"]) in page
    # A model whose geometry is unknown here gets no section rather than a guess.
    assert "By hardware profile" not in leaderboard.render_markdown(leaderboard.build(read_store(store_dir)))


def test_shipped_profiles_leave_out_the_untracked_probe(monkeypatch):
    import kvbench.hardware

    monkeypatch.setattr(kvbench.hardware, "available_profiles", lambda: ["cpu", "probed", "server-gpu-80g"])
    assert advise.shipped_profiles() == ["cpu", "server-gpu-80g"]


def test_an_interim_leaderboard_is_no_evidence(tmp_path):
    # A registered design's store before its first look (its CSV's `interim` column) lends advise nothing; the
    # same table without the column is read.
    rows = [{"strategy": "full", "bytes": 2.0 * SMOL_ELEMENTS},
            {"strategy": "aa", "bytes": 1.0 * SMOL_ELEMENTS, "legal": (100, 0.0, -0.5, 0.5)}]
    for name, t in (("judged", table(rows)), ("interim", table(rows).assign(interim=True))):
        (tmp_path / name).mkdir()
        t.to_csv(tmp_path / name / "leaderboard.csv", index=False)
    sources = {e.source for m in advise.load_measured(tmp_path, "query-agnostic", 4096) for e in m.evidence.values()}
    assert sources == {str(tmp_path / "judged" / "leaderboard.csv")}
