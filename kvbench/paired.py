"""Paired, clustered comparisons from records, and non-inferiority verdicts (measurement spec v1.2 §2.2-2.4).

A comparison pairs two strategies' (or a strategy's and ``full``'s) records question by question on one
scope, clusters the questions by the document they were drawn from, and gives the difference with a
cluster-aware 95% interval (:mod:`kvbench.stats`): Newcombe's interval on Rao-Scott effective counts for
binary scores (exact zero-count bound where the arms never disagree), a paired cluster bootstrap for
continuous ones. Every comparison carries ``n_questions``, ``n_contexts`` and ``n_documents``.

Clusters (the integrator's record convention): ``document_id`` — for records without it,
``sample_meta["source_docs"][0]``, else the sample id; ``context_id`` — else the sample id. Both are
namespaced by task, since fallback sample ids repeat across tasks.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats as sps

from kvbench import fmt, scoretest, sequential, stats
from kvbench.errors import KVBenchError
from kvbench.spec import binary_metric
from kvbench.stats import CI_LEVEL, POWER

#: The pre-registered non-inferiority margin of "<1% accuracy loss": 1 point of task accuracy, absolute.
MARGIN_PP = 1.0
#: One-sided level of every directional verdict: the two-sided 95% interval's end.
ALPHA = (1 - CI_LEVEL) / 2
HOLDS, FAILS, UNDETERMINED = "holds", "fails", "undetermined at this n"
#: How an undetermined verdict reads once a sequential design has taken its last look (``NonInferiority.verdict_text``).
PLANNED_N = "undetermined at the planned n"
#: A hypothesis whose statistic fell below its design's non-binding futility boundary (spec v1.3 §2.7): its
#: sampling stops, non-inferiority was not shown, and it is not shown to fail either.
FUTILE = "stopped for futility"
PRIMARY = "task accuracy"
SECONDARY = ("gold-answer NLL, relative change", "top-1 agreement", "KL(full ‖ strategy), nats")
#: The reader's loss (spec v1.2 §2.6): declared secondary endpoints on the task score, in percent, each with a
#: paired cluster-bootstrap interval — the relative change of accuracy, retention (of the questions the baseline
#: answers, the share the strategy still answers) and churn (the share of questions whose score changed).
READER = ("relative change", "retention", "churn")
#: "<1% relative loss": the relative change's whole interval above −1% holds, its whole interval below fails.
RELATIVE_MARGIN = 0.01


# ------------------------------------------------------------------------------------------- clusters


def _meta(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v)) and str(v) != ""


@functools.lru_cache(maxsize=65536)
def _source_docs(meta: str) -> tuple[str, ...]:
    docs = _meta(meta).get("source_docs")
    return tuple(str(d) for d in docs) if isinstance(docs, (list, tuple)) else ()


def document_ids(records: pd.DataFrame) -> pd.Series:
    """Each record's cluster: the connected component of shared source works (spec v1.2 §2.2's "coarsest shared
    unit"), prefixed by the task. A context's works are its ``document_id`` and every ``sample_meta["source_docs"]``
    entry (a legal context can join several licences); two contexts sharing any work are one cluster, and so on
    transitively. A record with neither is its own cluster (its sample id). Named by the component's smallest work.
    """
    n = len(records)
    given = records["document_id"] if "document_id" in records else pd.Series([None] * n, index=records.index)
    meta = records["sample_meta"] if "sample_meta" in records else pd.Series([None] * n, index=records.index)
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    works = []
    for task, doc, m, sid in zip(records["task"], given, meta, records["sample_id"], strict=True):
        ws = ([str(doc)] if _present(doc) else []) + list(_source_docs(m) if isinstance(m, str) else ())
        ws = [f"{task}:{w}" for w in dict.fromkeys(ws)] or [f"{task}:{sid}"]
        works.append(ws)
        root = find(ws[0])
        for w in ws[1:]:
            other = find(w)
            if other != root:  # the smaller name roots the component, so labels never depend on row order
                root, other = min(root, other), max(root, other)
                parent[other] = root
    return pd.Series([find(ws[0]) for ws in works], index=records.index, dtype=object)


def context_ids(records: pd.DataFrame) -> pd.Series:
    """Each record's context: ``context_id``, else the sample id; prefixed by the task."""
    ctx = records["context_id"] if "context_id" in records else pd.Series(None, index=records.index)
    return pd.Series([f"{t}:{c if _present(c) else s}" for t, c, s in
                      zip(records["task"], ctx, records["sample_id"], strict=True)], index=records.index, dtype=object)


