#!/usr/bin/env bash
# Regenerate every committed table, claim check and plot from the stores already measured — nothing is run.
#
#   scripts/publish_results.sh             # results/ (all 18 strategies), results/headline/, results/long8k/,
#                                          # results/fused/ (all 18 on the fused reader), results/confirm/ (the
#                                          # confirmatory study), then docs/advise.md
#
# results/store holds the leaderboard sweep (scripts/reproduce_leaderboard.sh, in rounds); results/headline/store
# the claim-focused headline sweep (scripts/reproduce_headline.sh). Both are spec v1.2 records; each directory is
# ranked on its own (a store of two spec versions is refused: the leaderboard never ranks them together).
# LEADERBOARD_CMD and HEADLINE_CMD name the commands that measured each store (printed under each table).
# Each directory is sealed first: its MANIFEST.sha256 (the sha256 of every file of runs/, store/, baselines/) is
# rewritten only when every file is in the committed manifest (git HEAD's; the tree's own outside git) or vouched
# for by the run that wrote it (kvbench verify --write --against): a forged, hidden or linked file stops the
# publish before it can become an answer line. The leaderboard then runs --strict against it, --out-dir naming the
# tree (a published tree's pages are rewritten only when asked), and `kvbench verify --results-dir DIR` later names
# every file added, removed or edited after publishing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=${PYTHONPATH:-.}
COMMITTED="$(mktemp)"
trap 'rm -f "$COMMITTED"' EXIT
seal() {  # seal DIR: verify against the committed manifest, then write the new one (exit 2 naming what is unknown)
  if git cat-file -e "HEAD:$1/MANIFEST.sha256" 2>/dev/null; then
    git show "HEAD:$1/MANIFEST.sha256" >"$COMMITTED"
  elif [[ -f "$1/MANIFEST.sha256" ]]; then
    cp "$1/MANIFEST.sha256" "$COMMITTED"
  else
    : >"$COMMITTED"
  fi
  "$PY" -m kvbench verify --write --against "$COMMITTED" --results-dir "$1"
}
shot() {  # what a reader sees in a browser at 1400 px, next to the page
  local chrome
  chrome="$(command -v chromium || command -v chromium-browser || true)"
  if [[ -z "$chrome" ]]; then echo "no chromium: skipping the screenshot of $1"; return; fi
  "$chrome" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --screenshot="$1/leaderboard.png" "file://$(cd "$1" && pwd)/leaderboard.html" 2>/dev/null
}
designed() {  # a store judged by a registered design ($2) at its looks: sealed, board, plan, screenshot
  seal "$1"
  "$PY" -m kvbench leaderboard --strict --results-dir "$1" --out-dir "$1" --model smollm2-135m --hardware cpu \
    --spec-version 1.2 --design "$2" --plots --measured-by "$3"
  "$PY" -m kvbench plan --results-dir "$1" --model smollm2-135m --hardware cpu --spec-version 1.2 --design "$2" \
    > "$1/plan.txt"
  shot "$1"
}
seal results
"$PY" -m kvbench leaderboard --strict --results-dir results --out-dir results --model smollm2-135m --hardware cpu \
  --spec-version 1.2 --plots \
  --measured-by "${LEADERBOARD_CMD:-scripts/reproduce_leaderboard.sh --per-round 8 (rounds of kvbench sweep leaderboard; finished questions are reused)}"
shot results
if [[ -d results/headline/store ]]; then
  # Judged by the sweep file's pre-registered looks (spec v1.2 §2.5): every figure is the last complete look's.
  designed results/headline headline \
    "${HEADLINE_CMD:-scripts/reproduce_headline.sh --per-round 48 (rounds of kvbench sweep headline; finished questions are reused)}"
fi
if [[ -d results/long8k/store ]]; then
  # int8 vs full at 8,000 tokens (conf/sweep/long8k.yaml): whatever rounds finished, with their intervals.
  seal results/long8k
  "$PY" -m kvbench leaderboard --strict --results-dir results/long8k --out-dir results/long8k --model smollm2-135m \
    --hardware cpu --spec-version 1.2 --measured-by "${LONG8K_CMD:-kvbench sweep long8k --per-round 8 (rounds; finished questions are reused)}"
fi
if [[ -d results/fused/store ]]; then
  # The leaderboard re-measured on the engine that attends over each strategy's own storage (issue 49 item 6:
  # conf/sweep/leaderboard_fused.yaml, engine.reader=fused, the recalibrated tasks at 4,096 tokens): every
  # strategy on every question; it replaces results/leaderboard.* as the board the README cites.
  seal results/fused
  "$PY" -m kvbench leaderboard --strict --results-dir results/fused --out-dir results/fused --model smollm2-135m \
    --hardware cpu --spec-version 1.2 --plots \
    --measured-by "${FUSED_CMD:-kvbench sweep leaderboard_fused (rounds of 8 questions per job; finished questions are reused)}"
  shot results/fused
fi
if [[ -d results/confirm/store ]]; then
  # The confirmatory study (conf/design/confirm.yaml, registered before the store's first record): judged only at
  # the design's looks; until the first look is complete the page says so and judges nothing.
  designed results/confirm confirm \
    "${CONFIRM_CMD:-kvbench sweep confirm (rounds of 16 questions per job; finished questions are reused; a lagging task filled by its own job with engine.max_new_samples, the same run id) to 48 contexts per task, then, the members decided at look 1 dropped (docs/confirm.md), kvbench sweep confirm -- 'strategies=[int8,fp8,bfp,channel_sparse,quant_recompute]' '~strategies_params.compression_ratio' task.first_context=1048 task.n_samples=352 to 80 contexts per task, then, fp8 stopped for futility at look 2, kvbench sweep confirm -- 'strategies=[int8,bfp,channel_sparse,quant_recompute]' '~strategies_params.compression_ratio' task.first_context=1080 task.n_samples=320}"
fi
# docs/advise.md advises from every committed leaderboard (per strategy and task, the row with the most questions),
# so a republished table can change its advice: it is regenerated after them.
"$PY" scripts/advise_docs.py >/dev/null
