"""The source document's headline claim, "40–60% less KV memory at <1% accuracy loss", on one scope: the
non-inferiority verdict of every strategy saving 40–60% at a 1-point margin (spec v1.2 §2.3, Holm within the
family); the claim holds when some member holds, fails when every member fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from kvbench import bands, fmt
from kvbench.claims.figures import (
    LOSS_PP,
    LOSS_RELATIVE,
    NOT_TESTABLE,
    Pick,
    baseline_comparison,
    best_delta,
    largest_reduction,
    samples_sentence,
    scope_picks,
    scope_records,
    setting_list,
)
from kvbench.paired import (
    FAILS,
    FUTILE,
    HOLDS,
    PLANNED_N,
    POOLED,
    UNDETERMINED,
    Comparison,
    NonInferiority,
    identical_scores,
    noninferiority,
    noninferiority_through_looks,
    reader_loss,
    relative_verdict,
)
from kvbench.sequential import Design
from kvbench.vocab import BASELINE, OVERALL, QUERY_AWARE

#: The claim's band of memory reduction.
CLAIM_LOW, CLAIM_HIGH = 0.40, 0.60


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
    relative: Comparison | None = None  # the pick's relative change with its clustered interval (records only)
    relative_verdict: str = ""  # "<1% relative loss" on that interval (spec v1.2 §2.6), "" without records

    @property
    def verdict_text(self) -> str:
        """The verdict as printed: undetermined at the planned n once every undecided member is at its design's
        last look."""
        return _undetermined_label(self.members) if self.verdict == UNDETERMINED else self.verdict


def _undetermined_label(members: Iterable[NonInferiority]) -> str:
    """An undetermined claim's label: at the planned n when every undecided member is at its design's last look
    (the planned n is spent), else at this n."""
    undecided = [m for m in members if m.verdict == UNDETERMINED]
    return PLANNED_N if undecided and all(m.verdict_text == PLANNED_N for m in undecided) else UNDETERMINED


def headline(summary: pd.DataFrame, scope: str, setting: str | None = None,
             records: pd.DataFrame | None = None, design: Design | None = None) -> HeadlineVerdict:
    """The headline on one scope (a task, ``all`` or ``all@<tokens>``) in one setting, as non-inferiority.

    Family: every strategy saving 40–60% (the claim's band); when none does but some save more, those
    saving at least 40% (``in_band`` False). Each member: task accuracy − full ≥ −1 point, Holm-adjusted
    within the family. The claim **holds** when some member holds, **fails** when every member fails.
    With a sequential ``design`` (and records), Holm runs through the design's looks (spec v1.2 §2.5).
    """
    setting = setting or setting_list(summary)[0]
    recs = scope_records(records, scope, setting)
    cands = [p for p in scope_picks(summary, records, scope, setting) if not math.isnan(p.memory_reduction)]
    reach = [p for p in cands if p.memory_reduction >= CLAIM_LOW]
    if not reach:
        best = largest_reduction(cands)
        most = f"; the most any strategy saves is {fmt.pct(best.memory_reduction)}" if best else ""
        return HeadlineVerdict(scope, False, False, False, None, None, False,
                               f"not testable: no strategy reaches {fmt.pct(CLAIM_LOW)} memory reduction{most}",
                               setting=setting)
    band = [p for p in reach if p.memory_reduction <= CLAIM_HIGH]
    family = band or reach
    if design is not None and design.members:
        # A confirmatory design names its members before the data: no other strategy joins the family, and a
        # member whose measured saving left the band is excluded (its rows still show it).
        family = [p for p in band if p.strategy in design.members]
        if not family:
            return HeadlineVerdict(scope, False, False, False, None, None, False,
                                   "not testable yet: no member of the design has records in the claim's band",
                                   setting=setting)
    if design is not None and recs is not None:
        # One family over the design's scopes (spec v1.2 §2.6): the judging sees every task at this scope's length.
        pooled = scope.startswith(f"{OVERALL}@")
        lengths = bands.with_bands(recs)[bands.BAND] if "context_tokens" in recs and len(recs) else None
        length = (f"{OVERALL}@{int(lengths.iloc[0])}" if lengths is not None and lengths.notna().iloc[0]
                  else None)
        every = scope_records(records, length, setting) if length and not pooled else recs
        judged = {v.comparison.a: v for v in noninferiority_through_looks(
            every, [p.strategy for p in family], BASELINE, design, LOSS_PP,
            scope=POOLED if pooled else scope)}
        by_name = {p.strategy: (p, judged[p.strategy]) for p in family if p.strategy in judged}
    else:
        pairs = [(p, c) for p in family if (c := baseline_comparison(p, recs)) is not None]
        verdicts = noninferiority([c for _, c in pairs], LOSS_PP)
        by_name = {p.strategy: (p, v) for (p, _), v in zip(pairs, verdicts, strict=True)}
    holding = [p for p, v in by_name.values() if v.verdict == HOLDS]
    undecided = [(p, v) for p, v in by_name.values() if v.verdict == UNDETERMINED]
    point = [p for p in family if p.within_pp()]
    if holding:
        verdict = HOLDS
    elif by_name and all(v.verdict == FAILS for _, v in by_name.values()):
        verdict = FAILS
    elif by_name and all(v.verdict in (FAILS, FUTILE) for _, v in by_name.values()):
        verdict = FUTILE  # every member decided, none non-inferior: the claim is not shown
    else:
        verdict = UNDETERMINED
    pick = largest_reduction(holding) or largest_reduction(point) or best_delta(family)
    # The claim holds once one member holds: the cheapest member that still can (point estimate above the
    # margin) sets the n; if none can, it fails once every member fails: the most demanding one sets it.
    can_hold = [(p, v) for p, v in undecided if v.comparison.estimate > -LOSS_PP]
    needs = sorted((n, p.strategy) for p, v in (can_hold or undecided) if (n := v.questions_needed()))
    if not can_hold:
        needs = needs[::-1]
    needed = needs[0][0] if verdict == UNDETERMINED and needs else 0
    ties = tuple(tuple(g) for g in identical_scores(recs, [p.strategy for p in family])) if recs is not None else ()
    defined = [p for p in family if not math.isnan(p.relative_loss)]
    holds_rel = any(p.within_relative() for p in defined) if defined else None
    where = (f"the {fmt.pct(CLAIM_LOW)}–{fmt.pct(CLAIM_HIGH)} band" if band else
             f"no strategy in the {fmt.pct(CLAIM_LOW)}–{fmt.pct(CLAIM_HIGH)} band itself; the family is the "
             f"{len(family)} saving more")
    named = ", ".join(f"`{p.strategy}` {v.verdict_text}" for p, v in by_name.values())
    if verdict == HOLDS:
        text = (f"**holds**, and with confidence: {by_name[pick.strategy][1].text()} — non-inferior at "
                f"−{LOSS_PP:g} point")
    elif verdict == FAILS:
        text = (f"**fails** — the claim does not hold: every strategy of {where} loses more than {LOSS_PP:g} "
                f"point with confidence ({named})")
    elif verdict == FUTILE:
        text = (f"**not shown** — every strategy of {where} failed or was stopped for futility, none is "
                f"non-inferior at −{LOSS_PP:g} point ({named})")
    else:
        v = by_name[pick.strategy][1] if pick.strategy in by_name else None
        label = _undetermined_label(m for _, m in undecided)
        text = (f"**{label}**: no strategy of {where} is non-inferior with confidence ({named})"
                + (f"; the closest, {v.text()}" if v else "")
                + (f"; for `{needs[0][1]}`, {_needed_sentence(needed, by_name[needs[0][1]][1])}" if needed else ""))
    extras = []
    if not band:
        extras.append(f"no strategy inside the {fmt.pct(CLAIM_LOW)}–{fmt.pct(CLAIM_HIGH)} band itself was measured "
                      "(the family saves more)")
    if ties:
        extras.append("identical score vectors (tied, whatever their names): "
                      + "; ".join(" = ".join(f"`{s}`" for s in g) for g in ties))
    rel = rel_verdict = None
    if recs is not None and pick is not None:
        rel = next(iter(reader_loss(recs, pick.strategy, BASELINE)), None)
        rel_verdict = relative_verdict(rel) if rel is not None else None
    if rel_verdict is not None:
        extras.append(f"read as <{100 * LOSS_RELATIVE:g}% *relative* loss (a declared secondary endpoint, its own "
                      f"verdict on the clustered interval, no alpha of the family spent): **{rel_verdict}** for "
                      f"`{pick.strategy}`, relative change {rel.interval_text()} (n = {rel.n_questions} questions / "
                      f"{rel.n_documents} clusters)")
    elif holds_rel is None:
        extras.append("the relative reading is undefined (the baseline scores 0)")
    else:
        extras.append(f"read as <{100 * LOSS_RELATIVE:g}% *relative* loss, the point estimate "
                      f"{'is' if holds_rel else 'is not'} within it (reported, not a verdict)")
    sentence = text + ("; " + "; ".join(extras) if extras else "") + "."
    return HeadlineVerdict(scope, True, bool(point), verdict == HOLDS, holds_rel, pick, bool(band), sentence,
                           verdict, needed, setting, tuple(by_name[p.strategy][1] for p in family
                                                           if p.strategy in by_name),
                           ties, tuple(p for p in family if p.strategy in by_name), rel, rel_verdict or "")


def _needed_sentence(needed: int, v: NonInferiority) -> str:
    return samples_sentence(needed, v.comparison, "it", v.level_text())