# ---------------------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Comparison:
    """``a`` − ``b`` on one endpoint and scope: estimate and two-sided 95% interval in the endpoint's unit
    (points for task accuracy), the test behind it, and the sizes of the sample it rests on."""

    a: str
    b: str
    endpoint: str
    estimate: float
    low: float
    high: float
    method: str
    n_questions: int
    n_contexts: int
    n_documents: int
    deff: float = float("nan")
    deff_source: str = ""
    a_mean: float = float("nan")
    b_mean: float = float("nan")
    only_a: int = 0  # binary: questions only a gets right
    only_b: int = 0
    scale: float = 100.0  # endpoint unit per fraction (points)
    unit: str = "pp"
    test: Any = field(default=None, repr=False, compare=False)  # stats.PairedBinary | ClusterBootstrap | None
    # The paired cluster bootstrap of the same differences: the sensitivity check of a binary verdict near its
    # boundary (spec v1.2 §2.6); resamples are drawn only when it is read.
    bootstrap: Any = field(default=None, repr=False, compare=False)

    @property
    def binary(self) -> bool:
        return isinstance(self.test, stats.PairedBinary)

    def p_greater(self, null: float) -> float:
        """One-sided p of H0: a − b <= ``null`` (endpoint units); from the interval when there is no test."""
        if self.test is None:
            return _p_from_interval(self, null, greater=True)
        return self.test.p_greater(null / self.scale)

    def p_less(self, null: float) -> float:
        if self.test is None:
            return _p_from_interval(self, null, greater=False)
        return self.test.p_less(null / self.scale)

    def p_two_sided(self) -> float:
        if self.test is None:
            return min(1.0, 2 * min(self.p_greater(0.0), self.p_less(0.0)))
        return self.test.p_two_sided()

    def sizes(self) -> str:
        docs = "?" if self.n_documents < 0 else str(self.n_documents)
        ctx = "?" if self.n_contexts < 0 else str(self.n_contexts)
        return f"n = {self.n_questions} questions / {ctx} contexts / {docs} documents"

    def interval_text(self) -> str:
        unit = f" {self.unit}" if self.unit == "pp" else self.unit
        spec = {"pp": "+.1f", "%": "+.2f"}.get(self.unit, "+.3g")
        if math.isnan(self.low):
            return f"{fmt.number(self.estimate, spec)}{unit} (no interval: {self.method})"
        return fmt.interval(self.estimate, self.low, self.high, spec, unit=unit, label="95% CI ")

    def text(self) -> str:
        """```a` − `b` = +2.0 pp [95% CI …] (newcombe-rao-scott, design effect 1.4 from …; n = …)``."""
        if self.endpoint != PRIMARY:  # a secondary endpoint is the strategy's own figure against the baseline
            return (f"{self.endpoint} of `{self.a}` against `{self.b}`: {self.interval_text()} "
                    f"({self.method}; {self.sizes()})")
        deff = (f", design effect {self.deff:.2f} from the {self.deff_source}"
                if not math.isnan(self.deff) else "")
        disc = f", {self.only_a} only-A / {self.only_b} only-B correct" if self.binary else ""
        return (f"`{self.a}` − `{self.b}` = {self.interval_text()} ({self.method}{deff}{disc}; {self.sizes()})")

    def questions_needed(self, margin: float, power: float = POWER, level: float = CI_LEVEL) -> int:
        """Questions at which this comparison would be decided against ``−margin`` points (spec v1.2 §2.4),
        at its observed discordance (binary) or spread (continuous) and design effect, by a test at one-sided
        ``(1 − level) / 2``."""
        deff = 1.0 if math.isnan(self.deff) else self.deff
        if self.binary:
            n = self.n_questions
            return stats.questions_needed(self.only_b / n, self.only_a / n, n, margin / self.scale,
                                          self.b_mean if not math.isnan(self.b_mean) else 0.5, deff,
                                          level, power)
        # Continuous, or only an interval: the normal approximation at the interval's standard error.
        se = (self.high - self.low) / (2 * float(sps.norm.ppf(1 - ALPHA)))
        gap = abs(self.estimate + margin)
        if math.isnan(se) or gap == 0 or self.n_questions == 0:
            return 0
        z = float(sps.norm.ppf((1 + level) / 2) + sps.norm.ppf(power))
        return int(math.ceil(self.n_questions * (z * se / gap) ** 2))


def _p_from_interval(c: Comparison, null: float, greater: bool) -> float:
    """Without records only an interval is known: its one-sided p by a normal approximation."""
    se = (c.high - c.low) / (2 * float(sps.norm.ppf(1 - ALPHA)))
    if math.isnan(se) or se <= 0:
        return float("nan")
    z = (c.estimate - null) / se
    return float(sps.norm.sf(z) if greater else sps.norm.cdf(z))


def _pair(records: pd.DataFrame, a: str, b: str, columns: Sequence[str]) -> pd.DataFrame:
    keep = ["sample_id", "task", *[c for c in columns if c in records]]
    ids = [c for c in ("document_id", "context_id", "sample_meta") if c in records]
    left = records.loc[records["strategy"] == a, list(dict.fromkeys(keep + ids))]
    left = left.assign(_doc=document_ids(left), _ctx=context_ids(left))[keep + ["_doc", "_ctx"]]
    right = records[records["strategy"] == b][keep]
    both = left.merge(right, on=["task", "sample_id"], suffixes=("_a", "_b"))
    return both.sort_values(["task", "sample_id"], kind="mergesort").reset_index(drop=True)


