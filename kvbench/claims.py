"""The claim check: what the measured numbers say about the source document's claims.

Written by ``kvbench leaderboard`` to ``claim_check.md``. Every sentence is generated from a summary
frame (:func:`kvbench.report.summarize` rows per task and setting) and, when given, the paired records
behind it; nothing here states a conclusion that the numbers did not produce. Claims are checked per
setting (query-aware and query-agnostic), separately, whenever both were measured.

Every claim gets one of three verdicts by measurement spec v1.2 (``docs/measurement-spec.md`` §2.2-2.4),
each naming its endpoint (task accuracy), interval and n_questions / n_contexts / n_documents. With the
paired records every interval is paired and clustered by document (:mod:`kvbench.paired`); without them
the summary rows' unclustered intervals stand in (said so in the text).

* **holds** — the claim's test rejects its null after Holm within the claim's family ("with confidence"
  is only ever said of this);
* **fails** — the opposite test does;
* **undetermined at this n** — neither; the check then gives the questions that would decide it
  (:func:`kvbench.stats.questions_needed`: Connor's paired formula at the observed discordance, the
  zero-flip floor, the design effect).

Definitions:

* **within 1 point** / **within 1% relative**: point-estimate readings (``delta_pp > −1``,
  ``relative_loss < 0.01``), reported next to the verdicts, never verdicts themselves.
* **"40–60% less KV memory at <1% accuracy loss"** on a scope (a task, or ``all@<tokens>``: the tasks
  measured at one context length, pooled): non-inferiority at a 1-point margin of every strategy saving
  40–60% (Holm over them); holds when some member holds, fails when every member fails.
* **A beats B** (scenarios): spec v1.2's comparator rule — every A member against every B member within
  :data:`MATCH_TOLERANCE` of its memory reduction (so against B's best, whichever it is), Holm over the
  pairs; holds when some A member beats all its matched B members and no B member beats A, fails the
  other way round. A direction is called when the Holm-adjusted p (never below the exact McNemar p) is
  under 0.05. Without records, two non-overlapping per-strategy intervals decide (conservative). The
  dominance counts (as much memory saved at as good a delta) are the point-estimate reading.
* **A is better by m points**: per pair, holds when A is better with confidence and the interval reaches
  m; fails when the interval lies below m.
* **drops tokens**: a strategy whose measured ``kept_fraction`` (tokens held / context tokens) is below
  1; strategies that keep every token position (quantization, tiering, recomputation) have 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from kvbench import stats
from kvbench.paired import (
    ALPHA,
    FAILS,
    HOLDS,
    PRIMARY,
    UNDETERMINED,
    Comparison,
    NonInferiority,
    compare,
    identical_scores,
    noninferiority,
    secondary,
)
from kvbench.report import BASELINE, QUERY_AGNOSTIC, QUERY_AWARE, settings
from kvbench.stats import CI_LEVEL, POWER
from strategies import attention_guided

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
#: "Early" facts sit in the first third of the text, "end-of-text" facts in the last third.
EARLY_DEPTH, LATE_DEPTH = 1 / 3, 2 / 3
#: English text runs at about 1.3 model tokens per word (BPE vocabularies of ~50K entries).
TOKENS_PER_WORD = 1.3
#: The embedded model's context window (SmolLM2-135M's max_position_embeddings).
EMBEDDED_CONTEXT = 8192
#: Baseline accuracy assumed for sample sizes when none was measured: 0.5 maximises the variance.
UNKNOWN_RATE = 0.5

NOT_TESTABLE = "not testable"
#: Two strategies are at matched memory when their memory reductions differ by at most this (5 points):
#: the eviction ratios and quantizer widths of the registry land within it of each other (int8 48.4%, fp8
#: and the 0.5-ratio evictions 50.0%), and a larger gap would compare different budgets.
MATCH_TOLERANCE = 0.05
SETTING_TEXT = {
    QUERY_AWARE: "the question is part of the compressed prefix (kvbench's default, `task.query_aware=true`)",
    QUERY_AGNOSTIC: "the context is compressed before the question is asked (the field's standard setting, "
                    "kvpress's; `task.query_aware=false`)",
}


@dataclass(frozen=True)
class Scenario:
    """One of the source document's scenario claims and how the numbers test it."""

    task: str
    title: str
    claim: str
    test: str  # positions | quant_vs_evict | dropping_hurts | attention_vs_compression | recompute_best_early
    #            | quant_step_late | forgets_words
    size_pp: float = float("nan")  # the claimed size, for claims that state one
    words: int = 0  # forgets_words: the text length of the claim, in words


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("legal", "legal analysis",
             "needs positional fidelity (anchoring the exact clause): strategies that keep every token "
             "position should beat strategies that drop tokens", "positions"),
    Scenario("papers", "paper reading",
             "needs exact figures: quantization should beat eviction", "quant_vs_evict"),
    Scenario("fiction", "long fiction",
             "needs recall of early character settings: eviction that drops tokens should hurt "
             f"(lose at least {LOSS_PP:g} point)", "dropping_hurts"),
    Scenario("legal", "legal analysis, attention-guided",
             "\"23% more local context integrity\" for attention-guided management than for pure compression "
             "(read as: attention-guided eviction scores at least 23 points more than quantization at the "
             "closest memory level)", "attention_vs_compression", size_pp=23.0),
    Scenario("fiction", "long fiction, early settings",
             "quantize-and-recompute is the best strategy for early character settings (facts in the first "
             "third of the text)", "recompute_best_early"),
    Scenario("fiction", "long fiction, quantization step",
             "\"a small change of quantization step cuts end-of-text coreference accuracy by 0.8%\" (read "
             "as: of the two quantizers closest in memory, the coarser scores 0.8 points less on facts in "
             "the last third of the text)", "quant_step_late", size_pp=0.8),
    Scenario("fiction", "long fiction, length",
             "the model \"forgets after ~10K words\"", "forgets_words", words=10_000),
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
    setting: str = QUERY_AWARE
    baseline_accuracy: float = float("nan")
    n_only_strategy: float = float("nan")
    n_only_baseline: float = float("nan")
    mcnemar_p: float = float("nan")

    @classmethod
    def from_row(cls, row: Mapping) -> Pick:
        def num(key: str) -> float:
            v = row.get(key, float("nan"))
            return float("nan") if v is None or isinstance(v, str) else float(v)

        base = num("baseline_accuracy")
        if math.isnan(base) and not math.isnan(num("accuracy")) and not math.isnan(num("delta_pp")):
            base = num("accuracy") - num("delta_pp") / 100
        return cls(strategy=str(row["strategy"]), family=str(row.get("family", "")),
                   memory_reduction=num("memory_reduction"), delta_pp=num("delta_pp"),
                   ci_low=num("delta_ci_low"), ci_high=num("delta_ci_high"),
                   relative_loss=num("relative_loss"), kept_fraction=num("kept_fraction"),
                   n=int(row.get("n", 0) or 0), setting=str(row.get("setting", QUERY_AWARE) or QUERY_AWARE),
                   baseline_accuracy=base, n_only_strategy=num("n_only_strategy"),
                   n_only_baseline=num("n_only_baseline"), mcnemar_p=num("mcnemar_p"))

    @property
    def name(self) -> str:
        """The registry name: the label without its parameters."""
        return self.strategy.split("(", 1)[0]

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
        """```int8(...)` (quantization): 48.4% less KV memory, −0.5 pp [95% CI −1.5, +0.5]`` plus, for binary
        scores, the discordant pairs and the exact McNemar p."""
        text = f"`{self.strategy}` ({self.family}): {pct(self.memory_reduction)} less KV memory, {ci_text(self)}"
        if not math.isnan(self.mcnemar_p):
            text += (f" ({int(self.n_only_strategy)} only-strategy / {int(self.n_only_baseline)} only-baseline "
                     f"correct of {self.n}, McNemar p = {self.mcnemar_p:.2g})")
        return text

    @property
    def rate(self) -> float:
        """The baseline accuracy that sample sizes are computed at."""
        return UNKNOWN_RATE if math.isnan(self.baseline_accuracy) else self.baseline_accuracy


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


