"""What the claim check cites: one strategy's figures on one scope (:class:`Pick`), the scopes (a task, or
``all@<tokens>``: the tasks measured at one context length, pooled) and their records, the picks that best meet
the accuracy bound, each pick's comparison against ``full``, and the sample-size sentence of an undecided
verdict (spec v1.2 §2.4). Generic: nothing here names a task or a strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from kvbench import bands, fmt, stats
from kvbench.paired import ALPHA, PRIMARY, Comparison, compare
from kvbench.stats import POWER
from kvbench.vocab import BASELINE, OFFLOADING_FAMILIES, OVERALL, QUERY_AWARE, in_setting, ordered_settings, settings

#: The claim's accuracy bound: a loss under 1 point, or under 1% relative.
LOSS_PP = 1.0
LOSS_RELATIVE = 0.01
#: A strategy holding at least this fraction of the context's tokens keeps every position.
KEEPS_ALL = 1.0 - 1e-9
#: Baseline accuracy assumed for sample sizes when none was measured: 0.5 maximises the variance.
UNKNOWN_RATE = 0.5
NOT_TESTABLE = "not testable"


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
        text = f"`{self.strategy}` ({self.family}): {fmt.pct(self.memory_reduction)} less KV memory, {ci_text(self)}"
        if not math.isnan(self.mcnemar_p):
            text += (f" ({int(self.n_only_strategy)} only-strategy / {int(self.n_only_baseline)} only-baseline "
                     f"correct of {self.n}, McNemar p = {self.mcnemar_p:.2g})")
        return text

    @property
    def rate(self) -> float:
        """The baseline accuracy that sample sizes are computed at."""
        return UNKNOWN_RATE if math.isnan(self.baseline_accuracy) else self.baseline_accuracy


def ci_text(p: Pick) -> str:
    """``-0.5 pp [95% CI -1.5, +0.5]``: a pick's delta against the baseline with its interval."""
    return fmt.interval(p.delta_pp, p.ci_low, p.ci_high, unit=" pp", label="95% CI ")


def setting_list(summary: pd.DataFrame) -> list[str]:
    """The settings a summary holds, query-aware first (a summary without the column is query-aware)."""
    if summary.empty or "setting" not in summary:
        return [QUERY_AWARE]
    return ordered_settings(summary["setting"])


def picks(summary: pd.DataFrame, scope: str, setting: str | None = None) -> list[Pick]:
    """Every non-baseline, non-offloading strategy measured on ``scope`` (a task or ``all``) in ``setting``
    (``None``: any), sorted by label."""
    if summary.empty:
        return []
    rows = in_setting(summary, setting)
    rows = rows[(rows["task"] == scope) & (rows["strategy"] != BASELINE)]
    if "family" in rows:
        rows = rows[~rows["family"].isin(OFFLOADING_FAMILIES)]
    rows = rows.sort_values("strategy", kind="mergesort")
    return [Pick.from_row(r) for r in rows.to_dict("records")]


def largest_reduction(cands: list[Pick]) -> Pick | None:
    """The most memory saved; ties go to the better delta, then the label (deterministic)."""
    cands = [p for p in cands if not math.isnan(p.memory_reduction)]
    if not cands:
        return None
    return sorted(cands, key=lambda p: (-p.memory_reduction, -nan_low(p.delta_pp), p.strategy))[0]


def ties_of(pick: Pick | None, cands: list[Pick]) -> list[str]:
    """The other candidates with exactly ``pick``'s figures (memory saved, delta and its interval): a label
    order chose among them, so they are shown as tied rather than ranked by name."""
    if pick is None:
        return []
    key = (round(pick.memory_reduction, 9), pick.delta_pp, pick.ci_low, pick.ci_high)
    return sorted(p.strategy for p in cands if p.strategy != pick.strategy
                  and (round(p.memory_reduction, 9), p.delta_pp, p.ci_low, p.ci_high) == key)