def compare(records: pd.DataFrame, a: str, b: str, seed: int = 0) -> Comparison | None:
    """``a`` − ``b`` in task accuracy (points) on the questions both were scored on in ``records`` (already
    restricted to one scope and setting). ``None`` when they share no question."""
    both = _pair(records, a, b, ["score", "metric"])
    if both.empty:
        return None
    sa, sb = both["score_a"].to_numpy(float), both["score_b"].to_numpy(float)
    docs = tuple(both["_doc"])
    metrics = sorted(set(both.get("metric_a", pd.Series(dtype=object)).dropna())
                     | set(both.get("metric_b", pd.Series(dtype=object)).dropna()))
    binary = binary_metric(metrics)
    if binary is None:
        binary = stats.is_binary(sa) and stats.is_binary(sb)
    sizes = dict(n_questions=len(both), n_contexts=both["_ctx"].nunique(), n_documents=len(set(docs)))
    method_prefix = ""
    if not binary:
        boot = stats.ClusterBootstrap(sa - sb, docs, seed=seed)
        if not boot.degenerate:
            lo, hi = boot.interval()
            return Comparison(a, b, PRIMARY, 100 * boot.estimate, 100 * lo, 100 * hi, "cluster-bootstrap",
                              **sizes, a_mean=float(sa.mean()), b_mean=float(sb.mean()), test=boot)
        # Every resample agrees: the spec's binary interval of the rounded scores (never zero width).
        sa, sb, method_prefix = np.round(sa), np.round(sb), "rounded, "
    counts = stats.paired_counts(sa, sb)
    deff = stats.design_effect(sa - sb, docs, baseline=sb)
    test = stats.PairedBinary(counts, deff)
    lo, hi = test.interval()
    # The estimate from the exact counts (one rounding for every page that prints it: -45/1200 is -3.75 pp).
    exact = float(Fraction(100 * (counts.only_a - counts.only_b), counts.n))
    return Comparison(a, b, PRIMARY, exact, 100 * lo, 100 * hi, method_prefix + test.method,
                      **sizes, deff=deff.value, deff_source=deff.source, a_mean=float(sa.mean()),
                      b_mean=float(sb.mean()), only_a=counts.only_a, only_b=counts.only_b, test=test,
                      bootstrap=stats.ClusterBootstrap(sa - sb, docs, seed=seed))


def reader_loss(records: pd.DataFrame, strategy: str, baseline: str, seed: int = 0) -> list[Comparison]:
    """The reader's loss of ``strategy`` against ``baseline`` (:data:`READER`), in percent, each with a paired
    cluster-bootstrap interval (whole clusters of shared works resampled) and its n: relative change
    ``sum(s − b) / sum(b)``, retention ``sum(s · b) / sum(b)``, churn ``mean(s != b)``. An endpoint with no
    interval (constant, or a baseline that never scores) says so in its method."""
    both = _pair(records, strategy, baseline, ["score"])
    if both.empty:
        return []
    sa, sb = both["score_a"].to_numpy(float), both["score_b"].to_numpy(float)
    docs = tuple(both["_doc"])
    sizes = dict(n_questions=len(both), n_contexts=both["_ctx"].nunique(), n_documents=len(set(docs)))
    out = []
    for name, num, den in ((READER[0], sa - sb, sb), (READER[1], sa * sb, sb),
                           (READER[2], (sa != sb).astype(float), None)):
        boot = stats.ClusterBootstrap(num, docs, den, seed=seed)
        lo, hi = boot.interval()
        method = "cluster-bootstrap"
        if boot.degenerate or math.isnan(boot.estimate):
            lo = hi = float("nan")
            method = "no interval: constant on every question" if not math.isnan(boot.estimate) else \
                "undefined: the baseline never scores"
        out.append(Comparison(strategy, baseline, name, 100 * boot.estimate, 100 * lo, 100 * hi, method, **sizes,
                              unit="%", test=None if math.isnan(lo) else boot))
    return out


def relative_verdict(c: Comparison, margin: float = RELATIVE_MARGIN) -> str:
    """"<1% relative loss" read on the relative change's clustered 95% interval (a secondary endpoint: no alpha
    of the design's family is spent on it): holds when the whole interval is above −margin, fails when it is
    wholly below, undetermined otherwise."""
    if math.isnan(c.low):
        return UNDETERMINED
    return HOLDS if c.low > -100 * margin else FAILS if c.high < -100 * margin else UNDETERMINED