def setting_list(summary: pd.DataFrame) -> list[str]:
    """The settings a summary holds, query-aware first (a summary without the column is query-aware)."""
    if summary.empty or "setting" not in summary:
        return [QUERY_AWARE]
    found = {str(s) for s in summary["setting"].dropna()}
    return [s for s in (QUERY_AWARE, QUERY_AGNOSTIC) if s in found] + sorted(found - {QUERY_AWARE, QUERY_AGNOSTIC})


def _in_setting(frame: pd.DataFrame, setting: str | None) -> pd.DataFrame:
    if setting is None or "setting" not in frame:
        return frame
    return frame[frame["setting"] == setting]


def picks(summary: pd.DataFrame, scope: str, setting: str | None = None) -> list[Pick]:
    """Every non-baseline, non-offloading strategy measured on ``scope`` (a task or ``all``) in ``setting``
    (``None``: any), sorted by label."""
    if summary.empty:
        return []
    rows = _in_setting(summary, setting)
    rows = rows[(rows["task"] == scope) & (rows["strategy"] != BASELINE)]
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


def ties_of(pick: Pick | None, cands: list[Pick]) -> list[str]:
    """The other candidates with exactly ``pick``'s figures (memory saved, delta and its interval): a label
    order chose among them, so they are shown as tied rather than ranked by name."""
    if pick is None:
        return []
    key = (round(pick.memory_reduction, 9), pick.delta_pp, pick.ci_low, pick.ci_high)
    return sorted(p.strategy for p in cands if p.strategy != pick.strategy
                  and (round(p.memory_reduction, 9), p.delta_pp, p.ci_low, p.ci_high) == key)


def _best_delta(cands: list[Pick]) -> Pick:
    return sorted(cands, key=lambda p: (-_nan_low(p.delta_pp), -_nan_low(p.memory_reduction), p.strategy))[0]


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def best_within_pp(summary: pd.DataFrame, scope: str, loss: float = LOSS_PP,
                   setting: str | None = None) -> Pick | None:
    """Largest memory reduction on ``scope`` whose accuracy delta stays above ``-loss`` points."""
    return _largest_reduction([p for p in picks(summary, scope, setting) if p.within_pp(loss)])


def best_within_relative(summary: pd.DataFrame, scope: str, loss: float = LOSS_RELATIVE,
                         setting: str | None = None) -> Pick | None:
    """Largest memory reduction on ``scope`` whose relative accuracy loss stays under ``loss``."""
    return _largest_reduction([p for p in picks(summary, scope, setting) if p.within_relative(loss)])


# ------------------------------------------------------------------------------------- sample sizes


def samples_sentence(needed: int, c: Comparison | None, what: str) -> str:
    """``about 1,534 questions (… documents' design effect …) would decide <what>`` — spec v1.2 §2.4's
    paired count at the comparison's observed discordance and design effect."""
    if not needed:
        return f"no number of questions decides {what} at the observed difference"
    basis = ""
    if c is not None and c.binary:
        basis = (f" at the observed discordance ({c.only_a + c.only_b} of {c.n_questions} questions"
                 + (", taken at its 95% upper bound since none was seen" if c.only_a + c.only_b == 0 else "")
                 + f") and design effect {c.deff:.2f} ({c.deff_source})")
    return (f"about {needed:,} questions{basis} would decide {what} (one-sided {ALPHA:g} level, "
            f"{POWER:.0%} power, Connor's paired formula; measurement spec §2.4)")


# ------------------------------------------------------------------------------------ headline claim


@dataclass(frozen=True)
class HeadlineVerdict:
    """"40–60% less KV memory at <1% accuracy loss" on one scope: a non-inferiority verdict per strategy of
    the family (spec v1.2 §2.3), and the claim's verdict from them."""

    scope: str
    testable: bool  # some strategy reaches the 40% reduction
    holds: bool  # point estimate within 1 point (the point-estimate reading)
    holds_ci: bool  # the verdict is HOLDS
    holds_relative: bool | None  # None: relative loss undefined (baseline accuracy 0)
    pick: Pick | None  # the member that best supports the claim (or comes closest)
    in_band: bool  # the family is the 40–60% band (False: nothing in the band, strategies saving more)
    sentence: str
    verdict: str = NOT_TESTABLE
    n_needed: int = 0  # UNDETERMINED: questions that would decide the cheapest member
    setting: str = QUERY_AWARE
    members: tuple[NonInferiority, ...] = ()  # one per strategy of the family, Holm-adjusted within it
    ties: tuple[tuple[str, ...], ...] = ()  # members with identical score vectors
    member_picks: tuple[Pick, ...] = ()  # the picks behind ``members``, in the same order


def scope_records(records: pd.DataFrame | None, scope: str, setting: str | None) -> pd.DataFrame | None:
    """The records of a scope: one task, or a pooled ``all@<tokens>`` scope (every task measured at that
    context length — spec v1.2 never pools across context lengths)."""
    if records is None or records.empty:
        return None
    df = records if setting is None else records[settings(records) == setting]
    if scope.startswith(f"{OVERALL}@"):
        return df[df["context_tokens"].astype(float) == float(scope.split("@", 1)[1])]
    return df[df["task"] == scope]


def pooled_scopes(records: pd.DataFrame | None, setting: str | None) -> list[str]:
    """``all@<tokens>`` for every context length at which two tasks or more were measured."""
    if records is None or records.empty or "context_tokens" not in records:
        return []
    df = records if setting is None else records[settings(records) == setting]
    per_length = df.groupby(df["context_tokens"].astype(int))["task"].nunique()
    return [f"{OVERALL}@{int(t)}" for t, k in per_length.items() if k >= 2]


def scope_picks(summary: pd.DataFrame, records: pd.DataFrame | None, scope: str,
                setting: str | None) -> list[Pick]:
    """:func:`picks` for a task; for a pooled ``all@<tokens>`` scope, picks built from its records (memory
    and kept fraction averaged over them, the accuracy delta from the clustered comparison)."""
    if not scope.startswith(f"{OVERALL}@"):
        return picks(summary, scope, setting)
    df = scope_records(records, scope, setting)
    if df is None or df.empty:
        return []
    out = []
    for strategy, grp in df.groupby("strategy", sort=True):
        family = str(grp["family"].iloc[0]) if "family" in grp else ""
        if strategy == BASELINE or family in OFFLOADING_FAMILIES:
            continue
        c = compare(df, str(strategy), BASELINE)
        if c is None:
            continue
        kept = float(grp["kept_fraction"].mean()) if "kept_fraction" in grp else float("nan")
        rel = (c.b_mean - c.a_mean) / c.b_mean if c.b_mean else float("nan")
        out.append(Pick(str(strategy), family, float(grp["memory_reduction"].mean()), c.estimate, c.low, c.high,
                        rel, kept, c.n_questions, setting or QUERY_AWARE, c.b_mean, c.only_a, c.only_b,
                        c.p_two_sided()))
    return out


