#!/usr/bin/env bash
# Data-parallel training throughput: `kvbound train` on stories260K (TRIM-KV, T = 256) as one process with a
# global batch of 16 rows and all the cores, against --nproc 2 with 8 rows per process and half the cores each;
# the tokens/s each reports over the same updates. Usage: scripts/bench_data_parallel.sh BUILD_DIR [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
steps=${2:-12}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cores=$(nproc)
common=(--set train.steps="$steps" --set train.warmup=1 --set data.eval_text='""' --set train.checkpoint_every=0
        --set run.tensorboard=false)
one=$("$build"/kvbound train configs/trimkv/stories260k.yaml "${common[@]}" --set train.batch_size=16 \
  --set model.threads="$cores" --set run.out_dir="$out/one" 2>/dev/null | grep -o '([0-9.]* tokens/s)')
two=$("$build"/kvbound train configs/trimkv/stories260k.yaml "${common[@]}" --set train.batch_size=8 \
  --set model.threads=$((cores > 1 ? cores / 2 : 1)) --set run.out_dir="$out/two" --nproc 2 2>/dev/null | grep -o '([0-9.]* tokens/s)')
echo "stories260K trimkv T=256, 16 rows per update, $cores cores: 1 process $one; 2 processes x 8 rows $two"