def secondary(records: pd.DataFrame, strategy: str, baseline: str, seed: int = 0) -> list[Comparison]:
    """The secondary endpoints of ``strategy`` against ``baseline`` with paired cluster-bootstrap intervals:
    relative change of the gold answer's NLL (a ratio of sums), top-1 agreement and KL (means). An endpoint
    constant on every question gets no interval (method says so) rather than a zero-width one."""
    both = _pair(records, strategy, baseline, ["gold_nll", "top1_agreement", "kl"])
    out = []
    if both.empty:
        return out
    docs = tuple(both["_doc"])
    sizes = dict(n_questions=len(both), n_contexts=both["_ctx"].nunique(), n_documents=len(set(docs)))
    parts = []
    if {"gold_nll_a", "gold_nll_b"} <= set(both):
        parts.append((SECONDARY[0], both["gold_nll_a"] - both["gold_nll_b"], both["gold_nll_b"]))
    if "top1_agreement_a" in both:
        parts.append((SECONDARY[1], both["top1_agreement_a"], None))
    if "kl_a" in both:
        parts.append((SECONDARY[2], both["kl_a"], None))
    for name, num, den in parts:
        ok = num.notna() & (den.notna() if den is not None else True)
        if not ok.any():
            continue
        boot = stats.ClusterBootstrap(num[ok].to_numpy(float), tuple(np.asarray(docs, dtype=object)[ok.to_numpy()]),
                                      None if den is None else den[ok].to_numpy(float), seed=seed)
        lo, hi = boot.interval()
        method = "cluster-bootstrap"
        if boot.degenerate:
            lo = hi = float("nan")
            method = "constant on every question"
        out.append(Comparison(strategy, baseline, name, boot.estimate, lo, hi, method, **sizes, scale=1.0, unit="",
                              test=None if boot.degenerate else boot))
    return out


# ------------------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Look:
    """Where a group-sequential verdict stands (spec v1.2 §2.5, :mod:`kvbench.sequential`)."""

    look: int  # the last complete look (0: before the first)
    n_looks: int
    contexts: int  # contexts per task in that look
    decided_at: int = 0  # the look the verdict was reached at (0: not decided)
    level: float = float("nan")  # nominal one-sided level the deciding test met, or the hold test needs now
    share: float = float("nan")  # the Holm share of alpha that level belongs to
    p_decided: float = float("nan")  # the deciding p at ``decided_at``
    final_level: float = float("nan")  # the last look's nominal level at ``share``: what the planned n must meet
    spending: str = "O'Brien–Fleming"
    # Undetermined: the comparison's interval at this look's level (two-sided 1 − 2 x level), endpoint units —
    # the repeated confidence interval whose position against −margin the verdict reads (Jennison & Turnbull
    # 2000, ch. 9); it straddles the margin exactly when the look decides nothing.
    repeated: tuple[float, float] = (float("nan"), float("nan"))
    charged: bool = False  # the deciding look is one published before the design was registered (charged)
    exploratory: bool = False  # the scope is outside the design's family (spec v1.2 §2.6)
    futile: bool = False  # decided_at is where the statistic fell below the futility boundary (``level``: its p)
    # The member left the sweep after this look, once its verdict was final (docs/confirm.md): this scope's
    # comparison is that look's and it is tested no further (0: sampled to ``look``).
    stopped_at: int = 0

    def repeated_text(self) -> str:
        lo, hi = self.repeated
        return "" if math.isnan(lo) else f"[{lo:+.1f}, {hi:+.1f}]"

    def text(self, p_holds: float, p_fails: float = float("nan")) -> str:
        where = f"look {self.look} of {self.n_looks} ({self.contexts} contexts per task)"
        if self.decided_at and self.futile:
            return (f"group-sequential, stopped for futility at look {self.decided_at} of {self.n_looks}: one-sided "
                    f"p = {_p(self.p_decided)} (holds), above the non-binding futility boundary's {_p(self.level)} "
                    f"for its share of alpha {_p(self.share)}")
        if self.decided_at:
            early = " (a look published before the design, charged to its spending)" if self.charged else ""
            return (f"group-sequential, decided at look {self.decided_at} of {self.n_looks}{early}: one-sided p = "
                    f"{_p(self.p_decided)}, below that look's level {_p(self.level)} ({self.spending} boundary "
                    f"of its share of alpha {_p(self.share)})")
        if self.stopped_at:
            return (f"group-sequential, not sampled after look {self.stopped_at} of {self.n_looks} ({self.contexts} "
                    f"contexts per task), where the member's verdict was final: one-sided p = {_p(p_holds)} (holds) "
                    f"and {_p(p_fails)} (fails) there, no longer tested")
        if not self.look:
            return "group-sequential: before the first look, no verdict"
        if self.share == 0:
            return (f"group-sequential, {where}: one-sided p = {_p(p_holds)} (holds) and {_p(p_fails)} (fails), "
                    "not tested: its share of alpha is 0 until a hypothesis before it in the design's gatekeeping "
                    "order (the same strategy, pooled) is rejected")
        rci = (f"; the repeated confidence interval at that level is {self.repeated_text()}" if self.repeated_text()
               else "")
        if self.final:
            # The planned n is spent and no later look will be taken: "at this n" would suggest that more
            # questions under this design could still decide it.
            return (f"group-sequential, the design's last look ({where}: its planned n): one-sided p = "
                    f"{_p(p_holds)} (holds) and {_p(p_fails)} (fails), neither below the last look's level "
                    f"{_p(self.level)} ({self.spending} boundary of its share of alpha {_p(self.share)}){rci}; the "
                    "design ends undetermined: the planned contexts were too few for the observed difference and "
                    "discordance")
        return (f"group-sequential, {where}: one-sided p = {_p(p_holds)} (holds) and {_p(p_fails)} (fails), either "
                f"needs to be below {_p(self.level)} at this look ({self.spending} boundary of its share of alpha "
                f"{_p(self.share)}){rci}")

    @property
    def final(self) -> bool:
        """Undecided at the design's last look: the planned n was reached without a verdict."""
        return not self.decided_at and self.n_looks > 0 and self.look == self.n_looks


