#!/usr/bin/env bash
# Retrain every shipped SmolLM2 weight file (assets/weights/) from its config, in dependency order: prepare the
# IndexMem training data, train and export the TRIM-KV gates, the gates for the model-wide budget, the memory under
# the first, the IndexMem indexer and the memory under it, each export bf16 and picked at its best validation eval.
# assets/README.md has each step's time here at 2 threads; summed, about 2 h. Extra arguments go to every `kvbound train`, e.g.
# `--set model.threads=2`; tests/CMakeLists.txt's scripts.train_shipped_weights_smoke passes 2 updates on short
# rows for a smoke run of the whole chain (about 20 s here).
# Everything lands in OUT_DIR (default runs/shipped_weights), never in assets/: the prepared IndexMem training
# data (0.5 s to tokenize, so it is never taken from elsewhere), the run folders and the exports. Compare the
# exports with configs/eval/indexmem_smollm2.yaml (its header says how) before copying any over.
# Usage: scripts/train_shipped_weights.sh BUILD_DIR [OUT_DIR] [--set KEY=VALUE ...]  (relative paths: from the
# repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-runs/shipped_weights}
shift $(( $# < 2 ? $# : 2 ))
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
# What configs/indexmem/smollm2_stage1.yaml names as runs/data/alice_tinystories.h5 (the memories train on Alice alone).
data=$out/alice_tinystories.h5
if [[ -e "$out" ]]; then
  echo "train_shipped_weights: $out exists; remove it or name another OUT_DIR" >&2
  exit 1
fi
mkdir -p "$out"
"$build"/kvbound prepare --tokenizer "$model" --add-eos --output "$data" \
  assets/text/gutenberg11_alice_in_wonderland.txt assets/text/tinystories_train_first2MiB.txt
step() {  # name config export_file [train overrides...]
  local name=$1 config=$2 file=$3
  shift 3
  echo "--- $name: kvbound train $config ---"
  "$build"/kvbound train "$config" --set run.out_dir="$out/$name" "$@"
  "$build"/kvbound export "$out/$name" --best --dtype bfloat16 --out "$out/$file"
}
step trimkv configs/trimkv/smollm2.yaml smollm2_trimkv_gates.safetensors "$@"
step trimkv_model_budget configs/trimkv/smollm2_global.yaml smollm2_trimkv_model_budget_gates.safetensors "$@"
step trimkv_memory configs/indexmem/smollm2_trimkv_memory.yaml smollm2_trimkv_memory.safetensors \
  --set train.init_from="$out/smollm2_trimkv_gates.safetensors" "$@"
step indexmem_stage1 configs/indexmem/smollm2_stage1.yaml smollm2_indexmem_indexer.safetensors \
  --set data.train_text="$data" "$@"
step indexmem_memory configs/indexmem/smollm2_memory.yaml smollm2_indexmem_memory.safetensors \
  --set train.init_from="$out/smollm2_indexmem_indexer.safetensors" "$@"
echo "--- wrote $out/*.safetensors ---"
