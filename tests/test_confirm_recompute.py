"""The confirmatory design's verdicts (conf/design/confirm.yaml: Tango's score test with the cluster-robust design
effect and a t reference, O'Brien-Fleming alpha spending, a non-binding beta-spending futility boundary, the
pooled-first gatekeeping graph) recomputed by independent code and compared with kvbench's.

The recomputation imports nothing from kvbench: the restricted MLE by direct numerical maximisation, boundaries
from the multivariate normal distribution of the look statistics (scipy's CDF, not kvbench's recursive
integration), the gatekeeping shares written out for this family's graph. kvbench is called only in
:func:`kvbench_verdicts`, for the answer to compare with. The records are synthetic, made to exercise every
verdict: a member that holds, one that fails, one stopped for futility."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import integrate, optimize
from scipy.stats import norm
from scipy.stats import t as student

ALPHA, MARGIN_PP, BETA, DRIFT = 0.025, 10.0, 0.2, 3.0
TASKS, MEMBERS = ("legal", "papers"), ("good", "bad", "weak")
CONTEXTS, LOOK_EVERY, QUESTIONS = 16, 8, 8
FRACTIONS = (0.5, 1.0)


def make_records(seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for task in TASKS:
        for c in range(CONTEXTS):
            for q in range(QUESTIONS):
                full = int(rng.random() < 0.8)
                scores = {"full": full, "good": full,  # never disagrees: holds at a 10-point margin
                          "bad": 0,  # loses every answer full gets: fails
                          "weak": full if rng.random() < 0.88 else 1 - full}  # symmetric noise: not shown
                for strategy, score in scores.items():
                    rows.append(dict(task=task, sample_id=f"{task}/retrieval/{c:03d}/q{q}", strategy=strategy,
                                     score=float(score), metric="substring", document_id=f"{task}-doc{c}",
                                     context_id=f"{task}/retrieval/{c:03d}",
                                     sample_meta=json.dumps({"index": c, "source_docs": [f"{task}-doc{c}"]})))
    return pd.DataFrame(rows)


# -------------------------------------------------------------------------------- independent recomputation


def restricted_q(b: int, c: int, n: int, d0: float) -> float:
    def nll(q: float) -> float:
        cells = ((b, q + d0), (c, q), (n - b - c, 1 - 2 * q - d0))
        return -sum(k * math.log(max(p, 1e-300)) for k, p in cells if k)
    return float(optimize.minimize_scalar(nll, bounds=(max(0.0, -d0), (1 - d0) / 2), method="bounded",
                                          options={"xatol": 1e-13}).x)


def statistic(recs: pd.DataFrame, member: str) -> tuple[float, int]:
    """(t, df) of ``member`` against full on ``recs``."""
    a = recs[recs.strategy == member].set_index(["task", "sample_id"]).sort_index()
    f = recs[recs.strategy == "full"].set_index(["task", "sample_id"]).sort_index()
    x, y, cl = a.score.to_numpy(), f.score.to_numpy(), a.document_id.to_numpy()
    n, b, c = len(x), int(((x == 1) & (y == 0)).sum()), int(((x == 0) & (y == 1)).sum())
    d0 = -MARGIN_PP / 100
    z = (b - c - n * d0) / math.sqrt(n * (2 * restricted_q(b, c, n, d0) + d0 - d0 * d0))
    d = x - y
    var_iid = d.var(ddof=1) / n
    sums = pd.Series(d - d.mean()).groupby(cl).sum()
    k = len(sums)
    deff = max(1.0, (k / (k - 1) * (sums ** 2).sum() / n ** 2) / var_iid) if var_iid > 0 else 1.0
    return z / math.sqrt(deff), k - 1


def obf(a: float, t: float) -> float:
    return 2 * norm.sf(norm.isf(a / 2) / math.sqrt(t))


def bivariate(mean: tuple[float, float], upper: tuple[float, float]) -> float:
    """P(Z1 < upper[0], Z2 < upper[1]) for the two looks' statistics (correlation sqrt(t1 / t2)), by quadrature
    of the conditional normal."""
    r = math.sqrt(FRACTIONS[0] / FRACTIONS[1])
    (m1, m2), (u1, u2) = mean, upper
    return float(integrate.quad(lambda z: norm.pdf(z - m1) * norm.cdf((u2 - m2 - r * (z - m1)) / math.sqrt(1 - r * r)),
                                -np.inf, u1, epsabs=1e-12, epsrel=1e-10)[0])


def efficacy(share: float) -> tuple[float, float]:
    b1 = norm.isf(obf(share, FRACTIONS[0]))
    inc2 = obf(share, 1.0) - obf(share, FRACTIONS[0])
    b2 = optimize.brentq(lambda b: (norm.cdf(b1) - bivariate((0, 0), (b1, b))) - inc2, 0.0, 12.0, xtol=1e-9)
    return b1, b2


def futility(share: float, drift: float) -> tuple[float, float]:
    b1, b2 = efficacy(share)
    return min(norm.ppf(obf(BETA, FRACTIONS[0])) + drift * math.sqrt(FRACTIONS[0]), b1), b2


def recompute(records: pd.DataFrame) -> dict[tuple[str, str], str]:
    scopes = ("pooled", *TASKS)
    looks = []
    for j in (1, 2):
        at = records[records.sample_meta.map(lambda m: json.loads(m)["index"]) < j * LOOK_EVERY]
        looks.append({(sc, m): statistic(at if sc == "pooled" else at[at.task == sc], m)
                      for sc in scopes for m in MEMBERS})
    rejected: dict[str, dict[tuple[str, str], int]] = {"holds": {}, "fails": {}}

    def share(direction: str, sc: str, m: str) -> float:
        """This graph's weights: pooled ALPHA / members; a task scope gets the pooled share once its member's pooled
        hypothesis is rejected, split over the member's open task scopes."""
        done = rejected[direction]
        if sc == "pooled":
            return ALPHA / len(MEMBERS)
        if ("pooled", m) not in done:
            return 0.0
        open_tasks = [t for t in TASKS if (t, m) not in done]
        return ALPHA / len(MEMBERS) / len(open_tasks) if open_tasks else 0.0

    verdict: dict[tuple[str, str], str] = {}
    for j, stats in enumerate(looks, start=1):
        for direction in ("holds", "fails"):
            while True:
                hit = None
                for h, (t, df) in sorted(stats.items()):
                    s = share(direction, *h)
                    if h in rejected[direction] or h in verdict or s <= 0:
                        continue
                    p = student.sf(t, df) if direction == "holds" else student.cdf(t, df)
                    if p < norm.sf(efficacy(s)[j - 1]):
                        hit = h
                        break
                if hit is None:
                    break
                rejected[direction][hit] = j
                verdict[hit] = direction
        for h, (t, df) in sorted(stats.items()):
            s = share("holds", *h)
            if h in verdict or s <= 0:
                continue
            drift = DRIFT if h[0] == "pooled" else DRIFT * math.sqrt(1 / len(TASKS))
            if norm.isf(student.sf(t, df)) < futility(s, drift)[j - 1]:
                verdict[h] = "stopped for futility"
    return verdict