@dataclass(frozen=True)
class NonInferiority:
    """A − B >= −margin on the primary endpoint, with Holm's correction within its family (and, under a
    sequential design, through its looks: ``look``)."""

    comparison: Comparison
    margin: float
    p_holds: float  # one-sided p of H0: a − b <= −margin
    p_fails: float  # one-sided p of H0: a − b >= −margin
    p_holds_adj: float
    p_fails_adj: float
    family_size: int
    verdict: str
    look: Look | None = None
    # Within a factor of 2 of its boundary: the cluster bootstrap's (p, low, high, level) — a second interval
    # method beside the deciding one (spec v1.2 §2.6); () otherwise.
    sensitivity: tuple[float, ...] = ()

    def sensitivity_text(self) -> str:
        """``cluster bootstrap p = 0.0031 vs 0.0047, [-0.61, +0.42]`` (and whether it agrees), or ``""``."""
        if not self.sensitivity:
            return ""
        pb, lo, hi, level = self.sensitivity
        agrees = (pb < level) == (self.verdict in (HOLDS, FAILS))
        return (f"cluster bootstrap p = {_p(pb)} vs {_p(level)}, interval at that level "
                f"[{lo:+.1f}, {hi:+.1f}]: {'agrees' if agrees else 'disagrees'}")

    @property
    def verdict_text(self) -> str:
        """The verdict as tables print it: an undetermined verdict at a design's last look is undetermined at the
        planned n (no later look will be taken), not merely at this n."""
        return PLANNED_N if self.verdict == UNDETERMINED and self.look is not None and self.look.final \
            else self.verdict

    def questions_needed(self, power: float = POWER) -> int:
        """Questions that would decide this verdict (0 once decided): spec §2.4's paired count at the one-sided
        level the verdict must meet — alpha at a fixed n; under a sequential design, the last look's nominal
        level for the member's Holm share (its largest n: early stopping only ever needs fewer)."""
        if self.verdict != UNDETERMINED or (self.look is not None and self.look.share == 0):
            return 0  # decided, or gated (no alpha to spend until its gate opens: no n decides it by itself)
        level = CI_LEVEL
        if self.look is not None and not math.isnan(self.look.final_level):
            level = 1 - 2 * self.look.final_level
        return self.comparison.questions_needed(self.margin, power, level)

    def level_text(self) -> str:
        """The one-sided level :meth:`questions_needed` plans for, in words."""
        if self.look is not None and not math.isnan(self.look.final_level):
            return (f"one-sided {_p(self.look.final_level)}: the last look's level for a share of alpha of "
                    f"{_p(self.look.share)}")
        return f"one-sided {ALPHA:g} level"

    def text(self) -> str:
        if self.look is not None:
            return (f"{self.comparison.text()}; non-inferiority at −{self.margin:g} pp, "
                    f"{self.look.text(self.p_holds, self.p_fails)}"
                    f" (family of {self.family_size})")
        return (f"{self.comparison.text()}; non-inferiority at −{self.margin:g} pp: Holm-adjusted one-sided "
                f"p = {_p(self.p_holds_adj)} (holds below {ALPHA:g}), against it p = {_p(self.p_fails_adj)} "
                f"(family of {self.family_size})")


def _p(v: float) -> str:
    return fmt.number(v, ".2g")


