"""The committed headline's verdicts, recomputed from its raw records through a second, independent code path.

Nothing here imports kvbench: the records are read with pandas, the design with yaml, and every step the claim
check took is re-implemented from its reference — clusters as connected components of shared source works,
the cluster-robust (CR1) design effect of the paired differences, Newcombe's (1998, method 10) paired interval
on Rao-Scott effective counts, one-sided p-values by inverting it, Lan-DeMets O'Brien-Fleming boundaries by
its own numerical integration (a different grid and rule from kvbench.sequential's), and the design's multiple
test as a graph updated by Bretz et al.'s (2009) algorithm 1 (Holm is its complete graph) through the looks,
including the looks charged to the spending. The test then reads ``results/headline/claim_check.md`` and
checks every member's Δ, interval, n, design effect, verdict and deciding look against the recomputation.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy.stats import norm

ROOT = Path(__file__).resolve().parents[1]
HEADLINE = ROOT / "results" / "headline"
DESIGN = ROOT / "conf" / "design" / "headline.yaml"
POOLED_NAME = "all tasks at 4,096 tokens (pooled)"


# ------------------------------------------------------------------------------------------ statistics


def wilson(k: float, n: float, z: float) -> tuple[float, float]:
    p = k / n
    mid = (2 * k + z * z) / (2 * (n + z * z))
    half = z * math.sqrt(max(n * p * (1 - p), 0.0) + z * z / 4) / (n + z * z)
    return max(mid - half, 0.0), min(mid + half, 1.0)


def newcombe10(a: float, b: float, c: float, d: float, level: float) -> tuple[float, float]:
    """a both correct, b only strategy, c only baseline, d neither (possibly fractional); strategy − baseline."""
    n = a + b + c + d
    z = norm.isf((1 - level) / 2)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    den = (a + b) * (c + d) * (a + c) * (b + d)
    num = a * d - b * c
    num = num - n / 2 if num > n / 2 else (0.0 if num >= 0 else num)
    phi = 0.0 if den == 0 else num / math.sqrt(den)
    diff = p1 - p2
    lo = diff - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = diff + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return max(lo, -1.0), min(hi, 1.0)


def interval(cells: tuple[float, ...], level: float) -> tuple[float, float]:
    """Newcombe's interval, widened where the arms never disagree to the exact zero-flip bound at the effective n."""
    lo, hi = newcombe10(*cells, level)
    if cells[1] == 0 and cells[2] == 0:
        bound = 1 - ((1 - level) / 2) ** (1 / sum(cells))
        lo, hi = min(lo, -bound), max(hi, bound)
    return max(lo, -1.0), min(hi, 1.0)


def one_sided_p(cells: tuple[float, ...], null: float, upper_tail: bool) -> float:
    """p of H0 (diff <= null when upper_tail, else diff >= null): the (1 − L)/2 where the level-L bound meets null."""
    def gap(level: float) -> float:
        lo, hi = interval(cells, level)
        return (lo - null) if upper_tail else (null - hi)

    a, b = 1e-9, 1 - 1e-12
    if gap(a) <= 0:
        return 1.0
    if gap(b) > 0:
        return (1 - b) / 2
    for _ in range(60):  # bisection: the bound moves monotonically with the level
        m = (a + b) / 2
        a, b = (m, b) if gap(m) > 0 else (a, m)
    return (1 - (a + b) / 2) / 2


def cr1_deff(x: np.ndarray, groups: np.ndarray) -> float:
    n = len(x)
    e = x - x.mean()
    labels, inv = np.unique(groups, return_inverse=True)
    g = len(labels)
    if g < 2 or not np.any(e):
        return float("nan")
    sums = np.zeros(g)
    np.add.at(sums, inv, e)
    v_cr = g / (g - 1) * float((sums**2).sum()) / n**2
    v_iid = float((e**2).sum()) / (n * (n - 1))
    return v_cr / v_iid


def obf_levels(alpha: float, t: list[float]) -> list[float]:
    """Nominal one-sided levels of the Lan-DeMets O'Brien-Fleming boundaries at fractions ``t``: the density of
    the score S(t) on the continuation region carried look to look on a uniform midpoint grid."""
    spent = [2 * norm.sf(norm.isf(alpha / 2) / math.sqrt(x)) for x in t]
    inc = np.diff([0.0, *spent])
    h = 0.01
    grid = np.arange(-9.0, 9.0, h) + h / 2  # S values (|S| <= 9 sqrt(t) covers the mass at t <= 1)
    levels, dens, prev = [], None, 0.0
    for k, tk in enumerate(t):
        if dens is None:
            c = norm.isf(inc[k]) if inc[k] > 1e-300 else math.inf
            dens = norm.pdf(grid / math.sqrt(tk)) / math.sqrt(tk)
        else:
            sd = math.sqrt(tk - prev)

            def cross(cz: float, dens: np.ndarray = dens, sd: float = sd, tk: float = tk) -> float:
                return float(np.sum(dens * h * norm.sf((cz * math.sqrt(tk) - grid) / sd)))

            if inc[k] <= 0 or cross(40.0) >= inc[k]:
                c = 40.0
            else:
                lo, hi = -20.0, 40.0
                for _ in range(100):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if cross(mid) > inc[k] else (lo, mid)
                c = (lo + hi) / 2
            dens = (dens * h) @ (norm.pdf((grid[None, :] - grid[:, None]) / sd) / sd)
        dens = np.where(grid < min(c, 40.0) * math.sqrt(tk), dens, 0.0)
        levels.append(float(norm.sf(c)))
        prev = tk
    return levels


