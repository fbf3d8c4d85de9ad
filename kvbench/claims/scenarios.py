"""The source document's scenario claims (legal analysis, paper reading, long fiction) and how the numbers test
each: :data:`SCENARIOS` names the task, the claim as written and its test; :func:`scenario` runs the test on
one setting. The tests are built from the generic pieces of :mod:`kvbench.claims.figures` and
:mod:`kvbench.claims.contrasts`; the task names and the sizes in the claims are the document's own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kvbench import fmt
from kvbench.claims.contrasts import (
    MATCH_TOLERANCE,
    Contrast,
    compare_groups,
    contrast,
    matched_pairs,
    size_verdict,
    with_holm,
)
from kvbench.claims.figures import (
    LOSS_PP,
    NOT_TESTABLE,
    Pick,
    baseline_comparison,
    best_delta,
    best_within_pp,
    largest_reduction,
    nan_low,
    picks,
    samples_sentence,
    scope_records,
    setting_list,
    ties_of,
)
from kvbench.paired import FAILS, HOLDS, UNDETERMINED, noninferiority
from kvbench.strategies import attention_guided
from kvbench.vocab import BASELINE, OVERALL, QUERY_AWARE, in_setting, sample_depth, settings

#: "Early" facts sit in the first third of the text, "end-of-text" facts in the last third.
EARLY_DEPTH, LATE_DEPTH = 1 / 3, 2 / 3
#: English text runs at about 1.3 model tokens per word (BPE vocabularies of ~50K entries).
TOKENS_PER_WORD = 1.3
#: The embedded model's context window (SmolLM2-135M's max_position_embeddings).
EMBEDDED_CONTEXT = 8192


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
        within = largest_reduction([p for p in members if p.within_pp()])
        if within is not None:
            out.append((fam, within, True))
        else:
            out.append((fam, best_delta(members), False))
    return out


def _decide_groups(res: ScenarioResult, contrasts: list[Contrast], a_name: str, b_name: str) -> None:
    """Verdict of "family A beats family B" by spec v1.2's comparator rule: every A member is tested against
    *every* B member at matched memory (so against B's best, whichever it is — no tie is broken by name),
    Holm-adjusted over all the pairs. An A member beats B when it beats each of its matched B members with
    confidence; a B member beats A likewise. Holds when some A member beats B and no B member beats A;
    fails the other way round; undetermined otherwise."""
    contrasts = with_holm(contrasts)
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


def _decide_size(res: ScenarioResult, c: Contrast, size: float, what: str) -> None:
    """Verdict of "A is better than B by ``size`` points" on one pair."""
    res.verdict = size_verdict(c, size)
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
        res.closest = best_delta(task_picks)
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
    elsewhere = (f"; the same strategies average {fmt.pp(others)} pp on the other tasks"
                 if others is not None else "")
    recs = scope_records(records, sc.task, res.setting)
    comps = [(p, c) for p in drop if (c := baseline_comparison(p, recs)) is not None]
    verdicts = noninferiority([c for _, c in comps], LOSS_PP)
    confident_hurt = [v for v in verdicts if v.verdict == FAILS]
    harmless = [v for v in verdicts if v.verdict == HOLDS]
    worst = sorted(drop, key=lambda p: (nan_low(p.delta_pp), p.strategy))[0]
    res.evidence = (f"On `{sc.task}`, the {len(drop)} token-dropping strategies average {fmt.pp(mean)} pp "
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
    contrasts = with_holm([c for c in (contrast(p, q, sc.task, records) for p, q in matched_pairs(a, b))
                            if c is not None])
    if not contrasts:
        res.evidence = (f"not testable on `{sc.task}`: no attention-guided eviction and quantization strategies "
                        f"within {100 * MATCH_TOLERANCE:g} points of memory reduction of each other.")
        return
    res.holds = any(all(c.diff_pp >= sc.size_pp for c in contrasts if c.a is p) for p in {c.a for c in contrasts})
    per_a: dict[str, str] = {}
    for c in contrasts:
        v = size_verdict(c, sc.size_pp)
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
    contrasts = with_holm([c for c in (contrast(qr, p, sc.task, records, depth if has_depth else None)
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
    found = with_holm(found)
    verdicts = [size_verdict(c, sc.size_pp) for c in found]
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
    rows = in_setting(summary, res.setting)
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
    rows = in_setting(summary, setting)
    rows = rows[(rows["task"] != task) & (rows["task"] != OVERALL)
                & rows["strategy"].isin(strategies)]["delta_pp"].dropna()
    return float(rows.mean()) if len(rows) else None


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
    parts = ", ".join(f"{fmt.pp(v)} pp at depth {d:g}" for d, v in deltas.items())
    shallow, deep = deltas[min(deltas)], deltas[max(deltas)]
    trend = ("larger than" if shallow < deep else "smaller than" if shallow > deep else "the same as")
    return (f" By the fact's depth in the context (0 = start), they average {parts} (point estimates): the "
            f"loss at the shallowest depth is {trend} at the deepest.")
