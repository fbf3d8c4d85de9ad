#!/usr/bin/env bash
# The spec v1.2 headline evidence: rounds of conf/sweep/headline.yaml (int8, fp8 and bfp against full,
# query-agnostic, 4,096 tokens, 8 questions per context, legal/papers/fiction) into results/headline/, then its
# leaderboard, claim check, plots and plan (scripts/publish_results.sh).
#
#   ROUNDS=10 scripts/reproduce_headline.sh      # each round advances every task by PER_ROUND questions
#   ROUNDS=0 scripts/reproduce_headline.sh       # only regenerate the published files
#
# Finished questions are reused (the run id hashes everything that determines them); stopping between or
# inside rounds loses at most the context being computed. Rounds keep the three tasks at a similar n.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
ROUNDS=${ROUNDS:-1}
PER_ROUND=${PER_ROUND:-16}
for _ in $(seq 1 "$ROUNDS"); do
  "$PY" -m kvbench sweep conf/sweep/headline.yaml --results-dir results/headline -- engine.max_new_samples="$PER_ROUND"
done
bash scripts/publish_results.sh