def best_delta(cands: list[Pick]) -> Pick:
    return sorted(cands, key=lambda p: (-nan_low(p.delta_pp), -nan_low(p.memory_reduction), p.strategy))[0]


def nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def best_within_pp(summary: pd.DataFrame, scope: str, loss: float = LOSS_PP,
                   setting: str | None = None) -> Pick | None:
    """Largest memory reduction on ``scope`` whose accuracy delta stays above ``-loss`` points."""
    return largest_reduction([p for p in picks(summary, scope, setting) if p.within_pp(loss)])


def best_within_relative(summary: pd.DataFrame, scope: str, loss: float = LOSS_RELATIVE,
                         setting: str | None = None) -> Pick | None:
    """Largest memory reduction on ``scope`` whose relative accuracy loss stays under ``loss``."""
    return largest_reduction([p for p in picks(summary, scope, setting) if p.within_relative(loss)])


def samples_sentence(needed: int, c: Comparison | None, what: str, level: str = "") -> str:
    """``about 1,534 questions (… documents' design effect …) would decide <what>`` — spec v1.2 §2.4's
    paired count at the comparison's observed discordance and design effect."""
    if not needed:
        return f"no number of questions decides {what} at the observed difference"
    basis = ""
    if c is not None and c.binary:
        basis = (f" at the observed discordance ({c.only_a + c.only_b} of {c.n_questions} questions"
                 + (", taken at its 95% upper bound since none was seen" if c.only_a + c.only_b == 0 else "")
                 + f") and design effect {c.deff:.2f} ({c.deff_source})")
    return (f"about {needed:,} questions{basis} would decide {what} ({level or f'one-sided {ALPHA:g} level'}, "
            f"{POWER:.0%} power, Connor's paired formula; measurement spec §2.4)")


def scope_records(records: pd.DataFrame | None, scope: str, setting: str | None) -> pd.DataFrame | None:
    """The records of a scope: one task, or a pooled ``all@<tokens>`` scope (every task measured in that length
    band, :mod:`kvbench.bands` — spec v1.2 never pools across context lengths)."""
    if records is None or records.empty:
        return None
    df = records if setting is None else records[settings(records) == setting]
    if scope.startswith(f"{OVERALL}@"):
        df = bands.with_bands(df)
        return df[df[bands.BAND] == float(scope.split("@", 1)[1])]
    return df[df["task"] == scope]


def pooled_scopes(records: pd.DataFrame | None, setting: str | None) -> list[str]:
    """``all@<tokens>`` for every length band in which two tasks or more were measured."""
    if records is None or records.empty or "context_tokens" not in records:
        return []
    df = bands.with_bands(records if setting is None else records[settings(records) == setting])
    per_band = df.groupby(df[bands.BAND])["task"].nunique()
    return [f"{OVERALL}@{int(t)}" for t, k in per_band.items() if k >= 2]


def pooled_members(records: pd.DataFrame | None, scope: str, setting: str | None) -> str:
    """What a pooled ``all@<tokens>`` scope pools and leaves out: ``legal, papers; not pooled: fiction (2,048
    tokens)``; empty for a task or without records."""
    inside = scope_records(records, scope, setting) if scope.startswith(f"{OVERALL}@") else None
    if inside is None or inside.empty:
        return ""
    df = bands.with_bands(records if setting is None else records[settings(records) == setting])
    tasks = sorted(set(inside["task"].astype(str)))
    band = float(scope.split("@", 1)[1])
    out = []
    for task in sorted(set(df["task"].astype(str))):
        part = df[(df["task"].astype(str) == task) & (df[bands.BAND] != band)]
        if not part.empty:
            out.append(f"{task} ({bands.bands_text(part)})")
    return ", ".join(tasks) + (f"; not pooled: {', '.join(out)}" if out else "")


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


def baseline_comparison(p: Pick, recs: pd.DataFrame | None) -> Comparison | None:
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
