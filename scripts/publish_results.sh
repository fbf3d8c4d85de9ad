#!/usr/bin/env bash
# Regenerate every committed table, claim check and plot from the stores already measured — nothing is run.
#
#   scripts/publish_results.sh             # results/ (all 18 strategies, spec v1.1 records) and results/headline/
#
# results/store holds the v1.1 sweep (scripts/reproduce_leaderboard.sh measured it); results/headline/store the
# spec v1.2 claim-focused sweep (scripts/reproduce_headline.sh). Each directory is ranked on its own: the
# leaderboard refuses to rank records of two spec versions together.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
shot() {  # what a reader sees in a browser at 1400 px, next to the page
  local chrome
  chrome="$(command -v chromium || command -v chromium-browser || true)"
  if [[ -z "$chrome" ]]; then echo "no chromium: skipping the screenshot of $1"; return; fi
  "$chrome" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --screenshot="$1/leaderboard.png" "file://$(cd "$1" && pwd)/leaderboard.html" 2>/dev/null
}
"$PY" -m kvbench leaderboard --results-dir results --model smollm2-135m --hardware cpu --spec-version 1.1 --plots
shot results
if [[ -d results/headline/store ]]; then
  # Judged by the sweep file's pre-registered looks (spec v1.2 §2.5): every figure is the last complete look's.
  "$PY" -m kvbench leaderboard --results-dir results/headline --model smollm2-135m --hardware cpu \
    --spec-version 1.2 --design headline --plots --measured-by "${HEADLINE_CMD:-scripts/reproduce_headline.sh --per-round 48 (rounds of kvbench sweep headline; finished questions are reused)}"
  "$PY" -m kvbench plan --results-dir results/headline --model smollm2-135m --hardware cpu --spec-version 1.2 \
    --design headline > results/headline/plan.txt
  shot results/headline
fi