def noninferiority(comparisons: Sequence[Comparison], margin: float = MARGIN_PP,
                   alpha: float = ALPHA) -> list[NonInferiority]:
    """Each comparison's non-inferiority verdict at ``−margin``, Holm-adjusted within the given family.

    holds when the adjusted p of H0 (loss >= margin) is below ``alpha`` — with one member exactly "the
    two-sided 95% interval's lower end is above −margin"; fails when the adjusted p of the opposite H0 is
    below ``alpha`` (the upper end below −margin); undetermined otherwise. Without p-values (no records),
    the unadjusted interval decides.
    """
    ph = [c.p_greater(-margin) for c in comparisons]
    pf = [c.p_less(-margin) for c in comparisons]
    have = not any(math.isnan(v) for v in ph + pf)
    ph_adj = stats.holm(ph) if have else ph
    pf_adj = stats.holm(pf) if have else pf
    out = []
    for c, h, f, ha, fa in zip(comparisons, ph, pf, ph_adj, pf_adj, strict=True):
        if have:
            verdict = HOLDS if ha < alpha else FAILS if fa < alpha else UNDETERMINED
        else:
            verdict = HOLDS if c.low > -margin else FAILS if c.high < -margin else UNDETERMINED
        # The unadjusted p's own threshold is alpha scaled by Holm's multiplier (adjusted / raw).
        up = verdict == HOLDS or (verdict == UNDETERMINED and c.estimate > -margin)
        raw, adj = (h, ha) if up else (f, fa)
        level = alpha * raw / adj if have and adj > 0 else float("nan")
        out.append(NonInferiority(c, margin, h, f, ha, fa, len(comparisons), verdict,
                                  sensitivity=_sensitivity(c, raw, level, margin, up)))
    return out


#: A design's name for the pooled scope (every task of the records, at one context length).
POOLED = "pooled"


def _sensitivity(c: Comparison | None, p: float, level: float, margin: float, holds: bool) -> tuple[float, ...]:
    """The cluster bootstrap's one-sided p and interval at ``level`` (two-sided 1 − 2 x level) for a decision whose
    p is within a factor of 2 of its level (spec v1.2 §2.6): a second interval method where the first one's
    verdict is close. () when not close, or no bootstrap (continuous scores already use it)."""
    if c is None or c.bootstrap is None or math.isnan(p) or math.isnan(level) or not level / 2 <= p <= 2 * level:
        return ()
    boot = c.bootstrap
    pb = boot.p_greater(-margin / c.scale) if holds else boot.p_less(-margin / c.scale)
    lo, hi = boot.interval(1 - 2 * level)
    return (pb, c.scale * lo, c.scale * hi, level)


