#!/usr/bin/env bash
# Regenerate the committed leaderboard of the embedded model from scratch:
#   1. the sweep: every registered strategy at its YAML defaults on legal, papers and fiction at the tasks'
#      default length, N_SAMPLES samples per task, in both query settings — query-aware (the question is in
#      the compressed prefix, task.query_aware=true) and query-agnostic (the context is compressed first and
#      the question asked afterwards, task.query_aware=false: kvpress's setting). One
#      `python -m kvbench strategies=[...] task=<task> task.query_aware=<bool>` per (task, setting), so every
#      strategy shares each sample's prefill and the `full` baseline runs once per sample;
#   2. the leaderboard (results/leaderboard.md/.csv/.html, one table per setting), the claim check
#      (results/claim_check.md) and the plots (results/plots/*.png|svg), all from the result store — the
#      same store always gives byte-identical tables;
#   3. a screenshot of the HTML leaderboard in headless Chromium (results/leaderboard.png) when
#      `chromium` is installed (scripts/setup_browser.sh).
#
# Usage: scripts/reproduce_leaderboard.sh [--fresh] [--dry-run]
#   --fresh    delete this results directory's runs/, store/ and baselines/ first (otherwise finished
#              samples of identical runs are reused: run ids hash everything that determines a record)
#   --dry-run  print the commands instead of running them
# Environment: PYTHON (default .venv/bin/python if present, else python), MODEL (default smollm2-135m),
#   HARDWARE (default cpu), RESULTS_DIR (default results), TASKS (default "legal papers fiction"),
#   N_SAMPLES (default 100), SETTINGS (default "true false": the task.query_aware values to run),
#   OVERRIDES (extra Hydra overrides for every run, e.g. "task.context_tokens=512" for a quick check),
#   JOBS (default 1: the (task, setting) runs one after another; N > 1 runs up to N at once, each with
#   hardware.threads = max(1, cores / N), so an interrupted sweep still has every cell at a similar n; the
#   thread count is part of the hardware profile and so of the run identity — it can change floating-point
#   reduction order — so resuming with another JOBS starts new runs instead of extending the old ones),
#   ROUND (default 0: each run goes to N_SAMPLES in turn; K > 0 sweeps in rounds, each run adding up to K
#   samples per round (engine.max_new_samples=K, not part of the run's identity), so a sweep stopped between
#   rounds leaves every (task, setting) within K samples of the others).
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
N_SAMPLES="${N_SAMPLES:-100}"
SETTINGS="${SETTINGS:-true false}"
read -r -a OVERRIDES <<< "${OVERRIDES:-}"
JOBS="${JOBS:-1}"
ROUND="${ROUND:-0}"

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
for qa in $SETTINGS; do
  case "$qa" in
    true|false) ;;
    *) echo "reproduce_leaderboard.sh: SETTINGS holds $qa (valid: true, false)" >&2; exit 2 ;;
  esac
done
if ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
  echo "reproduce_leaderboard.sh: JOBS must be a positive integer, got '$JOBS'" >&2
  exit 2
fi
if ! [[ "$ROUND" =~ ^[0-9]+$ ]]; then
  echo "reproduce_leaderboard.sh: ROUND must be a non-negative integer, got '$ROUND'" >&2
  exit 2
fi
if ! [[ "$N_SAMPLES" =~ ^[1-9][0-9]*$ ]]; then
  echo "reproduce_leaderboard.sh: N_SAMPLES must be a positive integer, got '$N_SAMPLES'" >&2
  exit 2
fi

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

# Extra overrides of every run: the thread split of parallel jobs, the per-round sample limit.
RUN_ARGS=()
if [[ "$JOBS" -gt 1 ]]; then
  cores="$(nproc)"
  RUN_ARGS+=("hardware.threads=$(( cores / JOBS > 0 ? cores / JOBS : 1 ))")
fi
ROUNDS=1
if [[ "$ROUND" -gt 0 ]]; then
  ROUNDS=$(( (N_SAMPLES + ROUND - 1) / ROUND ))
  RUN_ARGS+=("engine.max_new_samples=$ROUND")
fi
cell() {  # one (task, setting) run
  run "$PY" -m kvbench "strategies=[$STRATEGIES]" "task=$1" "task.query_aware=$2" \
    "task.n_samples=$N_SAMPLES" "model=$MODEL" "hardware=$HARDWARE" "results_dir=$RESULTS_DIR" \
    engine.progress=false ${RUN_ARGS[@]+"${RUN_ARGS[@]}"} ${OVERRIDES[@]+"${OVERRIDES[@]}"}
}
for round in $(seq 1 "$ROUNDS"); do
  if [[ "$ROUNDS" -gt 1 ]]; then echo "round $round of $ROUNDS"; fi
  for task in $TASKS; do
    for qa in $SETTINGS; do
      if [[ "$JOBS" -gt 1 && "$dry" == 0 ]]; then
        while [[ "$(jobs -rp | wc -l)" -ge "$JOBS" ]]; do wait -n; done
        cell "$task" "$qa" &
      else
        cell "$task" "$qa"
      fi
    done
  done
  wait
done

# Leaderboard + claim check + plots, ranked for this model and hardware profile only.
run "$PY" -m kvbench leaderboard --results-dir "$RESULTS_DIR" --model "$MODEL" --hardware "$HARDWARE" --plots

# What a reader sees in a browser, next to the page (docs/leaderboard.md shows it).
CHROME="$(command -v chromium || command -v chromium-browser || true)"
if [[ -n "$CHROME" ]]; then
  page="$(cd "$RESULTS_DIR" && pwd)/leaderboard.html"
  # --no-sandbox: Chromium refuses its sandbox as root (containers, CI).
  run "$CHROME" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --screenshot="$RESULTS_DIR/leaderboard.png" "file://$page" 2>/dev/null  # its D-Bus warnings are noise here
else
  echo "no chromium: skipping the leaderboard screenshot (scripts/setup_browser.sh installs it)"
fi
