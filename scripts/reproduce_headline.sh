#!/usr/bin/env bash
# The spec v1.2 headline evidence: conf/sweep/headline.yaml (int8, fp8 and bfp against full, query-agnostic,
# 4,096 tokens, 8 questions per context, legal/papers/fiction) run by `kvbench sweep` into results/headline/, in
# the file's rounds (per_round: every task +16 questions a round, so the tasks stay at a similar n), then its
# leaderboard, claim check, plots and plan (scripts/publish_results.sh, which alone only regenerates those).
#
#   scripts/reproduce_headline.sh --rounds 10     # ten rounds; without --rounds, until every task is done
#   scripts/reproduce_headline.sh --dry-run       # jobs, rounds and commands only
#
# Arguments are `kvbench sweep`'s (--rounds, --per-round, --launcher, -- overrides). Finished questions are
# reused (the run id hashes everything that determines them); stopping between or inside rounds loses at most
# the context being computed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
"$PY" -m kvbench sweep headline --results-dir results/headline "$@"
[[ " $* " == *" --dry-run "* ]] || bash scripts/publish_results.sh
