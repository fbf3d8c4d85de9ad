#!/usr/bin/env bash
# The GPU check, prepared for a machine with one CUDA GPU (budget: under 8 minutes in all):
#   1. the CUDA test path over the strategy registry (tests/test_gpu_path.py: every strategy on CUDA, no
#      host/device mixing, CUDA timers and peak memory), plus the strategy x architecture matrix;
#   2. the harness benchmark (scripts/bench_harness.py, through its CLI only) on the embedded model in bf16
#      at 8,192 context tokens, batch 1, 4 and 16 (each invocation measures batch 1 beside --batch-size);
#   3. capacity and decode throughput at a fixed budget (kvbench throughput) at 4K and 8K, rendered by
#      scripts/bench_throughput.py into results/perf/gpu/throughput.{md,png};
#   4. results/perf/gpu.md: the device, the versions, the test summary and the benchmark tables, all
#      written by this script (never by hand); the raw harness outputs go to results/perf/gpu/batch<B>/.
#
# Usage: scripts/gpu_check.sh [--dry-run]
#   --dry-run  check what can be checked without a GPU (the interpreter, the scripts and their CLIs) and
#              print the commands instead of running them (tests/test_gpu_check.py runs this on CPU)
# Environment: PYTHON (default: .venv/bin/python, the main checkout's .venv from a git worktree, an activated
#   venv, else python3; refused in one line unless it imports torch, transformers and hydra), OUT (default results/perf),
#   CONTEXT (default 8192), SAMPLES (default 16), BATCHES (default "4 16"), STEP_TIMEOUT (seconds per step,
#   default 200).
set -euo pipefail

cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg; valid: --dry-run" >&2; exit 2 ;;
  esac
done

# The project's interpreter: PYTHON, else the venv scripts/setup.sh makes (.venv here, or the main checkout's
# .venv when this is a git worktree), else an activated venv, else python3 on PATH.
MAIN_VENV="$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)"
MAIN_VENV="${MAIN_VENV:+${MAIN_VENV%/.git}/.venv/bin/python}"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
elif [[ -n "$MAIN_VENV" && -x "$MAIN_VENV" ]]; then PY="$MAIN_VENV"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then PY="$VIRTUAL_ENV/bin/python"
else PY=python3; fi
OUT="${OUT:-results/perf}"
CONTEXT="${CONTEXT:-8192}"
SAMPLES="${SAMPLES:-16}"
BATCHES="${BATCHES:-4 16}"
STEP_TIMEOUT="${STEP_TIMEOUT:-200}"

