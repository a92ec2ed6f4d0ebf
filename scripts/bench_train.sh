#!/usr/bin/env bash
# Training throughput of `kvbound train` (TRIM-KV gates) at T = 512 on stories260K and SmolLM2-135M:
# a few updates each (teacher forward + gated student forward/backward + blockwise losses + AdamW), the
# tokens/s the trainer reports. Usage: scripts/bench_train.sh BUILD_DIR [THREADS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
steps=${3:-4}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() {  # name config batch_size
  "$build"/kvbound train "$2" --set train.steps="$steps" --set train.seq_len=512 --set train.batch_size="$3" \
    --set train.warmup=1 --set data.eval_text='""' --set model.threads="$threads" --set train.checkpoint_every=0 \
    --set run.out_dir="$out/$1" 2>/dev/null | grep -o '([0-9.]* tokens/s)' | sed "s/^/$1 T=512 B=$3 threads=$threads: /"
}
if [ -f ../shared/data/stories260K/model.safetensors ]; then run stories260K configs/trimkv/stories260k.yaml 16; fi
run SmolLM2-135M configs/trimkv/smollm2.yaml 2
