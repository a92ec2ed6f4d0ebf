#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks for the training-speed peer (bench/peers/official_trimkv_step.py:
# the official TRIM-KV release pins transformers 4.57.1; the image has 5.x and no network) into .whl/ (ignored
# by git; ~20 MB), for the device call to carry: run(command="scripts/gpu_check.sh \"$OUT\"", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
  trimkv==0.1.5 transformers==4.57.1 tokenizers==0.22.1 huggingface_hub==0.36.0
ls -la .whl
