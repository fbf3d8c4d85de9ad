"""The claim check: what the measured numbers say about the source document's claims.

Written by ``kvbench leaderboard`` to ``claim_check.md``. Every sentence is generated from a summary
frame (:func:`kvbench.report.summarize` rows per task plus the pooled ``all`` rows of
:mod:`kvbench.leaderboard`); nothing here states a conclusion that the numbers did not produce.

Definitions (also in ``docs/leaderboard.md``):

* **within 1 point**: accuracy delta vs ``full`` above −1 percentage point (``delta_pp > −1``), i.e. a
  loss strictly under one point; **within 1% relative**: ``relative_loss < 0.01`` (undefined when the
  baseline scores 0).
* **"40–60% less KV memory at <1% accuracy loss"** holds on a scope when some strategy with memory
  reduction ≥ 0.40 stays within 1 point; it holds *with confidence* when that strategy's CI lower bound
  is also above −1 point. The relative reading (loss < 1% of the baseline's accuracy) is reported too.
* **family comparison** (scenarios): strategy A *dominates* B on a task when A saves at least as much
  memory with at least as good an accuracy delta, and is strictly better on one of the two. Group X
  beats group Y when a larger fraction of Y's strategies is dominated by some X strategy than the other
  way round.
* **drops tokens**: a strategy whose measured ``kept_fraction`` (tokens held / context tokens) is below
  1; strategies that keep every token position (quantization, tiering, recomputation) have 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from kvbench.report import BASELINE

#: Pseudo-task of the summary holding figures pooled over every task (built by kvbench.leaderboard).
OVERALL = "all"
LOSS_PP = 1.0
LOSS_RELATIVE = 0.01
CLAIM_LOW, CLAIM_HIGH = 0.40, 0.60
#: A strategy holding at least this fraction of the context's tokens keeps every position.
KEEPS_ALL = 1.0 - 1e-9
#: sample_meta keys that may hold the relative depth of the fact a question needs (0 = start of the
#: context, 1 = end), in order of preference; a list value (several needles) is averaged.
DEPTH_KEYS = ("depth", "needle_depth", "depths", "needle_depths")


@dataclass(frozen=True)
class Scenario:
    """One of the source document's scenario claims and how the numbers test it."""

    task: str
    title: str
    claim: str
    test: str  # "positions" | "quant_vs_evict" | "dropping_hurts"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("legal", "legal analysis",
             "needs positional fidelity (anchoring the exact clause): strategies that keep every token "
             "position should beat strategies that drop tokens", "positions"),
    Scenario("papers", "paper reading",
             "needs exact figures: quantization should beat eviction", "quant_vs_evict"),
    Scenario("fiction", "long fiction",
             "needs recall of early character settings: eviction that drops tokens should hurt "
             f"(lose at least {LOSS_PP:g} point)", "dropping_hurts"),
)


# --------------------------------------------------------------------------------------------- picks


@dataclass(frozen=True)
class Pick:
    """One strategy's figures on one scope, as the claim check cites them."""

    strategy: str
    family: str
    memory_reduction: float
    delta_pp: float
    ci_low: float
    ci_high: float
    relative_loss: float
    kept_fraction: float
    n: int

    @classmethod
    def from_row(cls, row: Mapping) -> Pick:
        def num(key: str) -> float:
            v = row.get(key, float("nan"))
            return float("nan") if v is None else float(v)

        return cls(strategy=str(row["strategy"]), family=str(row.get("family", "")),
                   memory_reduction=num("memory_reduction"), delta_pp=num("delta_pp"),
                   ci_low=num("delta_ci_low"), ci_high=num("delta_ci_high"),
                   relative_loss=num("relative_loss"), kept_fraction=num("kept_fraction"),
                   n=int(row.get("n", 0) or 0))

    @property
    def drops_tokens(self) -> bool:
        """Measured: holds fewer tokens than the context. Without the measurement, eviction families do."""
        if math.isnan(self.kept_fraction):
            return self.family in ("eviction", "composite")
        return self.kept_fraction < KEEPS_ALL

    def within_pp(self, loss: float = LOSS_PP) -> bool:
        return self.delta_pp > -loss

    def within_relative(self, loss: float = LOSS_RELATIVE) -> bool:
        return not math.isnan(self.relative_loss) and self.relative_loss < loss

    def cite(self) -> str:
        """``int8(group_size=64) (quantization): 48.4% less memory, −0.5 pp [−1.5, +0.5]``."""
        return (f"`{self.strategy}` ({self.family}): {pct(self.memory_reduction)} less KV memory, "
                f"{ci_text(self)}")


def pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{100 * v:.1f}%"


def pp(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:+.1f}"


def ci_text(p: Pick) -> str:
    return f"{pp(p.delta_pp)} pp [95% CI {pp(p.ci_low)}, {pp(p.ci_high)}]"


#: Families whose ``memory_reduction`` is device memory only: the bytes move to host RAM or disk rather than
#: disappear, so they cannot support a claim about KV memory saved (the tiered cache's own figures are in
#: its records' ``stats``).
OFFLOADING_FAMILIES = ("tiered",)


def picks(summary: pd.DataFrame, scope: str) -> list[Pick]:
    """Every non-baseline, non-offloading strategy measured on ``scope`` (a task or ``all``), sorted by label."""
    if summary.empty:
        return []
    rows = summary[(summary["task"] == scope) & (summary["strategy"] != BASELINE)]
    if "family" in rows:
        rows = rows[~rows["family"].isin(OFFLOADING_FAMILIES)]
    rows = rows.sort_values("strategy", kind="mergesort")
    return [Pick.from_row(r) for r in rows.to_dict("records")]


def _largest_reduction(cands: list[Pick]) -> Pick | None:
    """The most memory saved; ties go to the better delta, then the label (deterministic)."""
    cands = [p for p in cands if not math.isnan(p.memory_reduction)]
    if not cands:
        return None
    return sorted(cands, key=lambda p: (-p.memory_reduction, -_nan_low(p.delta_pp), p.strategy))[0]


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def best_within_pp(summary: pd.DataFrame, scope: str, loss: float = LOSS_PP) -> Pick | None:
    """Largest memory reduction on ``scope`` whose accuracy delta stays above ``-loss`` points."""
    return _largest_reduction([p for p in picks(summary, scope) if p.within_pp(loss)])


def best_within_relative(summary: pd.DataFrame, scope: str, loss: float = LOSS_RELATIVE) -> Pick | None:
    """Largest memory reduction on ``scope`` whose relative accuracy loss stays under ``loss``."""
    return _largest_reduction([p for p in picks(summary, scope) if p.within_relative(loss)])


# ------------------------------------------------------------------------------------ headline claim


@dataclass(frozen=True)
class HeadlineVerdict:
    """"40–60% less KV memory at <1% accuracy loss" on one scope."""

    scope: str
    testable: bool  # some strategy reaches the 40% reduction
    holds: bool  # point estimate within 1 point
    holds_ci: bool  # CI lower bound above -1 point too
    holds_relative: bool | None  # None: relative loss undefined (baseline accuracy 0)
    pick: Pick | None  # the strategy ≥ 40% that best supports the claim (or comes closest)
    in_band: bool  # a supporting strategy lies inside 40–60%
    sentence: str


