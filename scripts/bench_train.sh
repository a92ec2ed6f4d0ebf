#!/usr/bin/env bash
# Training throughput of `kvbound train` at T = 512 on stories260K and SmolLM2-135M, the tokens/s the trainer
# reports over a few updates of each learned method: TRIM-KV gates (teacher forward + gated student
# forward/backward + blockwise losses), IndexMem stage 1 (teacher forward + pooled importance + indexer
# KL), stage 2 (the latent memory replaying the stage-1 indexer's pre-evictions at every memory.budgets
# entry) and stage 2 joint (both), every method of a model on one shipped text (the SmolLM2 IndexMem configs
# train on a prepared .h5 a fresh clone lacks; throughput does not depend on the text).
# Usage: scripts/bench_train.sh BUILD_DIR [THREADS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
steps=${3:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # name config batch_size [--set overrides]
  local name=$1 config=$2 batch=$3
  shift 3
  "$build"/kvbound train "$config" --set train.steps="$steps" --set train.seq_len=512 --set train.batch_size="$batch" \
    --set train.warmup=1 --set data.eval_text='""' --set model.threads="$threads" --set train.checkpoint_every=0 \
    --set run.out_dir="$out/${name// /_}" "$@" 2>/dev/null | grep -o '([0-9.]* tokens/s)' | sed "s/^/$name T=512 B=$batch threads=$threads: /"
}
methods() {  # model trimkv_config stage1_config stage2_config batch training_text
  local text=(--set data.train_text="$6" --set data.pack=false)  # every method on the same shipped text
  run "$1 trimkv" "$2" "$5" "${text[@]}"
  run "$1 indexmem-stage1" "$3" "$5" "${text[@]}"
  run "$1 memory-stage2" "$4" "$5" "${text[@]}" --set train.init_from="$out/$1_indexmem-stage1"
  run "$1 joint-stage2" "$4" "$5" "${text[@]}" --set train.init_from="$out/$1_indexmem-stage1" --set train.method=joint
}
methods stories260K configs/trimkv/stories260k.yaml configs/indexmem/stories260k_stage1.yaml configs/indexmem/stories260k_stage2.yaml 16 \
  assets/text/tinystories_train_first2MiB.txt
methods SmolLM2-135M configs/trimkv/smollm2.yaml configs/indexmem/smollm2_stage1.yaml configs/indexmem/smollm2_memory.yaml 2 \
  assets/text/gutenberg11_alice_in_wonderland.txt
