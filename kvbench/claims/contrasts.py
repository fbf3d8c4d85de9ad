"""A beats B: dominance on the point estimates, pairs at matched memory, and the paired contrast A − B with its
interval and Holm adjustment (spec v1.2's comparator rule, ``docs/measurement-spec.md`` §2.3). Generic: the
scenarios (:mod:`kvbench.claims.scenarios`) say which strategies are A and B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from kvbench import fmt, stats
from kvbench.claims.figures import UNKNOWN_RATE, Pick, ci_text
from kvbench.paired import FAILS, HOLDS, UNDETERMINED, Comparison, compare
from kvbench.stats import CI_LEVEL
from kvbench.vocab import sample_depth, settings

#: Two strategies are at matched memory when their memory reductions differ by at most this (5 points):
#: the eviction ratios and quantizer widths of the registry land within it of each other (int8 48.4%, fp8
#: and the 0.5-ratio evictions 50.0%), and a larger gap would compare different budgets.
MATCH_TOLERANCE = 0.05


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
        return (f"`{self.a.strategy}` − `{self.b.strategy}` = {fmt.pp(self.diff_pp)} pp from the two deltas "
                f"({ci_text(self.a)} versus {ci_text(self.b)}; without the paired records only "
                "non-overlapping intervals decide)")


def with_holm(contrasts: list[Contrast]) -> list[Contrast]:
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


def size_verdict(c: Contrast, size: float) -> str:
    """"A is better than B by ``size`` points" on one pair: holds when A is better with confidence and the
    interval reaches ``size``; fails when the whole interval is below ``size``."""
    hi = c.high if c.paired else c.a.ci_high - c.b.ci_low  # without records: a conservative upper bound
    if c.a_better and hi >= size:
        return HOLDS
    if hi < size:
        return FAILS
    return UNDETERMINED