def headline(summary: pd.DataFrame, scope: str) -> HeadlineVerdict:
    """Test the headline claim on one scope (a task or ``all``)."""
    reach = [p for p in picks(summary, scope) if not math.isnan(p.memory_reduction)
             and p.memory_reduction >= CLAIM_LOW]
    if not reach:
        best = _largest_reduction(picks(summary, scope))
        most = f"; the most any strategy saves is {pct(best.memory_reduction)}" if best else ""
        return HeadlineVerdict(scope, False, False, False, None, None, False,
                               f"not testable: no strategy reaches {pct(CLAIM_LOW)} memory reduction{most}")
    confident = [p for p in reach if p.ci_low > -LOSS_PP]
    point = [p for p in reach if p.within_pp()]
    pick = _largest_reduction(confident) or _largest_reduction(point) or \
        sorted(reach, key=lambda p: (-_nan_low(p.delta_pp), -p.memory_reduction, p.strategy))[0]
    defined = [p for p in reach if not math.isnan(p.relative_loss)]
    holds_rel = any(p.within_relative() for p in defined) if defined else None
    in_band = any(CLAIM_LOW <= p.memory_reduction <= CLAIM_HIGH for p in point)
    if confident:
        verdict = (f"**holds**, and with confidence: {pick.cite()} — the whole CI is above "
                   f"−{LOSS_PP:g} point")
    elif point:
        verdict = (f"**holds on the point estimate only**: {pick.cite()} — the CI lower bound "
                   f"{pp(pick.ci_low)} is not above −{LOSS_PP:g} point, so the data cannot rule out a larger loss")
    else:
        verdict = (f"**does not hold**: every strategy saving ≥ {pct(CLAIM_LOW)} loses at least "
                   f"{LOSS_PP:g} point; the closest is {pick.cite()}")
    extras = []
    if point and not in_band:
        extras.append(f"no strategy inside the {pct(CLAIM_LOW)}–{pct(CLAIM_HIGH)} band itself stays within "
                      f"{LOSS_PP:g} point (the supporting ones save more)")
    if holds_rel is None:
        extras.append("the relative reading is undefined (the baseline scores 0)")
    else:
        extras.append(f"read as <{100 * LOSS_RELATIVE:g}% *relative* loss it "
                      f"{'holds' if holds_rel else 'does not hold'}")
    sentence = verdict + ("; " + "; ".join(extras) if extras else "") + "."
    return HeadlineVerdict(scope, True, bool(point), bool(confident), holds_rel, pick, in_band, sentence)


# --------------------------------------------------------------------------------------- scenarios


def dominates(a: Pick, b: Pick) -> bool:
    """``a`` saves at least as much memory at an accuracy delta at least as good, strictly better in one."""
    if any(math.isnan(v) for v in (a.memory_reduction, b.memory_reduction, a.delta_pp, b.delta_pp)):
        return False
    return (a.memory_reduction >= b.memory_reduction and a.delta_pp >= b.delta_pp
            and (a.memory_reduction > b.memory_reduction or a.delta_pp > b.delta_pp))


@dataclass(frozen=True)
class GroupComparison:
    """How often each group's strategies are dominated by the other group's."""

    a_name: str
    b_name: str
    a: list[Pick]
    b: list[Pick]
    b_dominated: list[str]  # B strategies dominated by some A strategy
    a_dominated: list[str]

    @property
    def b_fraction(self) -> float:
        return len(self.b_dominated) / len(self.b)

    @property
    def a_fraction(self) -> float:
        return len(self.a_dominated) / len(self.a)

    @property
    def a_wins(self) -> bool:
        return self.b_fraction > self.a_fraction

    @property
    def b_wins(self) -> bool:
        return self.a_fraction > self.b_fraction

    def sentence(self) -> str:
        s = (f"{len(self.b_dominated)} of {len(self.b)} {self.b_name} strategies are dominated by "
             f"{_article(self.a_name)} {self.a_name} strategy (as much memory saved or more, at as good an "
             f"accuracy delta or better), and {len(self.a_dominated)} of {len(self.a)} {self.a_name} strategies "
             f"by {_article(self.b_name)} {self.b_name} one")
        pair = matched_pair(self.a, self.b)
        if pair is not None:
            pa, pb = pair
            s += (f"; at the closest memory level, {pa.cite()} versus {pb.cite()}")
        return s


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def compare_groups(a_name: str, a: list[Pick], b_name: str, b: list[Pick]) -> GroupComparison:
    return GroupComparison(
        a_name, b_name, a, b,
        b_dominated=[q.strategy for q in b if any(dominates(p, q) for p in a)],
        a_dominated=[p.strategy for p in a if any(dominates(q, p) for q in b)],
    )


def matched_pair(a: list[Pick], b: list[Pick]) -> tuple[Pick, Pick] | None:
    """The (A, B) pair closest in memory reduction; ties go to the larger reduction, then the labels."""
    pairs = [(abs(p.memory_reduction - q.memory_reduction), -max(p.memory_reduction, q.memory_reduction),
              p.strategy, q.strategy, p, q) for p in a for q in b
             if not math.isnan(p.memory_reduction) and not math.isnan(q.memory_reduction)]
    if not pairs:
        return None
    best = sorted(pairs, key=lambda t: t[:4])[0]
    return best[4], best[5]