def _comparison(p: Pick, recs: pd.DataFrame | None) -> Comparison | None:
    """``p`` − full: clustered from the records when there are any; else from the summary row — the paired
    table rebuilt from its counts (binary scores; unclustered, design effect 1), or its interval as it is."""
    if recs is not None:
        return compare(recs, p.strategy, BASELINE)
    counts = _summary_counts(p)
    if counts is not None:
        test = stats.PairedBinary(counts, stats.DesignEffect(1.0, "none: no records, unclustered"))
        lo, hi = test.interval()
        return Comparison(p.strategy, BASELINE, PRIMARY, 100 * test.estimate, 100 * lo, 100 * hi,
                          test.method + " (unclustered)", p.n, -1, -1, 1.0, test.deff.source,
                          (counts.both + counts.only_a) / counts.n, (counts.both + counts.only_b) / counts.n,
                          counts.only_a, counts.only_b, test=test)
    return Comparison(p.strategy, BASELINE, PRIMARY, p.delta_pp, p.ci_low, p.ci_high,
                      "summary row (iid: no records, unclustered)", p.n, -1, -1,
                      a_mean=p.baseline_accuracy + p.delta_pp / 100, b_mean=p.baseline_accuracy)


def _summary_counts(p: Pick) -> stats.PairedCounts | None:
    """The paired 2x2 table behind a binary summary row (n, baseline accuracy and the discordant counts)."""
    if any(math.isnan(v) for v in (p.n_only_strategy, p.n_only_baseline, p.baseline_accuracy)) or p.n <= 0 \
            or math.isnan(p.mcnemar_p):
        return None
    only_a, only_b = int(p.n_only_strategy), int(p.n_only_baseline)
    both = round(p.baseline_accuracy * p.n) - only_b
    neither = p.n - both - only_a - only_b
    if both < 0 or neither < 0:
        return None
    return stats.PairedCounts(both, only_a, only_b, neither)


def headline(summary: pd.DataFrame, scope: str, setting: str | None = None,
             records: pd.DataFrame | None = None) -> HeadlineVerdict:
    """The headline on one scope (a task, ``all`` or ``all@<tokens>``) in one setting, as non-inferiority.

    Family: every strategy saving 40–60% (the claim's band); when none does but some save more, those
    saving at least 40% (``in_band`` False). Each member: task accuracy − full ≥ −1 point, Holm-adjusted
    within the family. The claim **holds** when some member holds, **fails** when every member fails.
    """
    setting = setting or setting_list(summary)[0]
    recs = scope_records(records, scope, setting)
    cands = [p for p in scope_picks(summary, records, scope, setting) if not math.isnan(p.memory_reduction)]
    reach = [p for p in cands if p.memory_reduction >= CLAIM_LOW]
    if not reach:
        best = _largest_reduction(cands)
        most = f"; the most any strategy saves is {pct(best.memory_reduction)}" if best else ""
        return HeadlineVerdict(scope, False, False, False, None, None, False,
                               f"not testable: no strategy reaches {pct(CLAIM_LOW)} memory reduction{most}",
                               setting=setting)
    band = [p for p in reach if p.memory_reduction <= CLAIM_HIGH]
    family = band or reach
    pairs = [(p, c) for p in family if (c := _comparison(p, recs)) is not None]
    verdicts = noninferiority([c for _, c in pairs], LOSS_PP)
    by_name = {p.strategy: (p, v) for (p, _), v in zip(pairs, verdicts, strict=True)}
    holding = [p for p, v in by_name.values() if v.verdict == HOLDS]
    undecided = [(p, v) for p, v in by_name.values() if v.verdict == UNDETERMINED]
    point = [p for p in family if p.within_pp()]
    if holding:
        verdict = HOLDS
    elif by_name and all(v.verdict == FAILS for _, v in by_name.values()):
        verdict = FAILS
    else:
        verdict = UNDETERMINED
    pick = _largest_reduction(holding) or _largest_reduction(point) or _best_delta(family)
    # The claim holds once one member holds: the cheapest member that still can (point estimate above the
    # margin) sets the n; if none can, it fails once every member fails: the most demanding one sets it.
    can_hold = [(p, v) for p, v in undecided if v.comparison.estimate > -LOSS_PP]
    needs = sorted((n, p.strategy) for p, v in (can_hold or undecided)
                   if (n := v.comparison.questions_needed(LOSS_PP)))
    if not can_hold:
        needs = needs[::-1]
    needed = needs[0][0] if verdict == UNDETERMINED and needs else 0
    ties = tuple(tuple(g) for g in identical_scores(recs, [p.strategy for p in family])) if recs is not None else ()
    defined = [p for p in family if not math.isnan(p.relative_loss)]
    holds_rel = any(p.within_relative() for p in defined) if defined else None
    where = (f"the {pct(CLAIM_LOW)}–{pct(CLAIM_HIGH)} band" if band else
             f"no strategy in the {pct(CLAIM_LOW)}–{pct(CLAIM_HIGH)} band itself; the family is the "
             f"{len(family)} saving more")
    named = ", ".join(f"`{p.strategy}` {v.verdict}" for p, v in by_name.values())
    if verdict == HOLDS:
        text = (f"**holds**, and with confidence: {by_name[pick.strategy][1].text()} — non-inferior at "
                f"−{LOSS_PP:g} point")
    elif verdict == FAILS:
        text = (f"**fails** — the claim does not hold: every strategy of {where} loses more than {LOSS_PP:g} "
                f"point with confidence ({named})")
    else:
        v = by_name[pick.strategy][1] if pick.strategy in by_name else None
        text = (f"**undetermined at this n**: no strategy of {where} is non-inferior with confidence ({named})"
                + (f"; the closest, {v.text()}" if v else "")
                + (f"; for `{needs[0][1]}`, {samples_sentence(needed, by_name[needs[0][1]][1].comparison, 'it')}"
                   if needed else ""))
    extras = []
    if not band:
        extras.append(f"no strategy inside the {pct(CLAIM_LOW)}–{pct(CLAIM_HIGH)} band itself was measured "
                      "(the family saves more)")
    if ties:
        extras.append("identical score vectors (tied, whatever their names): "
                      + "; ".join(" = ".join(f"`{s}`" for s in g) for g in ties))
    if holds_rel is None:
        extras.append("the relative reading is undefined (the baseline scores 0)")
    else:
        extras.append(f"read as <{100 * LOSS_RELATIVE:g}% *relative* loss, the point estimate "
                      f"{'is' if holds_rel else 'is not'} within it (reported, not a verdict)")
    sentence = text + ("; " + "; ".join(extras) if extras else "") + "."
    return HeadlineVerdict(scope, True, bool(point), verdict == HOLDS, holds_rel, pick, bool(band), sentence,
                           verdict, needed, setting, tuple(by_name[p.strategy][1] for p in family
                                                           if p.strategy in by_name),
                           ties, tuple(p for p in family if p.strategy in by_name))


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
        return (f"{len(self.b_dominated)} of {len(self.b)} {self.b_name} strategies are dominated by "
                f"{_article(self.a_name)} {self.a_name} strategy (as much memory saved or more, at as good an "
                f"accuracy delta or better), and {len(self.a_dominated)} of {len(self.a)} {self.a_name} "
                f"strategies by {_article(self.b_name)} {self.b_name} one")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def compare_groups(a_name: str, a: list[Pick], b_name: str, b: list[Pick]) -> GroupComparison:
    return GroupComparison(
        a_name, b_name, a, b,
        b_dominated=[q.strategy for q in b if any(dominates(p, q) for p in a)],
        a_dominated=[p.strategy for p in a if any(dominates(q, p) for q in b)],
    )


def matched_pairs(a: list[Pick], b: list[Pick], tolerance: float = MATCH_TOLERANCE) -> list[tuple[Pick, Pick]]:
    """Every (A, B) pair whose memory reductions differ by at most ``tolerance``, in label order (for
    listing only: spec v1.2's comparator rule tests them all and never picks one by name)."""
    pairs = [(p, q) for p in a for q in b if not math.isnan(p.memory_reduction)
             and not math.isnan(q.memory_reduction) and abs(p.memory_reduction - q.memory_reduction) <= tolerance]
    return sorted(pairs, key=lambda t: (t[0].strategy, t[1].strategy))


