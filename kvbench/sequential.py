"""Group-sequential verdicts: a sweep that is analysed while it grows (measurement spec v1.2 §2.5).

The claim-focused sweeps (``kvbench sweep headline``) add contexts in rounds, and their claim check is
published between rounds. Judging every publication at the fixed-sample level would test the same claim
again and again and stop at the first crossing — the classic repeated-significance error (Armitage,
McPherson & Rowe 1969, JRSS-A 132:235-244): five looks at a nominal 2.5% give a one-sided error near 7%.
So a sweep file that declares a ``design`` is judged as a group-sequential trial:

* **looks** are fixed before any data: look *j* is the first ``j × look_every`` contexts of every task
  (contexts are generated in index order, so a look is a prefix of the store, whatever was published);
  the last look is the planned ``task.n_samples``. The information fraction of look *j* is its share of
  the planned contexts.
* **boundaries** come from an alpha-spending function (Lan & DeMets 1983, *Discrete sequential boundaries
  for clinical trials*, Biometrika 70:659-663): O'Brien-Fleming-type by default — almost nothing is spent
  early, so the last look's boundary stays close to the fixed-sample one — or Pocock-type. The boundary of
  each look is computed exactly for the looks' correlation (the score process has independent increments)
  by the recursive numerical integration of Jennison & Turnbull (2000), *Group Sequential Methods with
  Applications to Clinical Trials*, ch. 19.
* **multiplicity** within a claim's family is Holm's procedure carried through the looks (Maurer & Bretz
  2013, *Multiple testing in group sequential trials using graphical approaches*, Stat. Biopharm. Res.
  5:311-320): each hypothesis is tested at the boundaries of its current share of alpha; a rejection (at
  any look) passes its share on to the rest, which are re-tested at once at their larger level.

The p-values are the ones the fixed-sample verdicts use (:mod:`kvbench.paired`), compared with each look's
nominal level (the one-sided tail beyond its boundary) instead of alpha. A design with one look is the
fixed-sample test exactly.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import optimize
from scipy import stats as sps

from kvbench.errors import KVBenchError

#: Spending functions by name: the alpha spent by information fraction ``t`` at one-sided level ``a``.
SPENDING: dict[str, Callable[[float, float], float]] = {
    # Lan & DeMets (1983) eq. 3: reproduces O'Brien & Fleming's (1979) boundaries.
    "obrien-fleming": lambda a, t: 2 * float(sps.norm.sf(sps.norm.isf(a / 2) / math.sqrt(t))),
    # Lan & DeMets (1983): approximately Pocock's (1977) constant boundaries.
    "pocock": lambda a, t: a * math.log(1 + (math.e - 1) * t),
}
DEFAULT_SPENDING = "obrien-fleming"
_GRID = 1201  # points of the score-density grid per look: boundaries agree with published ones to ~1e-4


@dataclass(frozen=True)
class Design:
    """A sweep's pre-registered looks: every ``look_every`` contexts per task, up to ``planned_contexts``."""

    planned_contexts: int
    look_every: int
    spending: str = DEFAULT_SPENDING
    # Looks published before the design was registered (contexts per task), charged to the spending: they are
    # looks of the schedule like the planned ones, so their information fractions spend alpha too (spec §2.6).
    charged: tuple[int, ...] = ()
    # Scopes tested as one family (spec §2.6): "pooled" and/or task names, Holm over every (scope, strategy)
    # hypothesis through the looks. Empty: each scope is its own family (the fixed-sample claim check's rule).
    scopes: tuple[str, ...] = ()
    # Where the design file was registered (kvbench.registration: file, content hash, commit) and, for a design
    # declared after the data, its stated reason; "" for a sweep file's design block.
    # How the scopes' hypotheses share alpha: "holm" (every hypothesis alike) or "gatekeeping" (the first scope's
    # hypotheses hold all of it; a rejection passes its share to the same strategy in the later scopes).
    multiplicity: str = "holm"
    # The test statistic the p-values come from (``kvbench.scoretest.NAME``, or "" for the fixed-sample claim
    # check's interval-based p-values) and a non-binding futility boundary (Jennison & Turnbull 2000, §7.2:
    # beta spent by the same spending function under the planned alternative, whose expected z at full
    # information for the pooled scope is ``drift``); futility 0: none.
    statistic: str = ""
    futility: float = 0.0
    drift: float = float("nan")
    # The family's members by label, declared before the data (a confirmatory design); (): the memory band decides.
    members: tuple[str, ...] = ()
    # The number of the design's first context (its ``samples.first_context``): a record's place in the design is
    # its context number less this, whichever run wrote it. None: the records' own ``index`` (a run's count from
    # its first sample), for designs that name no sample range.
    first_context: int | None = None
    registered: str = field(default="", compare=False)
    post_hoc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.spending not in SPENDING:
            raise KVBenchError(f"unknown spending function {self.spending!r}; valid: {', '.join(SPENDING)}")
        for name in ("planned_contexts", "look_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise KVBenchError(f"design {name} must be an integer >= 1 (got {v!r})")
        if self.multiplicity not in ("holm", "gatekeeping"):
            raise KVBenchError(f"design multiplicity must be holm or gatekeeping (got {self.multiplicity!r})")
        for v in self.charged:
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < self.planned_contexts:
                raise KVBenchError(f"design: an earlier look must be a context count in 1..{self.planned_contexts - 1}"
                                   f" (got {v!r})")

    @property
    def planned_looks(self) -> tuple[int, ...]:
        """Contexts per task of the pre-registered looks."""
        n = math.ceil(self.planned_contexts / self.look_every)
        return tuple(min(j * self.look_every, self.planned_contexts) for j in range(1, n + 1))

    @property
    def looks(self) -> tuple[int, ...]:
        """Contexts per task of every look the spending pays for: the pre-registered ones and the charged ones."""
        return tuple(sorted(set(self.planned_looks) | set(self.charged)))

    @property
    def n_looks(self) -> int:
        return len(self.looks)

    def contexts(self, look: int) -> int:
        """Contexts per task in look ``look`` (1-based)."""
        return self.looks[look - 1]

    def is_charged(self, look: int) -> bool:
        """Look ``look`` is an earlier published look, not a pre-registered one."""
        return self.contexts(look) in self.charged and self.contexts(look) not in self.planned_looks

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(c / self.planned_contexts for c in self.looks)

    @property
    def spending_name(self) -> str:
        return {"obrien-fleming": "O'Brien–Fleming", "pocock": "Pocock"}[self.spending]

    def describe(self) -> str:
        planned = (f"one every {self.look_every} contexts per task up to the planned {self.planned_contexts}, "
                   f"{self.spending_name}-type alpha spending (Lan–DeMets)")
        if self.charged:
            early = ", ".join(str(c) for c in self.charged)
            return (f"{self.n_looks} looks: {len(self.planned_looks)} pre-registered ({planned}) and "
                    f"{len(self.charged)} published before the design was registered ({early} contexts per task), "
                    f"charged to the same spending at their information fractions; {self.rule} through the looks")
        tail = ""
        if self.statistic:
            tail += (f"; statistic {self.statistic} (Tango's paired score test, cluster-robust design effect, "
                     "t reference)")
        if self.futility > 0:
            tail += (f"; a non-binding futility boundary (beta {self.futility:g} spent {self.spending_name}-type under "
                     f"the planning alternative, expected pooled z {self.drift:.2f} at the planned n)")
        return f"{self.n_looks} looks, {planned}, {self.rule} through the looks{tail}"

    @property
    def rule(self) -> str:
        """The multiple test carried through the looks, in words."""
        return "Holm" if self.multiplicity == "holm" else "the gatekeeping graph"

    @classmethod
    def from_mapping(cls, data: Mapping, planned: int | None) -> Design:
        """From a sweep file's ``design:`` block; ``planned`` is the file's ``task.n_samples``."""
        if not isinstance(data, Mapping):
            raise KVBenchError("design must map look_every (and optionally spending) to values")
        unknown = sorted(set(data) - {"look_every", "spending"})
        if unknown:
            raise KVBenchError(f"design: unknown key {', '.join(unknown)}; valid: look_every, spending")
        if planned is None:
            raise KVBenchError("design needs the planned contexts per task: set task.n_samples in overrides")
        return cls(planned, data.get("look_every"), str(data.get("spending", DEFAULT_SPENDING)))


# ----------------------------------------------------------------------------------------------- boundaries


@functools.lru_cache(maxsize=256)
def boundaries(alpha: float, fractions: tuple[float, ...], spending: str = DEFAULT_SPENDING) -> tuple[float, ...]:
    """Upper z boundaries, one per look at information ``fractions`` (increasing, last <= 1), whose
    crossing probabilities under the null add up, look by look, to the spent alpha (one-sided ``alpha``).

    Z_j = S(t_j)/sqrt(t_j) with S a standard Brownian motion; the sub-density of S at each look on the
    continuation region is carried to the next look by convolution with the increment's normal density
    (Jennison & Turnbull 2000, §19.2), on a grid that ends exactly at the boundary.
    """
    t = np.asarray(fractions, dtype=float)
    if t.size == 0 or np.any(np.diff(t) <= 0) or t[0] <= 0 or t[-1] > 1 + 1e-12:
        raise ValueError(f"information fractions must increase within (0, 1]: {fractions}")
    spend = SPENDING[spending]
    cum = np.array([spend(alpha, float(x)) for x in t])
    inc = np.diff(np.concatenate([[0.0], cum]))
    out = [float(sps.norm.isf(inc[0])) if inc[0] > 0 else math.inf]
    low = -12.0 * math.sqrt(t[-1])  # below this the continuation density is negligible
    s = np.linspace(low, min(out[0], 40.0) * math.sqrt(t[0]), _GRID)
    dens = sps.norm.pdf(s / math.sqrt(t[0])) / math.sqrt(t[0])
    for k in range(1, len(t)):
        sd = math.sqrt(t[k] - t[k - 1])
        w = np.full(len(s), s[1] - s[0])
        w[[0, -1]] /= 2
        mass = w * dens  # trapezoid weights times the sub-density: the continuation probability per node
        root_t, target = math.sqrt(t[k]), inc[k]

        def excess(c: float, s: np.ndarray = s, mass: np.ndarray = mass, sd: float = sd, root_t: float = root_t,
                   target: float = target) -> float:
            """P(continue to the previous look, then Z_k >= c) minus the alpha this look spends."""
            return float(np.sum(mass * sps.norm.sf((c * root_t - s) / sd))) - target

        if target <= 0 or excess(40.0) >= 0:
            c = math.inf if target <= 0 else 40.0
        else:
            c = float(optimize.brentq(excess, -20.0, 40.0, xtol=1e-10))
        out.append(c)
        u = np.linspace(low, min(c, 40.0) * math.sqrt(t[k]), _GRID)
        dens = mass @ (sps.norm.pdf((u[None, :] - s[:, None]) / sd) / sd)
        s = u
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def futility_boundaries(share: float, fractions: tuple[float, ...], spending: str, beta: float,
                        drift: float) -> tuple[float, ...]:
    """Lower (futility) z boundaries, one per look: under the alternative (``Z_k ~ N(drift sqrt(t_k), 1)``
    jointly) the probability of stopping below them, look by look, adds up to the spent ``beta``, with the
    efficacy boundaries of ``share`` in place. Non-binding: the efficacy boundaries ignore them (so alpha is
    kept whether or not a trial stops at them). The last look's equals its efficacy boundary, so every hypothesis
    ends decided: above it holds, below it is stopped for futility. Each capped at the efficacy boundary."""
    t = np.asarray(fractions, dtype=float)
    upper = boundaries(share, fractions, spending)
    spend = SPENDING[spending]
    inc = np.diff(np.concatenate([[0.0], [spend(beta, float(x)) for x in t]]))
    out = [min(float(sps.norm.ppf(inc[0]) + drift * math.sqrt(t[0])) if inc[0] > 0 else -math.inf, upper[0])]
    if len(t) == 1:
        return (upper[0],)

    def grid(k: int, low: float) -> np.ndarray:
        """Nodes of S = Z sqrt(t) on look k's continuation region (below 12 sd under its mean: negligible)."""
        floor = drift * t[k] - 12 * math.sqrt(t[k])
        return np.linspace(max(low, floor), min(upper[k], 40.0) * math.sqrt(t[k]), _GRID)

    s = grid(0, out[0] * math.sqrt(t[0]))
    dens = sps.norm.pdf((s - drift * t[0]) / math.sqrt(t[0])) / math.sqrt(t[0])
    for k in range(1, len(t)):
        dt = t[k] - t[k - 1]
        sd = math.sqrt(dt)
        w = np.full(len(s), s[1] - s[0])
        w[[0, -1]] /= 2
        mass = w * dens
        root_t, target, mean = math.sqrt(t[k]), inc[k], drift * dt

        def below(a: float, s: np.ndarray = s, mass: np.ndarray = mass, sd: float = sd, root_t: float = root_t,
                  target: float = target, mean: float = mean) -> float:
            """P(continue to the previous look, then Z_k < a) under the alternative, minus this look's beta."""
            return float(np.sum(mass * sps.norm.cdf((a * root_t - s - mean) / sd))) - target

        if k == len(t) - 1:
            a = upper[k]
        elif target <= 0 or below(-20.0) >= 0:
            a = -math.inf if target <= 0 else -20.0
        elif below(min(upper[k], 40.0)) <= 0:
            a = upper[k]
        else:
            a = min(float(optimize.brentq(below, -20.0, min(upper[k], 40.0), xtol=1e-10)), upper[k])
        out.append(a)
        if k == len(t) - 1 or a >= upper[k]:
            out.extend(upper[k + 1:])
            break
        u = grid(k, a * root_t)
        dens = mass @ (sps.norm.pdf((u[None, :] - s[:, None] - mean) / sd) / sd)
        s = u
    return tuple(out)


def power(share: float, fractions: tuple[float, ...], spending: str, beta: float, drift: float,
          resamples: int = 400_000, seed: int = 0) -> float:
    """P(crossing an efficacy boundary before a futility one) under the alternative ``drift`` — the power of the
    design with its futility boundaries obeyed. Monte Carlo over Brownian paths (fixed seed), independent of the
    recursion that computes the boundaries."""
    t = np.asarray(fractions, dtype=float)
    up = np.asarray(boundaries(share, fractions, spending))
    low = np.asarray(futility_boundaries(share, fractions, spending, beta, drift)) if beta > 0 else \
        np.concatenate([np.full(len(t) - 1, -np.inf), up[-1:]])
    rng = np.random.default_rng(seed)
    z = (np.cumsum(rng.standard_normal((resamples, t.size)) * np.sqrt(np.diff(np.concatenate([[0.0], t]))), axis=1)
         + drift * t) / np.sqrt(t)
    hit_up, hit_low = z >= up, z < low
    first_up = np.where(hit_up.any(1), hit_up.argmax(1), t.size)
    first_low = np.where(hit_low.any(1), hit_low.argmax(1), t.size)
    return float(np.mean(first_up <= first_low))


def drift_for_power(target: float, share: float, fractions: tuple[float, ...], spending: str,
                    beta: float) -> float:
    """The expected z at full information that gives ``target`` power under the design (bisection on
    :func:`power`, common random numbers)."""
    lo, hi = 0.5, 10.0
    for _ in range(24):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power(share, fractions, spending, beta, mid, resamples=100_000) < target else (lo, mid)
    return hi


def nominal_level(alpha: float, design: Design, look: int) -> float:
    """The one-sided p a hypothesis at level ``alpha`` must be below at look ``look`` (1-based)."""
    c = boundaries(alpha, design.fractions, design.spending)[look - 1]
    return float(sps.norm.sf(c))


# ------------------------------------------------------------------------------------------------- looks


def context_index(records: pd.DataFrame, first_context: int | None = None) -> pd.Series:
    """Each record's context index within its task; -1 where it cannot be read.

    With ``first_context`` (a design's ``samples.first_context``): the trailing number of ``context_id``
    (``legal/retrieval/1057``) less it, so a run that continues the design from a later context (members dropped
    once decided: another run) places its records where they belong. Without: ``sample_meta["index"]`` (a run's
    count from its first sample), else that trailing number."""
    out = []
    metas = records["sample_meta"] if "sample_meta" in records else [None] * len(records)
    ctxs = records["context_id"] if "context_id" in records else [None] * len(records)
    for meta, ctx in zip(metas, ctxs, strict=True):
        idx = None
        number = re.search(r"(\d+)$", ctx) if isinstance(ctx, str) else None
        if first_context is not None:
            idx = int(number.group(1)) - first_context if number else None
        else:
            if isinstance(meta, str):
                try:
                    idx = json.loads(meta).get("index")
                except (ValueError, AttributeError):
                    idx = None
            if not isinstance(idx, int) and number:
                idx = int(number.group(1))
        out.append(idx if isinstance(idx, int) and idx >= 0 else -1)
    return pd.Series(out, index=records.index, dtype=int)


def complete_looks(records: pd.DataFrame, design: Design, strategies: Sequence[str],
                   index: pd.Series | None = None) -> int:
    """The last look every task in ``records`` has complete for every one of ``strategies``: each task has
    every context below the look's count, for each strategy (0: not even the first). ``index``:
    :func:`context_index` of ``records`` when the caller has it."""
    if records.empty:
        return 0
    idx = context_index(records, design.first_context) if index is None else index
    done = design.n_looks
    for task in records["task"].unique():
        for s in strategies:
            have = set(idx[(records["task"] == task) & (records["strategy"] == s)])
            prefix = 0
            while prefix in have:
                prefix += 1
            done = min(done, max((j for j in range(1, design.n_looks + 1) if design.contexts(j) <= prefix),
                                 default=0))
    return done


def stopped(records: pd.DataFrame, design: Design, members: Sequence[str], baseline: str,
            index: pd.Series | None = None) -> dict[str, int]:
    """Members whose sampling stopped before the study's look (each one's last complete look).

    The baseline is sampled to the end: its last complete look L is where the study can be. A member stopped
    when, in no task, it holds the last context of look L while its own last complete look is earlier: it left
    the sweep (docs/confirm.md: only once its verdict is final; the judge checks that), whatever it measured
    past its own look before leaving. A member that reaches look L's last context somewhere is still being
    sampled, and a gap in it holds the study's look back, as before."""
    if records.empty:
        return {}
    idx = context_index(records, design.first_context) if index is None else index
    look = complete_looks(records, design, [baseline], idx)  # 0 without the baseline's records
    if not look:
        return {}
    out = {}
    for s in members:
        mine = records["strategy"] == s
        if not mine.any():
            continue
        reach = complete_looks(records, design, [s], idx)  # every task of the records, its own or not
        if reach < look and not bool((idx[mine] >= design.contexts(look) - 1).any()):
            out[s] = reach
    return out


def at_look(records: pd.DataFrame, design: Design, look: int, index: pd.Series | None = None) -> pd.DataFrame:
    """The records of look ``look``: every task's contexts below its count (``index`` as in
    :func:`complete_looks`)."""
    idx = context_index(records, design.first_context) if index is None else index
    return records[idx.between(0, design.contexts(look) - 1)]


# --------------------------------------------------------------------------------------------- Holm x looks


def holm_through_looks(pvalues: Sequence[Mapping[str, float]], alpha: float, design: Design,
                       shares: list | None = None) -> dict[str, tuple[int, float]]:
    """Each rejected hypothesis's look (1-based) and the share of ``alpha`` it was rejected at;
    ``pvalues[j]`` are look j+1's.

    Holm as a graph (Maurer & Bretz 2013): every unrejected hypothesis holds ``alpha`` / (unrejected count);
    at each look the smallest p is tested at its level's boundary for that look, and each rejection shares
    its alpha out and re-tests at once. A rejected hypothesis stays rejected.
    """
    names = sorted({h for ps in pvalues for h in ps})
    rejected: dict[str, tuple[int, float]] = {}
    for j, ps in enumerate(pvalues, start=1):
        while True:
            open_ = [h for h in names if h not in rejected]
            testable = [h for h in open_ if h in ps and not math.isnan(ps[h])]
            if not testable:
                break
            h = min(testable, key=lambda n: (ps[n], n))
            if ps[h] < nominal_level(alpha / len(open_), design, j):
                rejected[h] = (j, alpha / len(open_))
                continue
            break
        if shares is not None:  # what each open hypothesis holds after this look's rejections
            open_ = [h for h in names if h not in rejected]
            shares.append({h: alpha / len(open_) for h in open_})
    return rejected


def graph_through_looks(pvalues: Sequence[Mapping[str, float]], alpha: float, design: Design,
                        weights: Mapping[str, float], transitions: Mapping[str, Mapping[str, float]],
                        shares: list | None = None) -> tuple[dict[str, tuple[int, float]], dict[str, float]]:
    """A graphical multiple test through the looks (Bretz, Maurer, Brannath & Posch 2009, *A graphical approach
    to sequentially rejective multiple test procedures*, Stat Med 28:586-604, algorithm 1; through group-sequential
    looks, Maurer & Bretz 2013): hypothesis h holds ``alpha x weights[h]`` and is tested at that share's boundary
    at each look; a rejection passes its weight along ``transitions`` (rows summing to at most 1) and the graph is
    updated, the rest re-tested at once. Returns each rejected hypothesis's (look, share) and every open
    hypothesis's final share. Holm is the complete graph with equal weights (:func:`holm_through_looks`)."""
    w = {h: float(v) for h, v in weights.items()}
    g = {h: {k: float(x) for k, x in transitions.get(h, {}).items() if k in w and k != h} for h in w}
    rejected: dict[str, tuple[int, float]] = {}
    for j, ps in enumerate(pvalues, start=1):
        while True:
            ok = [h for h in w if h not in rejected and w[h] > 0 and h in ps and not math.isnan(ps[h])
                  and ps[h] < nominal_level(alpha * w[h], design, j)]
            if not ok:
                break
            h = min(ok, key=lambda n: (ps[n], n))
            rejected[h] = (j, alpha * w[h])
            rest = [x for x in w if x not in rejected]
            new_w = {x: w[x] + w[h] * g[h].get(x, 0.0) for x in rest}
            new_g = {}
            for x in rest:
                den = 1 - g[x].get(h, 0.0) * g[h].get(x, 0.0)
                new_g[x] = {k: (g[x].get(k, 0.0) + g[x].get(h, 0.0) * g[h].get(k, 0.0)) / den if den > 1e-12 else 0.0
                            for k in rest if k != x}
            w = {**{x: 0.0 for x in w}, **new_w}
            g = {**{x: {} for x in g}, **new_g}
        if shares is not None:  # each open hypothesis's share after this look's rejections
            shares.append({h: alpha * v for h, v in w.items() if h not in rejected})
    return rejected, {h: alpha * v for h, v in w.items() if h not in rejected}


def gatekeeping_graph(scopes: Sequence[str], strategies: Sequence[str],
                      key: Callable[[str, str], str]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The design's gatekeeping order as a graph: the first scope's hypotheses share alpha equally; rejecting
    (first scope, s) passes its share evenly to s in every later scope, and a later scope's rejection passes
    its share to s's remaining later-scope hypotheses."""
    first, later = scopes[0], list(scopes[1:])
    weights = {key(sc, s): (1 / len(strategies) if sc == first else 0.0) for sc in scopes for s in strategies}
    trans: dict[str, dict[str, float]] = {}
    for s in strategies:
        trans[key(first, s)] = {key(t, s): 1 / len(later) for t in later} if later else {}
        for t in later:
            others = [u for u in later if u != t]
            trans[key(t, s)] = {key(u, s): 1 / len(others) for u in others} if others else {}
    return weights, trans


def published_error(share: float, design: Design, resamples: int = 1_000_000, seed: int = 0) -> float:
    """One-sided error of the looks as they were actually published, for a hypothesis at ``share``: the charged
    looks at the fixed-sample level ``share`` (how they were judged then), the pre-registered looks at the
    design's boundaries for ``share`` without the charged looks. Monte Carlo over ``resamples`` standard Brownian
    paths (fixed seed), which needs no assumption the boundary computation makes."""
    plain = Design(design.planned_contexts, design.look_every, design.spending)
    z_plan = dict(zip(plain.looks, boundaries(share, plain.fractions, plain.spending), strict=True))
    z_fixed = float(sps.norm.isf(share))
    bounds = np.array([z_fixed if c in design.charged and c not in z_plan else z_plan[c] for c in design.looks])
    t = np.asarray(design.fractions)
    rng = np.random.default_rng(seed)
    crossed = 0
    for start in range(0, resamples, 100_000):
        n = min(100_000, resamples - start)
        steps = rng.standard_normal((n, t.size)) * np.sqrt(np.diff(np.concatenate([[0.0], t])))
        z = np.cumsum(steps, axis=1) / np.sqrt(t)
        crossed += int(np.any(z >= bounds, axis=1).sum())
    return crossed / resamples