@dataclass
class ScenarioResult:
    scenario: Scenario
    measured: bool
    winner: Pick | None = None  # largest reduction within 1 point on the task
    closest: Pick | None = None  # best delta when nothing stays within 1 point
    families: list[tuple[str, Pick, bool]] = field(default_factory=list)  # family, its pick, within 1 point
    holds: bool | None = None  # None: not testable with what was measured
    evidence: str = ""


def family_picks(task_picks: list[Pick]) -> list[tuple[str, Pick, bool]]:
    """Per family: its largest reduction within 1 point, or (if none qualifies) its best delta."""
    out = []
    for fam in sorted({p.family for p in task_picks}):
        members = [p for p in task_picks if p.family == fam]
        within = _largest_reduction([p for p in members if p.within_pp()])
        if within is not None:
            out.append((fam, within, True))
        else:
            out.append((fam, sorted(members, key=lambda p: (-_nan_low(p.delta_pp), p.strategy))[0], False))
    return out


def scenario(summary: pd.DataFrame, sc: Scenario, records: pd.DataFrame | None = None) -> ScenarioResult:
    """Which family wins on the scenario's task, and whether the scenario's claim holds there.

    ``records`` (optional, paired records) add the token-dropping strategies' loss per depth of the
    fact to the fiction evidence, when the task records depths.
    """
    task_picks = picks(summary, sc.task)
    if not task_picks:
        return ScenarioResult(sc, False, evidence=f"not measured: no strategy records for task `{sc.task}`.")
    res = ScenarioResult(sc, True, winner=best_within_pp(summary, sc.task), families=family_picks(task_picks))
    if res.winner is None:
        res.closest = sorted(task_picks, key=lambda p: (-_nan_low(p.delta_pp), p.strategy))[0]

    if sc.test in ("positions", "quant_vs_evict"):
        if sc.test == "positions":
            a_name, b_name = "position-keeping", "token-dropping"
            a = [p for p in task_picks if not p.drops_tokens]
            b = [p for p in task_picks if p.drops_tokens]
        else:
            a_name, b_name = "quantization", "eviction"
            a = [p for p in task_picks if p.family == "quantization"]
            b = [p for p in task_picks if p.family == "eviction"]
        if not a or not b:
            missing = a_name if not a else b_name
            res.evidence = f"not testable on `{sc.task}`: no {missing} strategy was measured."
            return res
        cmp = compare_groups(a_name, a, b_name, b)
        res.holds = cmp.a_wins
        outcome = (f"{a_name} beats {b_name}" if cmp.a_wins else
                   f"{b_name} beats {a_name}" if cmp.b_wins else "neither group dominates the other")
        res.evidence = f"On `{sc.task}`, {cmp.sentence()}: {outcome}."
        return res

    # dropping_hurts: the token-dropping strategies' mean delta must reach -1 point.
    drop = [p for p in task_picks if p.drops_tokens and not math.isnan(p.delta_pp)]
    if not drop:
        res.evidence = f"not testable on `{sc.task}`: no token-dropping strategy was measured."
        return res
    mean = sum(p.delta_pp for p in drop) / len(drop)
    hurt = [p for p in drop if not p.within_pp()]
    significant = [p for p in drop if p.ci_high < 0]
    res.holds = mean <= -LOSS_PP
    others = _mean_delta_elsewhere(summary, sc.task, [p.strategy for p in drop])
    elsewhere = (f"; the same strategies average {pp(others)} pp on the other tasks"
                 if others is not None else "")
    worst = sorted(drop, key=lambda p: (_nan_low(p.delta_pp), p.strategy))[0]
    res.evidence = (f"On `{sc.task}`, the {len(drop)} token-dropping strategies average {pp(mean)} pp "
                    f"({len(hurt)} lose at least {LOSS_PP:g} point, {len(significant)} with a CI entirely "
                    f"below 0){elsewhere}; the largest loss is {worst.cite()}: "
                    f"{'they hurt' if res.holds else f'on average they do not lose {LOSS_PP:g} point'}.")
    if records is not None:
        res.evidence += _depth_sentence(depth_deltas(records, sc.task, [p.strategy for p in drop]))
    return res


