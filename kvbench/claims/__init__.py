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

Modules, one concern each:

* :mod:`~kvbench.claims.figures` — what a claim cites: one strategy's figures on a scope, the scopes and their
  records, each pick's comparison against ``full``, the sample-size sentence (generic);
* :mod:`~kvbench.claims.contrasts` — A beats B: dominance, matched-memory pairs, paired contrasts with Holm
  (generic);
* :mod:`~kvbench.claims.headline_claim` — the source document's headline claim ("40–60% less KV memory at <1%
  accuracy loss");
* :mod:`~kvbench.claims.scenarios` — the source document's scenario claims, with their task names and sizes;
* :mod:`~kvbench.claims.check` — every claim per setting (:func:`check_claims`);
* :mod:`~kvbench.claims.render` — ``claim_check.md`` (:func:`render_claims`).

The names below are re-exported so ``from kvbench import claims; claims.check_claims(...)`` reads as one module.
"""

from kvbench.claims.check import ClaimCheck, SettingCheck, check_claims
from kvbench.claims.contrasts import (
    MATCH_TOLERANCE,
    Contrast,
    GroupComparison,
    compare_groups,
    contrast,
    dominates,
    matched_pair,
    matched_pairs,
)
from kvbench.claims.figures import (
    KEEPS_ALL,
    LOSS_PP,
    LOSS_RELATIVE,
    NOT_TESTABLE,
    UNKNOWN_RATE,
    Pick,
    best_within_pp,
    best_within_relative,
    ci_text,
    picks,
    pooled_scopes,
    samples_sentence,
    scope_picks,
    scope_records,
    setting_list,
    ties_of,
)
from kvbench.claims.headline_claim import CLAIM_HIGH, CLAIM_LOW, HeadlineVerdict, headline
from kvbench.claims.render import render_claims
from kvbench.claims.scenarios import SCENARIOS, Scenario, ScenarioResult, depth_deltas, family_picks, scenario
from kvbench.paired import ALPHA, FAILS, HOLDS, PRIMARY, UNDETERMINED
from kvbench.vocab import OFFLOADING_FAMILIES, OVERALL

__all__ = [
    "ALPHA", "CLAIM_HIGH", "CLAIM_LOW", "FAILS", "HOLDS", "KEEPS_ALL", "LOSS_PP", "LOSS_RELATIVE", "MATCH_TOLERANCE",
    "NOT_TESTABLE", "OFFLOADING_FAMILIES", "OVERALL", "PRIMARY", "SCENARIOS", "UNDETERMINED", "UNKNOWN_RATE",
    "ClaimCheck", "Contrast", "GroupComparison", "HeadlineVerdict", "Pick", "Scenario", "ScenarioResult",
    "SettingCheck", "best_within_pp", "best_within_relative", "check_claims", "ci_text", "compare_groups",
    "contrast", "depth_deltas", "dominates", "family_picks", "headline", "matched_pair", "matched_pairs", "picks",
    "pooled_scopes", "render_claims", "samples_sentence", "scenario", "scope_picks", "scope_records",
    "setting_list", "ties_of",
]