def matched_pair(a: list[Pick], b: list[Pick]) -> tuple[Pick, Pick] | None:
    """The (A, B) pair closest in memory reduction; ties go to the larger reduction, then the labels.
    Kept for the point-estimate readings only; no verdict rests on it (see :func:`matched_pairs`)."""
    pairs = [(abs(p.memory_reduction - q.memory_reduction), -max(p.memory_reduction, q.memory_reduction),
              p.strategy, q.strategy, p, q) for p in a for q in b
             if not math.isnan(p.memory_reduction) and not math.isnan(q.memory_reduction)]
    if not pairs:
        return None
    best = sorted(pairs, key=lambda t: t[:4])[0]
    return best[4], best[5]


@dataclass(frozen=True)
class Contrast:
    """Strategy A minus strategy B on one task and setting, in points, with a 95% interval."""

    a: Pick
    b: Pick
    diff_pp: float
    low: float  # nan when only the two per-strategy intervals were available
    high: float
    n: int
    b_rate: float  # B's accuracy on the compared samples (sample sizes are computed at it)
    paired: bool  # from the paired records (True) or from two summary rows (False)
    detail: str = ""
    mcnemar_p: float = float("nan")  # binary scores: exact McNemar p of A vs B (effective counts)
    comparison: Comparison | None = None  # the clustered comparison behind it (paired only)
    p_adj: float = float("nan")  # Holm-adjusted two-sided p within the claim's family

    @property
    def p(self) -> float:
        """The two-sided p a direction is called on: Holm-adjusted when the contrast is one of a family."""
        if not math.isnan(self.p_adj):
            return self.p_adj
        return self.comparison.p_two_sided() if self.comparison is not None else float("nan")

    @property
    def a_better(self) -> bool:
        # The p is the larger of the interval's and the exact McNemar test's (they disagree at a handful of
        # discordant pairs: 4 of 4 one way, the interval excludes 0, exact p = 0.125).
        if self.paired:
            return self.diff_pp > 0 and self.p < 1 - CI_LEVEL
        return self.a.ci_low > self.b.ci_high

    @property
    def b_better(self) -> bool:
        if self.paired:
            return self.diff_pp < 0 and self.p < 1 - CI_LEVEL
        return self.b.ci_low > self.a.ci_high

    def questions_needed(self, effect_pp: float = 0.0) -> int:
        """Questions that would decide A − B against ``effect_pp`` (0: the direction) at the observed
        discordance and design effect; 0 without paired records."""
        return self.comparison.questions_needed(-effect_pp) if self.comparison is not None else 0

    def text(self) -> str:
        if self.paired:
            adj = f", Holm-adjusted p = {self.p_adj:.2g}" if not math.isnan(self.p_adj) else ""
            return f"{self.comparison.text()}{adj}"
        return (f"`{self.a.strategy}` − `{self.b.strategy}` = {pp(self.diff_pp)} pp from the two deltas "
                f"({ci_text(self.a)} versus {ci_text(self.b)}; without the paired records only "
                "non-overlapping intervals decide)")


def _with_holm(contrasts: list[Contrast]) -> list[Contrast]:
    """The family's contrasts with Holm-adjusted p-values (spec v1.2 §2.3: the family of a scenario claim is
    every pair it lists); unpaired contrasts have no p and are returned as they are."""
    paired = [c for c in contrasts if c.paired]
    adj = iter(stats.holm([c.comparison.p_two_sided() for c in paired]))
    return [replace(c, p_adj=next(adj)) if c.paired else c for c in contrasts]


def _depth_mask(records: pd.DataFrame, depth: tuple[float, float] | None) -> pd.Series:
    if depth is None:
        return pd.Series(True, index=records.index)
    d = records["sample_meta"].map(sample_depth) if "sample_meta" in records else pd.Series(np.nan, records.index)
    return (d >= depth[0]) & (d <= depth[1])


def contrast(a: Pick, b: Pick, task: str, records: pd.DataFrame | None = None,
             depth: tuple[float, float] | None = None, seed: int = 0) -> Contrast | None:
    """A − B: paired and clustered on identical samples from ``records`` when given (restricted to facts at
    relative ``depth`` (low, high) when given), else from the two summary rows. ``None`` when the records
    hold no common samples."""
    if records is None or records.empty:
        if depth is not None:
            return None
        return Contrast(a, b, a.delta_pp - b.delta_pp, float("nan"), float("nan"), min(a.n, b.n),
                        a.baseline_accuracy if not math.isnan(a.baseline_accuracy) else UNKNOWN_RATE, False)
    df = records[(records["task"] == task) & (settings(records) == a.setting)]
    c = compare(df[_depth_mask(df, depth)], a.strategy, b.strategy, seed=seed)
    if c is None:
        return None
    mcnemar = float("nan")
    if c.binary:
        f = 1.0 / c.deff
        mcnemar = stats.mcnemar_exact_p(round(c.only_a * f), round(c.only_b * f))
    return Contrast(a, b, c.estimate, c.low, c.high, c.n_questions, c.b_mean, True, "", mcnemar, c)


@dataclass
class ScenarioResult:
    scenario: Scenario
    measured: bool
    winner: Pick | None = None  # largest reduction within 1 point on the task
    closest: Pick | None = None  # best delta when nothing stays within 1 point
    families: list[tuple[str, Pick, bool]] = field(default_factory=list)  # family, its pick, within 1 point
    holds: bool | None = None  # the point-estimate reading; None: not testable with what was measured
    evidence: str = ""
    verdict: str = NOT_TESTABLE
    n_needed: int = 0  # UNDETERMINED: samples per task that would decide it
    setting: str = QUERY_AWARE
    winner_ties: list[str] = field(default_factory=list)  # strategies with the winner's exact figures


def family_picks(task_picks: list[Pick]) -> list[tuple[str, Pick, bool]]:
    """Per family: its largest reduction within 1 point, or (if none qualifies) its best delta."""
    out = []
    for fam in sorted({p.family for p in task_picks}):
        members = [p for p in task_picks if p.family == fam]
        within = _largest_reduction([p for p in members if p.within_pp()])
        if within is not None:
            out.append((fam, within, True))
        else:
            out.append((fam, _best_delta(members), False))
    return out


def _decide_groups(res: ScenarioResult, contrasts: list[Contrast], a_name: str, b_name: str) -> None:
    """Verdict of "family A beats family B" by spec v1.2's comparator rule: every A member is tested against
    *every* B member at matched memory (so against B's best, whichever it is — no tie is broken by name),
    Holm-adjusted over all the pairs. An A member beats B when it beats each of its matched B members with
    confidence; a B member beats A likewise. Holds when some A member beats B and no B member beats A;
    fails the other way round; undetermined otherwise."""
    contrasts = _with_holm(contrasts)
    a_names = sorted({c.a.strategy for c in contrasts})
    b_names = sorted({c.b.strategy for c in contrasts})
    a_win = [a for a in a_names if all(c.a_better for c in contrasts if c.a.strategy == a)]
    b_win = [b for b in b_names if all(c.b_better for c in contrasts if c.b.strategy == b)]
    lines = "; ".join(c.text() for c in contrasts)
    res.evidence += (f" Every pair within {100 * MATCH_TOLERANCE:g} points of memory reduction "
                     f"({len(contrasts)}, Holm over them): {lines}.")
    if a_win and not b_win:
        res.verdict = HOLDS
        res.evidence += (f" {', '.join(f'`{a}`' for a in a_win)} beats every {b_name} strategy at its memory "
                         "level with confidence.")
    elif b_win and not a_win:
        res.verdict = FAILS
        res.evidence += (f" {', '.join(f'`{b}`' for b in b_win)} beats every {a_name} strategy at its memory "
                         "level with confidence.")
    else:
        res.verdict = UNDETERMINED
        # The A member closest to winning is held back by its hardest comparator (B's best for it).
        hardest = [max((c for c in contrasts if c.a.strategy == a), key=lambda c: (c.p, c.b.strategy))
                   for a in a_names]
        needs = sorted((c.questions_needed(), c.a.strategy) for c in hardest if c.questions_needed())
        if needs:
            res.n_needed = needs[0][0]
            c = next(c for c in hardest if c.a.strategy == needs[0][1])
            res.evidence += (f" No member of either family beats the other's best at matched memory with confidence; "
                             f"for `{c.a.strategy}` against its hardest comparator `{c.b.strategy}`, "
                             + samples_sentence(res.n_needed, c.comparison, "the direction") + " (before Holm).")
        else:
            res.evidence += " No member of either family beats the other's best at matched memory with confidence."