# ------------------------------------------------------------------------------------------ records


def components(works_by_ctx: dict[str, list[str]]) -> dict[str, str]:
    """Context -> cluster: connected components of the contexts' shared works (smallest work names it)."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            x = parent[x]
        return x

    for ws in works_by_ctx.values():
        for w in ws[1:]:
            a, b = root(ws[0]), root(w)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {ctx: root(ws[0]) for ctx, ws in works_by_ctx.items()}


def load_pairs() -> pd.DataFrame:
    recs = pd.concat([pd.read_parquet(p) for p in sorted((HEADLINE / "store").glob("*.parquet"))], ignore_index=True)
    meta = recs["sample_meta"].map(lambda m: json.loads(m) if isinstance(m, str) else dict(m))
    recs = recs.assign(idx=meta.map(lambda m: int(m["index"])),
                       works=[[f"{t}:{w}" for w in dict.fromkeys(([d] if isinstance(d, str) and d else [])
                                                                   + list(m.get("source_docs") or []))]
                              for t, d, m in zip(recs["task"], recs.get("document_id"), meta, strict=True)])
    base = recs[recs["strategy"] == "full"][["task", "sample_id", "score"]]
    pairs = recs[recs["strategy"] != "full"].merge(base, on=["task", "sample_id"], suffixes=("", "_full"))
    return pairs[["task", "strategy", "sample_id", "context_id", "idx", "works", "score", "score_full"]]


def judge(pairs: pd.DataFrame, scope: str) -> dict:
    """Counts, design effect, interval and one-sided p-values of one (scope, strategy) pair frame."""
    ctx_works = {}
    for c, ws in zip(pairs["task"] + "/" + pairs["context_id"], pairs["works"], strict=True):
        ctx_works.setdefault(c, ws)
    cluster = components(ctx_works)
    groups = np.array([cluster[c] for c in pairs["task"] + "/" + pairs["context_id"]])
    s, f = pairs["score"].to_numpy(float), pairs["score_full"].to_numpy(float)
    a, b = int(((s == 1) & (f == 1)).sum()), int(((s == 1) & (f == 0)).sum())
    c, d = int(((s == 0) & (f == 1)).sum()), int(((s == 0) & (f == 0)).sum())
    diff = s - f
    # the spec's rule: the differences' CR1 design effect (2+ discordant), else the baseline's, else Kish's worst
    deff = cr1_deff(diff, groups) if np.count_nonzero(diff) >= 2 else float("nan")
    if math.isnan(deff):
        deff = cr1_deff(f, groups)
    if math.isnan(deff):
        sizes = np.unique(groups, return_counts=True)[1].astype(float)
        deff = float((sizes**2).sum() / sizes.sum())
    deff = max(1.0, deff)
    cells = tuple(v / deff for v in (a, b, c, d))
    lo, hi = interval(cells, 0.95)
    return dict(n=len(pairs), contexts=pairs["context_id"].nunique() if scope != "pooled" else
                (pairs["task"] + pairs["context_id"]).nunique(), clusters=len(set(groups)),
                delta=100 * (b - c) / len(pairs), low=100 * lo, high=100 * hi, deff=deff,
                p_holds=one_sided_p(cells, -0.01, True), p_fails=one_sided_p(cells, -0.01, False))


def graph_procedure(pvals: list[dict], alpha: float, looks_t: list[float], weights: dict, trans: dict) -> dict:
    """Bretz et al. (2009) algorithm 1 at every look, each hypothesis at its weight's O'Brien-Fleming level."""
    w, g, out, cache = dict(weights), {h: dict(trans.get(h, {})) for h in weights}, {}, {}

    def level(share: float, j: int) -> float:
        key = round(share, 15)
        if key not in cache:
            cache[key] = obf_levels(share, looks_t)
        return cache[key][j]

    for j, ps in enumerate(pvals):
        again = True
        while again:
            again = False
            for h in sorted((h for h in w if h not in out and w[h] > 0), key=lambda h: ps[h]):
                if ps[h] < level(alpha * w[h], j):
                    out[h] = (j + 1, alpha * w[h])
                    rest = [x for x in w if x not in out]
                    nw = {x: w[x] + w[h] * g[h].get(x, 0.0) for x in rest}
                    ng = {}
                    for x in rest:
                        den = 1 - g[x].get(h, 0.0) * g[h].get(x, 0.0)
                        ng[x] = {k: ((g[x].get(k, 0.0) + g[x].get(h, 0.0) * g[h].get(k, 0.0)) / den
                                     if den > 1e-12 else 0.0) for k in rest if k != x}
                    w = {x: nw.get(x, 0.0) for x in w}
                    g = {x: ng.get(x, {}) for x in g}
                    again = True
                    break
    return out


# ------------------------------------------------------------------------------------------ the claim check


def printed_members() -> dict[tuple[str, str], list[str]]:
    text = (HEADLINE / "claim_check.md").read_text()
    out, scope = {}, None
    for line in text.splitlines():
        m = re.match(r"#+ Members on (.+)$", line)
        if m:
            scope = m.group(1)
            continue
        if scope and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[(scope, cells[0].strip("`"))] = cells
        elif scope and line.startswith("#"):
            scope = None
    return out


@pytest.mark.skipif(not (HEADLINE / "store").is_dir() or not DESIGN.is_file(), reason="no committed headline")
def test_the_committed_headline_verdicts_recomputed_independently():
    design = yaml.safe_load(DESIGN.read_text())
    planned, every = design["planned_contexts"], design["look_every"]
    charged = list((design.get("post_hoc") or {}).get("earlier_looks") or [])
    looks = sorted({min(j * every, planned) for j in range(1, math.ceil(planned / every) + 1)} | set(charged))
    t = [c / planned for c in looks]
    alpha, margin = design["alpha"], design["margin_pp"]
    assert design["spending"] == "obrien-fleming" and math.isclose(margin, 1.0)
    pairs = load_pairs()
    strategies = sorted(pairs["strategy"].unique())
    tasks = sorted(pairs["task"].unique())
    scopes = [s for s in design["scopes"] if s == "pooled" or s in tasks]
    complete = min(int(pairs[(pairs["task"] == tk) & (pairs["strategy"] == s)]["idx"].max()) + 1
                   for tk in tasks for s in strategies)
    last = max(j for j, c in enumerate(looks, start=1) if c <= complete)

    def frame(sc: str, s: str, contexts: int) -> pd.DataFrame:
        p = pairs[(pairs["strategy"] == s) & (pairs["idx"] < contexts)]
        return p if sc == "pooled" else p[p["task"] == sc]

    per_look = [{(sc, s): judge(frame(sc, s, looks[j - 1]), sc) for sc in scopes for s in strategies}
                for j in range(1, last + 1)]
    hyps = [(sc, s) for sc in scopes for s in strategies]
    if design["multiplicity"] == "holm":
        weights = {h: 1 / len(hyps) for h in hyps}
        trans = {h: {k: 1 / (len(hyps) - 1) for k in hyps if k != h} for h in hyps}
    else:  # gatekeeping: the first scope holds alpha; a rejection passes it to the same strategy's later scopes
        first, later = scopes[0], scopes[1:]
        weights = {(sc, s): (1 / len(strategies) if sc == first else 0.0) for sc, s in hyps}
        trans = {}
        for s in strategies:
            trans[(first, s)] = {(u, s): 1 / len(later) for u in later}
            for u in later:
                rest = [v for v in later if v != u]
                trans[(u, s)] = {(v, s): 1 / len(rest) for v in rest} if rest else {}
    held = graph_procedure([{h: look[h]["p_holds"] for h in hyps} for look in per_look], alpha, t, weights, trans)
    failed = graph_procedure([{h: look[h]["p_fails"] for h in hyps} for look in per_look], alpha, t, weights, trans)

    printed = printed_members()
    names = {"pooled": POOLED_NAME}
    checked = 0
    for sc, s in hyps:
        cells = printed[(names.get(sc, sc), s)]
        mine = per_look[-1][(sc, s)]
        assert cells[3] == (f"{mine['delta']:+.1f} pp [95% CI {mine['low']:+.1f}, {mine['high']:+.1f}]"), (sc, s)
        assert cells[4] == f"{mine['n']} / {mine['contexts']} / {mine['clusters']}", (sc, s)
        assert cells[5].startswith(f"{mine['deff']:.2f} "), (sc, s)
        verdict = "holds" if (sc, s) in held else "fails" if (sc, s) in failed else "undetermined"
        assert cells[11].startswith(verdict), (sc, s, cells[11], verdict)
        if verdict != "undetermined":
            look = (held if verdict == "holds" else failed)[(sc, s)][0]
            assert f"(look {look}, decided)" in cells[9], (sc, s, cells[9], look)
        checked += 1
    assert checked == len(hyps) >= 3
    # the pooled verdicts of the committed leaderboard agree (in the spec's words, or the older margin words)
    board = pd.read_csv(HEADLINE / "leaderboard.csv")
    for s in strategies:
        row = board[board["strategy"] == s].iloc[0]
        words = (("holds", "within margin") if ("pooled", s) in held else ("fails", "beyond margin")
                 if ("pooled", s) in failed else ("undetermined",))
        assert str(row["all.verdict"]).startswith(words), (s, row["all.verdict"])


def test_the_independent_boundaries_match_published_ones():
    # gsDesign(k = 3, test.type = 1, alpha = 0.025, sfu = sfLDOF): upper z bounds 3.7103, 2.5114, 1.9930
    levels = obf_levels(0.025, [1 / 3, 2 / 3, 1.0])
    assert [round(float(norm.isf(v)), 3) for v in levels] == pytest.approx([3.710, 2.511, 1.993], abs=2e-3)