def noninferiority_through_looks(records: pd.DataFrame, strategies: Sequence[str], baseline: str,
                                 design: sequential.Design, margin: float = MARGIN_PP,
                                 alpha: float = ALPHA, scope: str | None = None) -> list[NonInferiority]:
    """Each strategy's non-inferiority verdict against ``baseline`` at ``−margin`` under a sequential
    ``design``: the comparisons of every complete look (nested prefixes of ``records``), Holm through the
    looks in each direction (:func:`kvbench.sequential.holm_through_looks`). A verdict, once reached, is kept;
    the comparison shown is the last complete look's. Strategies without a comparison are left out.

    Without ``design.scopes`` ``records`` are the one scope judged. With them (spec v1.2 §2.6) ``records`` are
    every task at one context length and the family is every (scope, strategy) hypothesis of the declared scopes
    (:data:`POOLED`: all of ``records``; a task: its records), Holm over all of them; ``scope`` picks whose
    verdicts are returned (None: the pooled one). A scope the design does not declare is judged as its own
    family and its verdicts are flagged exploratory."""
    tasks = sorted(set(records["task"])) if "task" in records else []
    want = scope or POOLED
    if design.scopes and want in design.scopes and (want == POOLED or want in tasks):
        scopes, exploratory = [sc for sc in design.scopes if sc == POOLED or sc in tasks], False
    else:
        scopes, exploratory = [want], bool(design.scopes)
        if want != POOLED:
            records = records[records["task"] == want]

    def part(recs: pd.DataFrame, sc: str) -> pd.DataFrame:
        return recs if sc == POOLED else recs[recs["task"] == sc]

    index = sequential.context_index(records, design.first_context)  # parsed once, not once per look
    # A member dropped from the sweep once decided holds records to its last look only: the study's looks are
    # the baseline's and the members' still sampled, and a dropped member's hypotheses are not tested after it.
    ended = sequential.stopped(records, design, strategies, baseline, index)
    last = sequential.complete_looks(records, design, [*(s for s in strategies if s not in ended), baseline], index)
    looks = [sequential.at_look(records, design, j, index) for j in range(1, last + 1)]  # each look's records, once
    per_look = [{(sc, s): c for sc in scopes for s in strategies
                 if ended.get(s, j) >= j and (c := compare(part(at, sc), s, baseline)) is not None}
                for j, at in enumerate(looks, start=1)]
    current = {}
    for look in per_look:  # each hypothesis's latest look: a dropped member's is its last sampled one
        current.update(look)
    if not per_look:
        current = {(sc, s): c for sc in scopes for s in strategies
                   if (c := compare(part(records, sc), s, baseline)) is not None}
    key = "\t".join
    if design.statistic == scoretest.NAME:  # the registered statistic, not the intervals' p-values
        tests = [{key((sc, s)): t for sc in scopes for s in strategies if ended.get(s, j) >= j
                  and (t := score(part(at, sc), s, baseline, margin))}
                 for j, at in enumerate(looks, start=1)]
        ph = [{h: t.p_holds for h, t in look.items()} for look in tests]
        pf = [{h: t.p_fails for h, t in look.items()} for look in tests]
    else:
        tests = []
        ph = [{key(h): c.p_greater(-margin) for h, c in look.items()} for look in per_look]
        pf = [{key(h): c.p_less(-margin) for h, c in look.items()} for look in per_look]
    # The p-values shown are the ones the levels judge: the registered statistic's at the hypothesis's own last
    # look (the intervals' p where no statistic is registered, or it has none).
    registered = {key(k): (t.p_holds, t.p_fails) for k in current
                  if (own := ended.get(k[1], last)) and (t := tests[own - 1].get(key(k)) if tests else None)}

    def shown(h: str, c: Comparison) -> tuple[float, float]:
        return registered.get(h, (c.p_greater(-margin), c.p_less(-margin)))

    def judge(ph: list, pf: list) -> tuple:
        shares: list[dict[str, float]] = []  # each look's share of alpha per open hypothesis (holds direction)
        if design.multiplicity == "gatekeeping" and len(scopes) > 1:
            weights, trans = sequential.gatekeeping_graph(scopes, list(strategies), lambda sc, s: key((sc, s)))
            held, open_held = sequential.graph_through_looks(ph, alpha, design, weights, trans, shares)
            failed, open_failed = sequential.graph_through_looks(pf, alpha, design, weights, trans)
        else:
            held = sequential.holm_through_looks(ph, alpha, design, shares)
            failed = sequential.holm_through_looks(pf, alpha, design)
            open_held = open_failed = None
        return held, open_held, failed, open_failed, shares

    held, open_held, failed, open_failed, shares = judge(ph, pf)
    futile: dict[str, tuple[int, float, float]] = {}
    while design.futility > 0:
        # A hypothesis stopped for futility at look j is not tested after it (its sampling stopped there), so it
        # passes no alpha on later; re-judge without its later looks until no new stop appears.
        found = _futility(ph, pf, shares, held, failed, design, len(tasks))
        new = sorted((v[0], h) for h, v in found.items() if h not in futile)
        if not new:
            break
        j, h = new[0]  # the earliest stop first: removing it can change what later looks decide
        futile[h] = found[h]
        for look in (*ph[j:], *pf[j:]):
            look.pop(h, None)
        held, open_held, failed, open_failed, shares = judge(ph, pf)
    if not exploratory:
        _refuse_undecided_drops(ended, scopes, held, failed, futile, design, last)
    out = []
    for (sc, s), c in current.items():
        if sc != want:
            continue
        h = key((sc, s))
        own = ended.get(s, last)
        base = dict(look=own, n_looks=design.n_looks, contexts=design.contexts(own) if own else 0,
                    spending=design.spending_name, exploratory=exploratory)
        if s in ended and not (h in futile or h in held or h in failed):
            # Dropped once its gate (the pooled hypothesis) was decided: this scope stays as its last look left it.
            note = Look(**base, stopped_at=own)
            out.append(NonInferiority(c, margin, *shown(h, c), float("nan"),
                                      float("nan"), len(current), UNDETERMINED, note))
            continue
        if h in futile:  # sampling stopped there: a later crossing does not count
            at, share, bound = futile[h]
            note = Look(**base, decided_at=at, level=bound, share=share, p_decided=ph[at - 1][h], futile=True)
            out.append(NonInferiority(c, margin, *shown(h, c), float("nan"),
                                      float("nan"), len(current), FUTILE, note))
            continue
        if h in held or h in failed:
            (at, share), ps = (held[h], ph) if h in held else (failed[h], pf)
            level = sequential.nominal_level(share, design, at)
            note = Look(**base, decided_at=at, level=level, share=share, p_decided=ps[at - 1][h],
                        charged=design.is_charged(at))
            verdict = HOLDS if h in held else FAILS
            sens = _sensitivity(per_look[at - 1].get((sc, s)), ps[at - 1][h], level, margin, h in held)
        else:
            # The direction the estimate points to sets the share shown (each direction runs its own Holm).
            rejected, shares = (held, open_held) if c.estimate > -margin else (failed, open_failed)
            share = (shares[h] if shares is not None else
                     alpha / max(len(current) - sum(1 for n in current if key(n) in rejected), 1))
            level = sequential.nominal_level(share, design, last) if last and share > 0 else float("nan")
            repeated = (float("nan"), float("nan"))
            registered_test = tests[last - 1].get(h) if tests and last else None
            if registered_test is not None and not math.isnan(level):
                # the registered statistic inverted at the look's level: the interval its p's are judged by
                lo, hi = registered_test.interval(level)
                repeated = (c.scale * lo, c.scale * hi)
            elif last and c.test is not None and not math.isnan(level):
                lo, hi = c.test.interval(1 - 2 * level)
                repeated = (c.scale * lo, c.scale * hi)
            note = Look(**base, level=level, share=share, repeated=repeated,
                        final_level=sequential.nominal_level(share, design, design.n_looks) if share > 0
                        else float("nan"))
            verdict = UNDETERMINED
            up = c.estimate > -margin
            sens = _sensitivity(c, shown(h, c)[0 if up else 1], level, margin, up)
        out.append(NonInferiority(c, margin, *shown(h, c), float("nan"), float("nan"),
                                  len(current), verdict, note, sens))
    return out