def _size_verdict(c: Contrast, size: float) -> str:
    """"A is better than B by ``size`` points" on one pair: holds when A is better with confidence and the
    interval reaches ``size``; fails when the whole interval is below ``size``."""
    hi = c.high if c.paired else c.a.ci_high - c.b.ci_low  # without records: a conservative upper bound
    if c.a_better and hi >= size:
        return HOLDS
    if hi < size:
        return FAILS
    return UNDETERMINED


def _decide_size(res: ScenarioResult, c: Contrast, size: float, what: str) -> None:
    """Verdict of "A is better than B by ``size`` points" on one pair."""
    res.verdict = _size_verdict(c, size)
    if res.verdict == HOLDS:
        outcome = f"the interval is above 0 and reaches {size:g} points: consistent with {what}"
    elif res.verdict == FAILS:
        outcome = f"the whole interval is below {size:g} points: {what} is ruled out"
    else:
        res.n_needed = c.questions_needed(size)
        outcome = (f"the gain is not established with confidence, yet the interval reaches {size:g} points; "
                   + samples_sentence(res.n_needed, c.comparison, f"a difference of {size:g} points"))
    res.evidence += f" {c.text()}: {outcome}."



def scenario(summary: pd.DataFrame, sc: Scenario, records: pd.DataFrame | None = None,
             setting: str | None = None) -> ScenarioResult:
    """Which family wins on the scenario's task, and the verdict on the scenario's claim there.

    ``records`` (optional, paired records) give paired intervals between two strategies, and the depth
    of each sample's fact for the claims about early or end-of-text facts.
    """
    setting = setting or setting_list(summary)[0]
    task_picks = picks(summary, sc.task, setting)
    if not task_picks:
        return ScenarioResult(sc, False, evidence=f"not measured: no strategy records for task `{sc.task}`.",
                              setting=setting)
    res = ScenarioResult(sc, True, winner=best_within_pp(summary, sc.task, setting=setting),
                         families=family_picks(task_picks), setting=setting)
    if res.winner is None:
        res.closest = _best_delta(task_picks)
    res.winner_ties = ties_of(res.winner or res.closest, task_picks)
    test = _TESTS[sc.test]
    test(res, summary, task_picks, records)
    return res


def _group_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                records: pd.DataFrame | None) -> None:
    sc = res.scenario
    if sc.test == "positions":
        a_name, b_name = "position-keeping", "token-dropping"
        a = [p for p in task_picks if not p.drops_tokens]
        b = [p for p in task_picks if p.drops_tokens]
    else:
        a_name, b_name = "quantization", "eviction"
        a = [p for p in task_picks if p.family == "quantization"]
        b = [p for p in task_picks if p.family == "eviction"]
    if not a or not b:
        res.evidence = f"not testable on `{sc.task}`: no {a_name if not a else b_name} strategy was measured."
        return
    cmp = compare_groups(a_name, a, b_name, b)
    res.holds = cmp.a_wins
    outcome = (f"{a_name} beats {b_name}" if cmp.a_wins else
               f"{b_name} beats {a_name}" if cmp.b_wins else "neither group dominates the other")
    res.evidence = f"On `{sc.task}`, {cmp.sentence()}: on the point estimates {outcome}."
    contrasts = [c for c in (contrast(p, q, sc.task, records) for p, q in matched_pairs(a, b)) if c is not None]
    if not contrasts:
        res.evidence += (f" No {a_name} and {b_name} strategies lie within {100 * MATCH_TOLERANCE:g} points of "
                         "memory reduction of each other, so no verdict at matched memory.")
        return
    _decide_groups(res, contrasts, a_name, b_name)


def _dropping_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                   records: pd.DataFrame | None) -> None:
    """Eviction should hurt: the non-inferiority test of each token-dropping strategy at −1 point, Holm over
    them — holds when every one *fails* it (loses more than 1 point with confidence); fails when some
    one holds it (stays within 1 point with confidence)."""
    sc = res.scenario
    drop = [p for p in task_picks if p.drops_tokens and not math.isnan(p.delta_pp)]
    if not drop:
        res.evidence = f"not testable on `{sc.task}`: no token-dropping strategy was measured."
        return
    mean = sum(p.delta_pp for p in drop) / len(drop)
    hurt = [p for p in drop if not p.within_pp()]
    res.holds = mean <= -LOSS_PP
    others = _mean_delta_elsewhere(summary, sc.task, [p.strategy for p in drop], res.setting)
    elsewhere = (f"; the same strategies average {pp(others)} pp on the other tasks"
                 if others is not None else "")
    recs = scope_records(records, sc.task, res.setting)
    comps = [(p, c) for p in drop if (c := _comparison(p, recs)) is not None]
    verdicts = noninferiority([c for _, c in comps], LOSS_PP)
    confident_hurt = [v for v in verdicts if v.verdict == FAILS]
    harmless = [v for v in verdicts if v.verdict == HOLDS]
    worst = sorted(drop, key=lambda p: (_nan_low(p.delta_pp), p.strategy))[0]
    res.evidence = (f"On `{sc.task}`, the {len(drop)} token-dropping strategies average {pp(mean)} pp "
                    f"({len(hurt)} lose at least {LOSS_PP:g} point on the point estimate, {len(confident_hurt)} "
                    f"with confidence after Holm over the {len(verdicts)}){elsewhere}; the largest loss is "
                    f"{worst.cite()}.")
    if verdicts and len(confident_hurt) == len(verdicts):
        res.verdict = HOLDS
        res.evidence += f" Every one loses more than {LOSS_PP:g} point with confidence."
    elif harmless:
        res.verdict = FAILS
        res.evidence += (f" {harmless[0].text()}: it stays within {LOSS_PP:g} point with confidence, so dropping "
                         "tokens does not always hurt.")
    else:
        res.verdict = UNDETERMINED
        open_ = [v for v in verdicts if v.verdict == UNDETERMINED]
        needs = sorted((v.comparison.questions_needed(LOSS_PP), v.comparison.a) for v in open_
                       if v.comparison.questions_needed(LOSS_PP))
        least = next((v for v in open_ if needs and v.comparison.a == needs[-1][1]), open_[0] if open_ else None)
        if least is not None:
            # Every open member must be decided for the claim to hold: the most demanding one sets the n.
            res.n_needed = needs[-1][0] if needs else 0
            res.evidence += (f" Not every one is decided; the most demanding, {least.text()}; "
                             + samples_sentence(res.n_needed, least.comparison, f"a loss of {LOSS_PP:g} point")
                             + ".")
    if records is not None:
        res.evidence += _depth_sentence(depth_deltas(records, sc.task, [p.strategy for p in drop], res.setting))