# ------------------------------------------------------------------------------------------------ kvbench


def kvbench_verdicts(records: pd.DataFrame) -> dict[tuple[str, str], str]:
    from kvbench import paired, sequential

    design = sequential.Design(CONTEXTS, LOOK_EVERY, "obrien-fleming", (), ("pooled", *TASKS), "gatekeeping",
                               "score-cluster-t", BETA, DRIFT)
    out = {}
    for scope in ("pooled", *TASKS):
        for v in paired.noninferiority_through_looks(records, list(MEMBERS), "full", design, MARGIN_PP, ALPHA,
                                                     scope=scope):
            out[(scope, v.comparison.a)] = v.verdict
    return out


def test_confirmatory_verdicts_recomputed_independently() -> None:
    records = make_records()
    mine = recompute(records)
    theirs = kvbench_verdicts(records)
    decided = {h: v for h, v in theirs.items() if v in ("holds", "fails", "stopped for futility")}
    assert decided == mine
    # The synthetic members exercise each verdict of the pooled scope.
    assert {theirs[("pooled", m)] for m in MEMBERS} == {"holds", "fails", "stopped for futility"}


@pytest.mark.parametrize("share", [0.025 / 3, 0.025 / 12])
def test_efficacy_boundaries_agree_with_multivariate_normal(share: float) -> None:
    from kvbench import sequential

    assert sequential.boundaries(share, FRACTIONS, "obrien-fleming") == pytest.approx(efficacy(share), abs=2e-4)
    assert sequential.futility_boundaries(share, FRACTIONS, "obrien-fleming", BETA, DRIFT) == \
        pytest.approx(futility(share, DRIFT), abs=2e-4)
