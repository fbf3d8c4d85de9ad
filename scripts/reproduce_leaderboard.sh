#!/usr/bin/env bash
# Regenerate the committed leaderboard of the embedded model from scratch:
#   1. the sweep: every registered strategy (its YAML defaults) on legal, papers and fiction at the
#      tasks' default length — one `python -m kvbench strategies=[...] task=<task>` per task, so every
#      strategy shares each sample's prefill and the `full` baseline runs once per sample;
#   2. the leaderboard (results/leaderboard.md/.csv/.html), the claim check (results/claim_check.md)
#      and the plots (results/plots/*.png|svg), all from the result store.
#
# Usage: scripts/reproduce_leaderboard.sh [--fresh] [--dry-run]
#   --fresh    delete this results directory's runs/, store/ and baselines/ first (otherwise finished
#              samples of identical runs are reused: run ids hash everything that determines a record)
#   --dry-run  print the commands instead of running them
# Environment: PYTHON (default .venv/bin/python if present, else python), MODEL (default smollm2-135m),
#   HARDWARE (default cpu), RESULTS_DIR (default results), TASKS (default "legal papers fiction"),
#   N_SAMPLES (default: each task's own n_samples; the committed leaderboard states the value it used).
set -euo pipefail

cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PY=.venv/bin/python
else
  PY=python
fi
MODEL="${MODEL:-smollm2-135m}"
HARDWARE="${HARDWARE:-cpu}"
RESULTS_DIR="${RESULTS_DIR:-results}"
TASKS="${TASKS:-legal papers fiction}"
N_SAMPLES="${N_SAMPLES:-}"

fresh=0
dry=0
for arg in "$@"; do
  case "$arg" in
    --fresh) fresh=1 ;;
    --dry-run) dry=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "reproduce_leaderboard.sh: unknown argument $arg (valid: --fresh, --dry-run)" >&2; exit 2 ;;
  esac
done

run() {
  echo "+ $*"
  if [[ "$dry" == 0 ]]; then
    "$@"
  fi
}

STRATEGIES="$("$PY" -c "import strategies; print(','.join(strategies.available()))")"
echo "strategies: $STRATEGIES"

if [[ "$fresh" == 1 ]]; then
  # Only what kvbench writes there; the committed leaderboard files are regenerated below.
  run rm -rf "$RESULTS_DIR/runs" "$RESULTS_DIR/store" "$RESULTS_DIR/baselines"
fi

extra=()
if [[ -n "$N_SAMPLES" ]]; then
  extra+=("task.n_samples=$N_SAMPLES")
fi
for task in $TASKS; do
  run "$PY" -m kvbench "strategies=[$STRATEGIES]" "task=$task" "model=$MODEL" "hardware=$HARDWARE" \
    "results_dir=$RESULTS_DIR" engine.progress=false "${extra[@]}"
done

# Leaderboard + claim check + plots, ranked for this model and hardware profile only.
run "$PY" -m kvbench leaderboard --results-dir "$RESULTS_DIR" --model "$MODEL" --hardware "$HARDWARE" --plots