def _mean_delta_elsewhere(summary: pd.DataFrame, task: str, strategies: list[str]) -> float | None:
    rows = summary[(summary["task"] != task) & (summary["task"] != OVERALL)
                   & summary["strategy"].isin(strategies)]["delta_pp"].dropna()
    return float(rows.mean()) if len(rows) else None


def sample_depth(meta: Any, key: str | None = None) -> float:
    """A sample's needle depth from its ``sample_meta`` (JSON text or dict); NaN when it has none."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            return float("nan")
    if not isinstance(meta, dict):
        return float("nan")
    for k in ([key] if key else DEPTH_KEYS):
        v = meta.get(k)
        if isinstance(v, (list, tuple)) and v and all(isinstance(d, (int, float)) for d in v):
            return float(np.mean(v))
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return float("nan")


def depth_deltas(records: pd.DataFrame | None, task: str, strategies: Sequence[str]) -> dict[float, float]:
    """Mean paired delta (pp) of ``strategies`` vs ``full`` per depth of the fact in the context.

    ``records`` are paired records (one per task, strategy and sample key, as the leaderboard builds
    them); each strategy's delta at a depth is its mean score minus ``full``'s on the same samples, and
    the strategies are then averaged. ``{}`` when the task's records carry no depth.
    """
    if records is None or records.empty or "sample_meta" not in records:
        return {}
    df = records[records["task"] == task]
    df = df.assign(_depth=[round(sample_depth(m), 3) for m in df["sample_meta"]])
    df = df[df["_depth"].notna()]
    base = df[df["strategy"] == BASELINE][["sample_id", "score"]]
    per_depth: dict[float, list[float]] = {}
    for strategy in strategies:
        paired = df[df["strategy"] == strategy].merge(base, on="sample_id", suffixes=("", "_base"))
        for depth, grp in paired.groupby("_depth", sort=True):
            per_depth.setdefault(float(depth), []).append(100 * float((grp["score"] - grp["score_base"]).mean()))
    return {d: float(np.mean(v)) for d, v in sorted(per_depth.items())}


def _depth_sentence(deltas: dict[float, float]) -> str:
    if len(deltas) < 2:
        return ""
    parts = ", ".join(f"{pp(v)} pp at depth {d:g}" for d, v in deltas.items())
    shallow, deep = deltas[min(deltas)], deltas[max(deltas)]
    trend = ("larger than" if shallow < deep else "smaller than" if shallow > deep else "the same as")
    return (f" By the fact's depth in the context (0 = start), they average {parts}: the loss at the "
            f"shallowest depth is {trend} at the deepest.")


# ------------------------------------------------------------------------------------------- report


@dataclass
class ClaimCheck:
    meta: dict[str, str]
    scopes: list[str]
    best_pp: dict[str, Pick | None]
    best_relative: dict[str, Pick | None]
    relative_defined: dict[str, bool]
    headline: dict[str, HeadlineVerdict]
    scenarios: list[ScenarioResult]


def check_claims(summary: pd.DataFrame, meta: Mapping[str, str] | None = None,
                 records: pd.DataFrame | None = None, scenarios: tuple[Scenario, ...] = SCENARIOS) -> ClaimCheck:
    """Evaluate every claim on a summary frame (per-task rows, optionally the pooled ``all`` rows); the
    paired ``records`` behind it, when given, add depth breakdowns."""
    tasks = sorted(t for t in summary["task"].astype(str).unique() if t != OVERALL) if not summary.empty else []
    scopes = tasks + ([OVERALL] if not summary.empty and (summary["task"] == OVERALL).any() else [])
    rel_defined = {s: any(not math.isnan(p.relative_loss) for p in picks(summary, s)) for s in scopes}
    return ClaimCheck(
        meta=dict(meta or {}),
        scopes=scopes,
        best_pp={s: best_within_pp(summary, s) for s in scopes},
        best_relative={s: best_within_relative(summary, s) for s in scopes},
        relative_defined=rel_defined,
        headline={s: headline(summary, s) for s in scopes},
        scenarios=[scenario(summary, sc, records) for sc in scenarios],
    )


def _scope_name(scope: str) -> str:
    return "all tasks (pooled)" if scope == OVERALL else scope


def _cells(p: Pick | None, undefined: bool = False) -> list[str]:
    if p is None:
        return ["undefined (baseline scores 0)" if undefined else "none", "–", "–"]
    return [f"`{p.strategy}` ({p.family})", pct(p.memory_reduction), ci_text(p)]


def render_claims(check: ClaimCheck) -> str:
    """``claim_check.md``: tables and sentences generated from ``check``."""
    m = check.meta
    lines = ["# Claim check", ""]
    if m:
        lines += [f"Model **{m.get('model', '?')}**, measurement spec v{m.get('spec_version', '?')}, hardware "
                  f"profile {m.get('hardware', '?')}, dtype {m.get('dtype', '?')}; {m.get('records', '?')} "
                  "records. Generated by `kvbench leaderboard` from the result store.", ""]
    lines += [
        f"Accuracy deltas are strategy − `{BASELINE}` in percentage points on identical samples, with paired "
        "bootstrap 95% CIs; memory reduction is 1 − KV bytes held / dense 16-bit bytes (measurement spec v1). "
        f"*Within 1 point* means delta > −{LOSS_PP:g} pp; *within 1% relative* means "
        f"(baseline − strategy) / baseline < {LOSS_RELATIVE:g}.",
        "",
    ]
    if not check.scopes:
        return "\n".join(lines + ["No strategy records to check.", ""])

    lines += ["## Largest memory reduction within the accuracy bound", "",
              "| scope | within 1 point | reduction | Δ accuracy | within 1% relative | reduction | Δ accuracy |",
              "|---|---|---:|---|---|---:|---|"]
    for s in check.scopes:
        cells = _cells(check.best_pp[s]) + _cells(check.best_relative[s], not check.relative_defined[s])
        lines.append(f"| {_scope_name(s)} | " + " | ".join(cells) + " |")

    lines += ["", "## \"40–60% less KV memory at <1% accuracy loss\"", "",
              f"Holds on a scope when a strategy saving ≥ {pct(CLAIM_LOW)} stays within 1 point; *with "
              "confidence* when its CI lower bound is above −1 point too.", "",
              "| scope | holds (point estimate) | CI lower bound > −1 pp | <1% relative loss | strategy |",
              "|---|---|---|---|---|"]
    for s in check.scopes:
        h = check.headline[s]
        if not h.testable:
            lines.append(f"| {_scope_name(s)} | not testable | – | – | – |")
            continue
        rel = "undefined" if h.holds_relative is None else _yes(h.holds_relative)
        lines.append(f"| {_scope_name(s)} | {_yes(h.holds)} | {_yes(h.holds_ci)} | {rel} | "
                     f"{h.pick.cite() if h.pick else '–'} |")
    lines.append("")
    for s in check.scopes:
        lines.append(f"- **{_scope_name(s)}**: {check.headline[s].sentence}")

    lines += ["", "## Scenarios", "",
              "| scenario | task | winning family (largest reduction within 1 point) | strategy | claim | holds |",
              "|---|---|---|---|---|---|"]
    for r in check.scenarios:
        sc = r.scenario
        if not r.measured:
            lines.append(f"| {sc.title} | `{sc.task}` | not measured | – | {sc.claim} | – |")
            continue
        if r.winner is not None:
            win, strat = r.winner.family, r.winner.cite()
        else:
            win = "none within 1 point"
            strat = f"closest: {r.closest.cite()}" if r.closest else "–"
        holds = "not testable" if r.holds is None else _yes(r.holds)
        lines.append(f"| {sc.title} | `{sc.task}` | {win} | {strat} | {sc.claim} | {holds} |")
    lines.append("")
    for r in check.scenarios:
        sc = r.scenario
        lines.append(f"### {sc.title} (`{sc.task}`)")
        lines.append("")
        lines.append(f"Claim: {sc.title} {sc.claim}. {r.evidence}")
        if r.families:
            lines += ["", "| family | strategy | reduction | Δ accuracy | within 1 point |", "|---|---|---:|---|---|"]
            for fam, p, ok in r.families:
                lines.append(f"| {fam} | `{p.strategy}` | {pct(p.memory_reduction)} | {ci_text(p)} | {_yes(ok)} |")
        lines.append("")
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
