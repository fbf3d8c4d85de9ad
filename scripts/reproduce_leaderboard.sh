#!/usr/bin/env bash
# Regenerate the committed leaderboard of the embedded model: conf/sweep/leaderboard.yaml (every registered
# strategy at its defaults on legal, papers and fiction, both query settings, 100 questions per task) run by
# `kvbench sweep`, then the leaderboard tables, claim check and plots from the result store, and a screenshot of
# the HTML page when `chromium` is installed (scripts/setup_browser.sh).
#
#   scripts/reproduce_leaderboard.sh --dry-run                    # the 6 jobs, time projection, commands
#   scripts/reproduce_leaderboard.sh --per-round 10               # rounds: every job +10 samples per round
#   scripts/reproduce_leaderboard.sh --launcher joblib            # 2 jobs at once, 1 thread each (2 cores)
#   scripts/reproduce_leaderboard.sh -- task.context_tokens=512   # Hydra overrides for every job
#
# Arguments are `kvbench sweep`'s (docs/scale-out.md); RESULTS_DIR (default results) is its --results-dir.
# Finished samples are reused (run ids hash everything that determines a record); delete the results
# directory's runs/, store/ and baselines/ to start from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${RESULTS_DIR:-results}
"$PY" -m kvbench sweep leaderboard --results-dir "$out" "$@"
[[ " $* " == *" --dry-run "* ]] && exit 0
"$PY" -m kvbench leaderboard --results-dir "$out" --out-dir "$out" --model smollm2-135m --hardware cpu --plots
chrome="$(command -v chromium || command -v chromium-browser || true)"  # --no-sandbox: root in containers
[[ -z "$chrome" ]] || "$chrome" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
  --screenshot="$out/leaderboard.png" "file://$(cd "$out" && pwd)/leaderboard.html" 2>/dev/null