def _attention_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                    records: pd.DataFrame | None) -> None:
    """Attention-guided eviction scores ``size`` points more than quantization at matched memory: every
    matched pair (quantization's best among them decides for each eviction strategy), Holm over the pairs;
    holds when some attention-guided strategy holds against all its matched quantizers, fails when every
    one fails against one of them."""
    sc = res.scenario
    a = [p for p in task_picks if p.family == "eviction" and attention_guided(p.name)]
    b = [p for p in task_picks if p.family == "quantization"]
    if not a or not b:
        res.evidence = (f"not testable on `{sc.task}`: no "
                        f"{'attention-guided eviction' if not a else 'quantization'} strategy was measured.")
        return
    contrasts = _with_holm([c for c in (contrast(p, q, sc.task, records) for p, q in matched_pairs(a, b))
                            if c is not None])
    if not contrasts:
        res.evidence = (f"not testable on `{sc.task}`: no attention-guided eviction and quantization strategies "
                        f"within {100 * MATCH_TOLERANCE:g} points of memory reduction of each other.")
        return
    res.holds = any(all(c.diff_pp >= sc.size_pp for c in contrasts if c.a is p) for p in {c.a for c in contrasts})
    per_a: dict[str, str] = {}
    for c in contrasts:
        v = _size_verdict(c, sc.size_pp)
        prev = per_a.get(c.a.strategy, HOLDS)
        per_a[c.a.strategy] = FAILS if FAILS in (prev, v) else UNDETERMINED if UNDETERMINED in (prev, v) else HOLDS
    res.evidence = (f"On `{sc.task}`, every attention-guided eviction and quantization pair within "
                    f"{100 * MATCH_TOLERANCE:g} points of memory reduction ({len(contrasts)}, Holm over them): "
                    + "; ".join(c.text() for c in contrasts) + ".")
    if HOLDS in per_a.values():
        res.verdict = HOLDS
    elif all(v == FAILS for v in per_a.values()):
        res.verdict = FAILS
        res.evidence += f" Every attention-guided strategy is more than {sc.size_pp:g} points short with confidence."
    else:
        res.verdict = UNDETERMINED
        open_ = [c for c in contrasts if per_a[c.a.strategy] == UNDETERMINED]
        needs = sorted((c.questions_needed(sc.size_pp), c.a.strategy, c.b.strategy) for c in open_
                       if c.questions_needed(sc.size_pp))
        if needs:
            res.n_needed = needs[0][0]
            c = next(c for c in open_ if (c.a.strategy, c.b.strategy) == needs[0][1:])
            res.evidence += " " + samples_sentence(res.n_needed, c.comparison, f"a gap of {sc.size_pp:g} points") + "."


def _recompute_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                    records: pd.DataFrame | None) -> None:
    """Quantize-and-recompute is best on early facts: holds when its pick beats every other family's pick
    with confidence (Holm over them); fails when some family's pick beats it with confidence."""
    sc = res.scenario
    fams = dict((fam, p) for fam, p, _ in res.families)
    if "recompute" not in fams or len(fams) < 2:
        res.evidence = f"not testable on `{sc.task}`: needs quantize-and-recompute and at least one other family."
        return
    qr = fams.pop("recompute")
    depth = (0.0, EARLY_DEPTH)
    has_depth = records is not None and _has_depth(records, sc.task)
    contrasts = _with_holm([c for c in (contrast(qr, p, sc.task, records, depth if has_depth else None)
                                        for p in fams.values()) if c is not None])
    where = ("facts in the first third of the text" if has_depth
             else "all samples (the records carry no depth of the fact)")
    if not contrasts:
        res.evidence = f"not testable on `{sc.task}`: no sample with a fact in the first third of the text."
        return
    res.holds = all(c.diff_pp >= 0 for c in contrasts)
    res.evidence = (f"On `{sc.task}` ({where}), `{qr.strategy}` against each other family's pick: "
                    + "; ".join(c.text() for c in contrasts) + ".")
    beaten_by = [c for c in contrasts if c.b_better]
    if all(c.a_better for c in contrasts):
        res.verdict = HOLDS
        res.evidence += " Quantize-and-recompute beats every other family with confidence."
    elif beaten_by:
        res.verdict = FAILS
        res.evidence += f" `{beaten_by[0].b.strategy}` beats it with confidence."
    else:
        res.verdict = UNDETERMINED
        open_ = [c for c in contrasts if not c.a_better]
        needs = sorted((c.questions_needed(), c.b.strategy) for c in open_ if c.questions_needed())
        res.evidence += " Not every comparison is decided"
        if needs:  # every open comparison must be decided: the most demanding sets the n
            res.n_needed = needs[-1][0]
            c = next(c for c in open_ if c.b.strategy == needs[-1][1])
            res.evidence += f"; against `{c.b.strategy}`, " + samples_sentence(res.n_needed, c.comparison,
                                                                               "the direction")
        res.evidence += "."



def _quant_step_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                     records: pd.DataFrame | None) -> None:
    """Of the quantizer pairs closest in memory (a step change changes the bytes, so equal memory is no
    step), the coarser scores ``size`` points less on late facts. Every pair at the closest distance is
    tested (Holm over them) — none is chosen by name; holds when all hold, fails when all fail."""
    sc = res.scenario
    quant = [p for p in task_picks if p.family == "quantization" and not math.isnan(p.memory_reduction)]
    pairs = [(abs(p.memory_reduction - q.memory_reduction), p, q) for i, p in enumerate(quant) for q in quant[i + 1:]
             if abs(p.memory_reduction - q.memory_reduction) > 1e-9]
    if not pairs:
        res.evidence = f"not testable on `{sc.task}`: needs two quantization strategies of different memory."
        return
    closest = min(d for d, _, _ in pairs)
    steps = sorted(((p, q) if p.memory_reduction <= q.memory_reduction else (q, p)
                    for d, p, q in pairs if d <= closest + 1e-9), key=lambda t: (t[0].strategy, t[1].strategy))
    res.holds = all(fine.delta_pp - coarse.delta_pp >= sc.size_pp for fine, coarse in steps)
    late_depth = records is not None and _has_depth(records, sc.task)
    found = [c for fine, coarse in steps
             if (c := contrast(fine, coarse, sc.task, records, (LATE_DEPTH, 1.0) if late_depth else None))]
    if late_depth and not found:
        depths = sorted({round(d, 2) for d in _depths(records, sc.task)})
        wholes = [contrast(fine, coarse, sc.task, records) for fine, coarse in steps]
        res.holds = None
        res.evidence = (f"not testable on these records: the `{sc.task}` samples place the fact at depths "
                        f"{', '.join(f'{d:g}' for d in depths)} of the text, none in the last third. On all "
                        f"samples, {'; '.join(w.text() for w in wholes if w) or 'no common samples'}.")
        return
    res.evidence = (f"On `{sc.task}`, facts in the last third of the text:" if late_depth else
                    f"On `{sc.task}` (all samples: the records carry no depth of the fact):")
    if len(found) == 1:
        _decide_size(res, found[0], sc.size_pp, f"a cut of {sc.size_pp:g} points")
        return
    found = _with_holm(found)
    verdicts = [_size_verdict(c, sc.size_pp) for c in found]
    res.verdict = (HOLDS if all(v == HOLDS for v in verdicts) else FAILS if all(v == FAILS for v in verdicts)
                   else UNDETERMINED)
    if res.verdict == UNDETERMINED:
        res.n_needed = max((c.questions_needed(sc.size_pp) for c, v in zip(found, verdicts, strict=True)
                            if v == UNDETERMINED), default=0)
    res.evidence += (f" {len(found)} pairs are equally close in memory, all tested: "
                     + "; ".join(f"{c.text()} ({v})" for c, v in zip(found, verdicts, strict=True)) + ".")



