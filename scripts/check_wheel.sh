#!/usr/bin/env bash
# Build kvbench's wheel and use it as a stranger would: a fresh virtual environment with the locked dependencies
# and the wheel (no checkout on the path), then `kvbench --help`, `kvbench-lm-eval --help` and a one-sample run
# from another directory. CI runs this (.ci/run). Usage: bash scripts/check_wheel.sh [WORKDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${1:-$(mktemp -d)}
PY=${PYTHON:-python3}
rm -rf dist && "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w dist . >/dev/null
wheel=$(ls dist/kvbench-*.whl)
"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps --require-hashes -r requirements.lock
"${pip[@]}" --no-deps --require-hashes -r requirements-nodeps.lock
"${pip[@]}" --no-deps "$root/$wheel"
cd "$work"  # nothing of the checkout importable from here
"$work/venv/bin/python" - <<'PY'
import importlib.util, kvbench, kvbench.strategies as s
assert "site-packages" in kvbench.__file__, kvbench.__file__
assert importlib.util.find_spec("strategies") is None, "the wheel must not install a top-level 'strategies'"
assert "int8" in s.available() and "snapkv" in s.available(), s.available()
PY
# Whole, then shown: with pipefail, `--help | head` would fail whenever head closes the pipe before the last write.
"$work/venv/bin/kvbench" --help >"$work/help.txt" && head -3 "$work/help.txt"
"$work/venv/bin/kvbench-lm-eval" --help >"$work/help-lm-eval.txt" && head -2 "$work/help-lm-eval.txt"
"$work/venv/bin/kvbench" model=tiny-llama task=jsonl "task.path=$root/tests/fixtures/tiny_longbench.jsonl" \
  task.n_samples=1 task.max_new_tokens=2 strategy=int8 hardware.threads=1 "results_dir=$work/results"
test -n "$(ls "$work"/results/store/*.parquet)"
echo "check_wheel: $wheel installs and runs from a fresh environment"