def _refuse_undecided_drops(ended: Mapping[str, int], scopes: Sequence[str], held: Mapping, failed: Mapping,
                            futile: Mapping, design: sequential.Design, last: int) -> None:
    """One :class:`KVBenchError` when a member left the sweep before its verdict was final: its gate (the pooled
    hypothesis; without one, every scope's) must be held, failed or stopped for futility at or before the last
    look it was sampled to (docs/confirm.md), or the looks after it would judge the others without it."""
    for s, k in sorted(ended.items()):
        gate = ["\t".join((sc, s)) for sc in scopes if sc == POOLED] or ["\t".join((sc, s)) for sc in scopes]
        open_ = [h.split("\t")[0] for h in gate if not any(h in d and d[h][0] <= k for d in (held, failed, futile))]
        if open_:
            raise KVBenchError(
                f"{s} has no records after look {k} ({design.contexts(k)} contexts per task) while the study holds "
                f"look {last}, but its verdict ({', '.join(open_)}) was not final at look {k}: a member leaves the "
                "sweep only once decided (docs/confirm.md) — run its later contexts")


def score(records: pd.DataFrame, a: str, b: str, margin: float = MARGIN_PP) -> scoretest.ScoreTest | None:
    """The registered score statistic (:mod:`kvbench.scoretest`) of ``a`` against ``b`` at ``−margin`` points,
    clustered as every comparison is (connected components of shared works); None without shared binary
    questions."""
    both = _pair(records, a, b, ["score"])
    if both.empty:
        return None
    sa, sb = both["score_a"].to_numpy(float), both["score_b"].to_numpy(float)
    if not (stats.is_binary(sa) and stats.is_binary(sb)):
        return None
    return scoretest.score_test(sa, sb, list(both["_doc"]), margin / 100)


def _futility(ph: Sequence[Mapping[str, float]], pf: Sequence[Mapping[str, float]],
              shares: Sequence[Mapping[str, float]], held: Mapping, failed: Mapping, design: sequential.Design,
              n_tasks: int) -> dict[str, tuple[int, float, float]]:
    """Hypotheses stopped for futility: at the first look where one is still open in both directions, holds a
    share of alpha, and its holds statistic (as a z: the one-sided p's normal quantile) falls below the design's
    futility boundary for that share (:func:`kvbench.sequential.futility_boundaries`; a task scope's expected z
    is the pooled one's times sqrt(1 / tasks)). Returns each one's (look, share, boundary as a one-sided p)."""
    out: dict[str, tuple[int, float, float]] = {}
    for j, (ps, share_j) in enumerate(zip(ph, shares, strict=True), start=1):
        for h, p in ps.items():
            decided = (h in held and held[h][0] <= j) or (h in failed and failed[h][0] <= j)
            share = share_j.get(h, 0.0)
            if h in out or decided or share <= 0 or math.isnan(p):
                continue
            drift = design.drift * (1.0 if h.split("\t")[0] == POOLED else math.sqrt(1 / max(n_tasks, 1)))
            bound = sequential.futility_boundaries(share, design.fractions, design.spending, design.futility,
                                                   drift)[j - 1]
            if float(sps.norm.isf(p)) < bound:
                out[h] = (j, share, float(sps.norm.sf(bound)))
    return out


def identical_scores(records: pd.DataFrame, strategies: Sequence[str]) -> list[list[str]]:
    """Groups (of two or more) of ``strategies`` whose score vectors on ``records`` are identical question
    for question: they tie, whatever their names."""
    vectors: dict[tuple, list[str]] = {}
    for s in strategies:
        rows = records[records["strategy"] == s].sort_values(["task", "sample_id"], kind="mergesort")
        if rows.empty:
            continue
        key = tuple(zip(rows["task"], rows["sample_id"], rows["score"].round(12), strict=True))
        vectors.setdefault(key, []).append(s)
    return [sorted(v) for v in vectors.values() if len(v) > 1]