for v in CONTEXT SAMPLES STEP_TIMEOUT; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: $v must be a positive integer (got ${!v})" >&2; exit 2; }
done
for b in $BATCHES; do
  [[ "$b" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: BATCHES must be positive integers (got $b)" >&2; exit 2; }
done
command -v "$PY" >/dev/null || { echo "gpu_check.sh: python interpreter $PY not found; set PYTHON=" >&2; exit 2; }
"$PY" -c "import torch, transformers, hydra" 2>/dev/null || { echo "gpu_check.sh: $PY cannot import torch, \
transformers and hydra (not the project's venv); run scripts/setup.sh, or point PYTHON=/path/to/.venv/bin/python" >&2
  exit 2; }
for f in tests/test_gpu_path.py tests/test_arch_matrix.py scripts/bench_harness.py; do
  [[ -f "$f" ]] || { echo "gpu_check.sh: $f is missing" >&2; exit 2; }
done

# The harness benchmark runs on CUDA only if its CLI can be told to; otherwise gpu.md says so (no CPU figures
# under a GPU heading).
HELP="$(PYTHONPATH=. "$PY" scripts/bench_harness.py --help)" || {
  echo "gpu_check.sh: scripts/bench_harness.py --help failed" >&2; exit 2; }
DEVICE_ARGS=""
if grep -q -- "--device" <<<"$HELP"; then DEVICE_ARGS="--device cuda"; fi
if grep -q -- "--dtype" <<<"$HELP"; then DEVICE_ARGS="$DEVICE_ARGS --dtype bfloat16"; fi

TESTS=(env PYTHONPATH=. timeout "$STEP_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_path.py
       tests/test_arch_matrix.py)
harness_cmd() {  # $1: batch size
  echo env PYTHONPATH=. timeout "$STEP_TIMEOUT" "$PY" scripts/bench_harness.py --context "$CONTEXT" \
    --samples "$SAMPLES" --batch-size "$1" $DEVICE_ARGS --out "$OUT/gpu/batch$1"
}

# Capacity and decode throughput at a fixed budget (kvbench throughput, issue 41), rendered by its script.
THROUGHPUT=(env PYTHONPATH=. timeout 300 "$PY" -m kvbench throughput hardware=server-gpu-80g model=smollm2-135m
            "contexts=[4096,8192]" "strategies=[int8,int4,snapkv]" "budget=[weights+2GB,weights+8GB]" steps=32
            repeats=5 "out=$OUT/gpu/throughput_embedded.csv")
RENDER=(env PYTHONPATH=. "$PY" scripts/bench_throughput.py --render-only --out "$OUT/gpu")

if [[ "$DRY" == 1 ]]; then
  echo "+ ${TESTS[*]}"
  for b in $BATCHES; do echo "+ $(harness_cmd "$b")"; done
  echo "+ ${THROUGHPUT[*]}"
  echo "+ ${RENDER[*]}"
  [[ -n "$DEVICE_ARGS" ]] || echo "note: scripts/bench_harness.py has no --device option; the harness benchmark would be skipped"
  echo "+ write $OUT/gpu.md"
  exit 0
fi

PYTHONPATH=. "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check.sh: needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on CPU" >&2; exit 2; }

mkdir -p "$OUT/gpu"
started=$SECONDS
set +e
"${TESTS[@]}" >"$OUT/gpu/tests.log" 2>&1
tests_rc=$?
tests_s=$((SECONDS - started))
declare -A HARNESS_RC HARNESS_S
for b in $BATCHES; do
  if [[ -z "$DEVICE_ARGS" ]]; then HARNESS_RC[$b]=skipped; HARNESS_S[$b]=0; continue; fi
  t0=$SECONDS
  $(harness_cmd "$b") >"$OUT/gpu/harness_batch$b.log" 2>&1
  HARNESS_RC[$b]=$?
  HARNESS_S[$b]=$((SECONDS - t0))
done
t0=$SECONDS
"${THROUGHPUT[@]}" >"$OUT/gpu/throughput.log" 2>&1 && "${RENDER[@]}" >>"$OUT/gpu/throughput.log" 2>&1
THROUGHPUT_RC=$?
THROUGHPUT_S=$((SECONDS - t0))
set -e

{
  echo "# GPU check (written by \`scripts/gpu_check.sh\`)"
  echo
  PYTHONPATH=. "$PY" - <<'PY'
import platform, torch, transformers
p = torch.cuda.get_device_properties(0)
print(f"Device: {p.name}, {p.total_memory / 2**30:.1f} GiB; torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}, Python {platform.python_version()}.")
PY
  echo
  echo "## CUDA test path (tests/test_gpu_path.py, tests/test_arch_matrix.py)"
  echo
  echo "exit status $tests_rc in ${tests_s} s: \`$(tail -n 1 "$OUT/gpu/tests.log")\`"
  for b in $BATCHES; do
    echo
    echo "## Harness benchmark, ${CONTEXT} tokens, bf16, batch 1 and $b"
    echo
    if [[ "${HARNESS_RC[$b]}" == skipped ]]; then
      echo "Skipped: scripts/bench_harness.py has no --device option, so it would measure the CPU."
    elif [[ "${HARNESS_RC[$b]}" != 0 ]]; then
      echo "Failed (exit status ${HARNESS_RC[$b]} after ${HARNESS_S[$b]} s): \`$(tail -n 1 "$OUT/gpu/harness_batch$b.log")\`"
    else
      echo "${HARNESS_S[$b]} s. From \`$(harness_cmd "$b")\`:"
      echo
      sed '1{/^# /d}' "$OUT/gpu/batch$b/harness.md"
    fi
  done
  echo
  echo "## Capacity and decode throughput at a fixed budget (kvbench throughput)"
  echo
  if [[ "$THROUGHPUT_RC" != 0 ]]; then
    echo "Failed (exit status $THROUGHPUT_RC after $THROUGHPUT_S s): \`$(tail -n 1 "$OUT/gpu/throughput.log")\`"
  else
    echo "$THROUGHPUT_S s. From \`${THROUGHPUT[*]}\`:"
    echo
    sed '1{/^# /d}' "$OUT/gpu/throughput.md"
  fi
} >"$OUT/gpu.md"
echo "wrote $OUT/gpu.md in $((SECONDS - started)) s"
[[ "$tests_rc" == 0 ]]