def _forgets_test(res: ScenarioResult, summary: pd.DataFrame, task_picks: list[Pick],
                  records: pd.DataFrame | None) -> None:
    sc = res.scenario
    tokens = int(sc.words * TOKENS_PER_WORD)
    rows = _in_setting(summary, res.setting)
    longest = int(rows["context_tokens"].max()) if "context_tokens" in rows and rows["context_tokens"].notna().any() \
        else 0
    res.holds = None
    measured = f"the longest context measured is {longest:,} tokens" if longest else "no context length was recorded"
    if longest < tokens:
        res.evidence = (f"not testable here: {sc.words:,} words are about {tokens:,} tokens (~{TOKENS_PER_WORD:g} "
                        f"tokens per word) and {measured}; the embedded SmolLM2-135M's window is "
                        f"{EMBEDDED_CONTEXT:,} tokens, so it cannot test this claim at all. A model with a longer "
                        "window (`model=local`) and a sweep over `task.context_tokens` can.")
    else:
        res.evidence = (f"not tested by the claim check: {measured}, long enough, but the claim needs accuracy as "
                        "a function of context length (a sweep over `task.context_tokens`).")


_TESTS = {
    "positions": _group_test,
    "quant_vs_evict": _group_test,
    "dropping_hurts": _dropping_test,
    "attention_vs_compression": _attention_test,
    "recompute_best_early": _recompute_test,
    "quant_step_late": _quant_step_test,
    "forgets_words": _forgets_test,
}


def _mean_delta_elsewhere(summary: pd.DataFrame, task: str, strategies: list[str],
                          setting: str | None = None) -> float | None:
    rows = _in_setting(summary, setting)
    rows = rows[(rows["task"] != task) & (rows["task"] != OVERALL)
                & rows["strategy"].isin(strategies)]["delta_pp"].dropna()
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


def _depths(records: pd.DataFrame, task: str) -> list[float]:
    if "sample_meta" not in records:
        return []
    vals = records.loc[records["task"] == task, "sample_meta"].map(sample_depth)
    return [float(v) for v in vals.dropna()]


def _has_depth(records: pd.DataFrame, task: str) -> bool:
    return bool(_depths(records, task))


def depth_deltas(records: pd.DataFrame | None, task: str, strategies: Sequence[str],
                 setting: str | None = None) -> dict[float, float]:
    """Mean paired delta (pp) of ``strategies`` vs ``full`` per depth of the fact in the context.

    ``records`` are paired records (one per task, strategy and sample key, as the leaderboard builds
    them); each strategy's delta at a depth is its mean score minus ``full``'s on the same samples, and
    the strategies are then averaged. ``setting`` (``None``: all records) restricts to one setting.
    ``{}`` when the task's records carry no depth.
    """
    if records is None or records.empty or "sample_meta" not in records:
        return {}
    df = records[records["task"] == task]
    if setting is not None:
        df = df[settings(df) == setting]
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
    return (f" By the fact's depth in the context (0 = start), they average {parts} (point estimates): the "
            f"loss at the shallowest depth is {trend} at the deepest.")


# ------------------------------------------------------------------------------------------- report


@dataclass
class SettingCheck:
    """Every claim in one setting."""

    setting: str
    scopes: list[str]
    best_pp: dict[str, Pick | None]
    best_relative: dict[str, Pick | None]
    relative_defined: dict[str, bool]
    headline: dict[str, HeadlineVerdict]
    scenarios: list[ScenarioResult]
    secondary: dict[str, dict[str, list[Comparison]]] = field(default_factory=dict)  # scope -> member -> endpoints
    ties: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)  # scope -> ties of the two best


@dataclass
class ClaimCheck:
    meta: dict[str, str]
    settings: list[SettingCheck]

    @property
    def scopes(self) -> list[str]:
        return self.settings[0].scopes if self.settings else []

    @property
    def headline(self) -> dict[str, HeadlineVerdict]:
        """The first setting's headline verdicts per scope."""
        return self.settings[0].headline if self.settings else {}

    @property
    def scenarios(self) -> list[ScenarioResult]:
        """Every setting's scenario results, the first setting's first."""
        return [r for s in self.settings for r in s.scenarios]


def check_claims(summary: pd.DataFrame, meta: Mapping[str, str] | None = None,
                 records: pd.DataFrame | None = None, scenarios: tuple[Scenario, ...] = SCENARIOS) -> ClaimCheck:
    """Evaluate every claim on a summary frame (per-task rows, optionally the pooled ``all`` rows), once per
    setting it holds. With the paired ``records`` behind it every verdict rests on clustered paired
    intervals, the pooled scopes are ``all@<tokens>`` (one context length each, never the summary's ``all``
    rows, which may mix lengths), and the headline's members get their secondary endpoints."""
    out = []
    have_records = records is not None and not records.empty
    for setting in ([] if summary.empty else setting_list(summary)):
        rows = _in_setting(summary, setting)
        tasks = sorted(t for t in rows["task"].astype(str).unique() if t != OVERALL)
        if have_records:
            pooled = pooled_scopes(records, setting)
        else:
            pooled = [OVERALL] if (rows["task"] == OVERALL).any() else []
        scopes = tasks + pooled
        heads = {s: headline(summary, s, setting, records if have_records else None) for s in scopes}
        extra = {}
        if have_records:
            for s, h in heads.items():
                recs = scope_records(records, s, setting)
                extra[s] = {m.comparison.a: secondary(recs, m.comparison.a, BASELINE) for m in h.members}
        found = {s: scope_picks(summary, records, s, setting) for s in scopes}
        out.append(SettingCheck(
            setting=setting,
            scopes=scopes,
            best_pp={s: _largest_reduction([p for p in found[s] if p.within_pp()]) for s in scopes},
            best_relative={s: _largest_reduction([p for p in found[s] if p.within_relative()]) for s in scopes},
            relative_defined={s: any(not math.isnan(p.relative_loss) for p in found[s]) for s in scopes},
            headline=heads,
            scenarios=[scenario(summary, sc, records, setting) for sc in scenarios],
            secondary=extra,
            ties={s: (ties_of(_largest_reduction([p for p in found[s] if p.within_pp()]), found[s]),
                      ties_of(_largest_reduction([p for p in found[s] if p.within_relative()]), found[s]))
                  for s in scopes},
        ))
    return ClaimCheck(meta=dict(meta or {}), settings=out)


def _scope_name(scope: str) -> str:
    if scope == OVERALL:
        return "all tasks (pooled)"
    if scope.startswith(f"{OVERALL}@"):
        return f"all tasks at {int(scope.split('@', 1)[1]):,} tokens (pooled)"
    return scope


def _cells(p: Pick | None, undefined: bool = False, ties: list[str] | None = None) -> list[str]:
    if p is None:
        return ["undefined (baseline scores 0)" if undefined else "none", "–", "–"]
    tied = ", tied with " + ", ".join(f"`{t}`" for t in ties) if ties else ""
    return [f"`{p.strategy}` ({p.family}){tied}", pct(p.memory_reduction), ci_text(p)]


def _needed(n: int) -> str:
    return f"~{n:,}" if n else "–"


def render_claims(check: ClaimCheck) -> str:
    """``claim_check.md``: tables and sentences generated from ``check``."""
    m = check.meta
    lines = ["# Claim check", ""]
    if m:
        lines += [f"Model **{m.get('model', '?')}**, measurement spec v{m.get('spec_version', '?')}, hardware "
                  f"profile {m.get('hardware', '?')}, dtype {m.get('dtype', '?')}; {m.get('records', '?')} "
                  "records. Generated by `kvbench leaderboard` from the result store.", ""]
    lines += [
        f"Every verdict names its endpoint. The primary endpoint is **{PRIMARY}**: strategy − `{BASELINE}` in "
        "percentage points on identical questions, with a two-sided 95% interval that is clustered by source "
        "document (measurement spec v1.2 §2.2: Newcombe's paired score interval on Rao–Scott effective counts "
        "for binary scores, the exact zero-flip bound when the two never disagree, a paired cluster bootstrap "
        "for continuous scores), and n_questions / n_contexts / n_documents beside it. Memory reduction is "
        "1 − KV bytes held / dense 16-bit bytes.",
        "",
        f"\"<1% accuracy loss\" is judged as **non-inferiority** with a pre-registered margin of {LOSS_PP:g} point "
        f"(absolute) at a one-sided {ALPHA:g} level (the two-sided 95% interval's lower end above −{LOSS_PP:g}), "
        "Holm-adjusted within the claim's family (spec v1.2 §2.3). A claim **holds** (only then *with "
        "confidence*) or **fails** when its test says so, and is **undetermined at this n** otherwise; then the "
        "check gives the questions that would decide it (spec §2.4: Connor's paired formula at the observed "
        "discordance, never below the n at which zero flips decide, times the design effect). *Within 1 point* "
        f"(delta > −{LOSS_PP:g} pp) and *within 1% relative* are point-estimate readings, never verdicts.",
        "",
    ]
    if not check.settings:
        return "\n".join(lines + ["No strategy records to check.", ""])
    for sc in check.settings:
        lines += _render_setting(sc, several=len(check.settings) > 1)
    return "\n".join(lines)


def _sizes_cell(c: Comparison) -> str:
    docs = "?" if c.n_documents < 0 else str(c.n_documents)
    ctx = "?" if c.n_contexts < 0 else str(c.n_contexts)
    return f"{c.n_questions} / {ctx} / {docs}"


def _p_cell(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.2g}"


def _render_headline(check: SettingCheck, h2: str) -> list[str]:
    lines = ["", f"{h2} \"40–60% less KV memory at <1% accuracy loss\"", "",
             f"Non-inferiority of each strategy saving {pct(CLAIM_LOW)}–{pct(CLAIM_HIGH)} (the family; Holm within "
             f"it): endpoint {PRIMARY}, margin {LOSS_PP:g} point, one-sided level {ALPHA:g}. The claim holds on a "
             "scope when some member holds, fails when every member fails.",
             "",
             "| scope | verdict | family | questions to decide | best-supported member |",
             "|---|---|---:|---:|---|"]
    for s in check.scopes:
        h = check.headline[s]
        if not h.testable:
            lines.append(f"| {_scope_name(s)} | not testable | – | – | – |")
            continue
        best = next((m.comparison for m in h.members if h.pick and m.comparison.a == h.pick.strategy), None)
        cell = (f"`{best.a}`: {pct(h.pick.memory_reduction)} less KV memory, {best.interval_text()} "
                f"({best.sizes()})" if best else h.pick.cite() if h.pick else "–")
        lines.append(f"| {_scope_name(s)} | {h.verdict} | {len(h.members)} | {_needed(h.n_needed)} | {cell} |")
    lines.append("")
    for s in check.scopes:
        lines.append(f"- **{_scope_name(s)}**: {check.headline[s].sentence}")
    for s in check.scopes:
        h = check.headline[s]
        if not h.members:
            continue
        lines += ["", f"{h2}# Members on {_scope_name(s)}", "",
                  "| strategy | reduction | endpoint | Δ [95% CI] | n questions / contexts / documents "
                  "| design effect | interval | Holm p (holds) | Holm p (fails) | verdict | questions to decide |",
                  "|---|---:|---|---|---:|---|---|---:|---:|---|---:|"]
        reductions = {p.strategy: p.memory_reduction for p in h.member_picks}
        for v in h.members:
            c = v.comparison
            deff = "–" if math.isnan(c.deff) else f"{c.deff:.2f} ({c.deff_source})"
            need = c.questions_needed(LOSS_PP) if v.verdict == UNDETERMINED else 0
            lines.append(f"| `{c.a}` | {pct(reductions.get(c.a, float('nan')))} | {c.endpoint} | "
                         f"{c.interval_text()} | {_sizes_cell(c)} | {deff} | {c.method} | {_p_cell(v.p_holds_adj)} | "
                         f"{_p_cell(v.p_fails_adj)} | {v.verdict} | {_needed(need)} |")
        sec = check.secondary.get(s, {})
        if any(sec.values()):
            lines += ["", "Secondary endpoints (paired cluster bootstrap, no verdict): "
                      + "; ".join(f"`{name}`: " + ", ".join(f"{c.endpoint} {c.interval_text()}" for c in comps)
                                  for name, comps in sec.items() if comps) + "."]
    return lines


def _render_setting(check: SettingCheck, several: bool) -> list[str]:
    h2 = "##" if not several else "###"
    lines = []
    if several or check.setting != QUERY_AWARE:
        lines += [f"## Setting: {check.setting}", "", SETTING_TEXT.get(check.setting, check.setting) + ".", ""]
    lines += [f"{h2} Largest memory reduction within the accuracy bound (point estimates, exploratory)", "",
              "| scope | within 1 point | reduction | Δ accuracy | within 1% relative | reduction | Δ accuracy |",
              "|---|---|---:|---|---|---:|---|"]
    for s in check.scopes:
        ties_pp, ties_rel = check.ties.get(s, ([], []))
        cells = (_cells(check.best_pp[s], ties=ties_pp)
                 + _cells(check.best_relative[s], not check.relative_defined[s], ties_rel))
        lines.append(f"| {_scope_name(s)} | " + " | ".join(cells) + " |")
    lines += _render_headline(check, h2)
    lines += ["", f"{h2} Scenarios", "",
              "Each scenario claim is one family: every pair it lists is Holm-adjusted within it. \"A beats B\" "
              f"claims test every pair within {100 * MATCH_TOLERANCE:g} points of memory reduction, so each A "
              "member meets B's best at its memory level; no tie is broken by name.",
              "",
              "| scenario | task | winning family (largest reduction within 1 point) | strategy | claim | verdict "
              "| questions to decide |",
              "|---|---|---|---|---|---|---:|"]
    for r in check.scenarios:
        sc = r.scenario
        if not r.measured:
            lines.append(f"| {sc.title} | `{sc.task}` | not measured | – | {sc.claim} | – | – |")
            continue
        tied = "".join(f" = `{t}`" for t in r.winner_ties)
        if r.winner is not None:
            win, strat = r.winner.family, f"`{r.winner.strategy}`{tied}"
        else:
            win = "none within 1 point"
            strat = f"closest: `{r.closest.strategy}`{tied}" if r.closest else "–"
        lines.append(f"| {sc.title} | `{sc.task}` | {win} | {strat} | {sc.claim} | {r.verdict} | "
                     f"{_needed(r.n_needed)} |")
    lines.append("")
    for r in check.scenarios:
        sc = r.scenario
        lines.append(f"{h2}# {sc.title} (`{sc.task}`)")
        lines.append("")
        lines.append(f"Claim: {sc.claim}. Endpoint: {PRIMARY}. **{r.verdict}.** {r.evidence}")
        if r.families and sc.test in ("positions", "quant_vs_evict", "dropping_hurts"):
            lines += ["", "| family | strategy | reduction | Δ accuracy | within 1 point |", "|---|---|---:|---|---|"]
            for fam, p, ok in r.families:
                lines.append(f"| {fam} | `{p.strategy}` | {pct(p.memory_reduction)} | {ci_text(p)} | {_yes(ok)} |")
        lines.append("")
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
