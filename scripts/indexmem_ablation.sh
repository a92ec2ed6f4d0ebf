#!/usr/bin/env bash
# What was tried to make the learned indexer beat H2O on stories260K (REFERENCE_RESULTS.md's protocol,
# 16 windows): stage-1 training targets (window, min_gap, pool) and the policy's inference settings
# (pre-eviction, running statistic and its decay horizon, recent window), each against h2o. Writes runs/ablation/*/results.md
# and prints one line per variant. Usage: scripts/indexmem_ablation.sh [THREADS]   (~35 min on 1 thread)
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-1}"
kv=build/kvbound
out=runs/ablation
mkdir -p "$out"

train_variant() {  # NAME OVERRIDES...
  local name="$1"; shift
  if [ ! -f "$out/$name/indexer.safetensors" ]; then
    rm -rf "$out/$name"
    "$kv" train configs/indexmem/stories260k_stage1.yaml --set model.threads="$threads" \
      --set run.out_dir="$out/$name" --set train.eval_every=0 "$@" >"$out/$name.train.log" 2>&1
    "$kv" export "$out/$name" --out "$out/$name/indexer.safetensors" >/dev/null
  fi
}

eval_variant() {  # NAME INDEXER POLICIES OVERRIDES...
  local name="$1" indexer="$2" policies="$3"; shift 3
  "$kv" eval configs/eval/stories260k_reference.yaml --set model.threads="$threads" --set eval.num_windows=16 \
    --set eval.policies="$policies" --set indexmem.weights="$indexer" --set eval.out_dir="$out/eval_$name" "$@" \
    >"$out/eval_$name.log" 2>&1
  # KL at M = 16 / 32 / 64: the Quality table's rows only (the Cost table has the same row names).
  echo "== $name"
  awk '/^## Quality/{q=1; next} /^## /{q=0} q && /^\| (h2o|indexmem)/' "$out/eval_$name/results.md" | cut -d'|' -f1-3,6,9
}

train_variant window32                                     # the default target: mean over the last 32 queries
train_variant window_all --set indexmem.window=0           # every later query
train_variant min_gap4   --set indexmem.min_gap=4          # a future-looking target
train_variant pool_max   --set indexmem.pool=max           # the seed paper's max pooling
train_variant max_gap4   --set indexmem.pool=max --set indexmem.min_gap=4
train_variant window32_600 --set train.steps=600           # 3x longer

plain=(--set indexmem.horizon=0)  # the running mean over every query (the policy's default decays it, H = 16)
eval_variant window32_pre  "$out/window32/indexer.safetensors" "[h2o,indexmem]" "${plain[@]}"
eval_variant window32_post "$out/window32/indexer.safetensors" "[indexmem]" "${plain[@]}" --set indexmem.pre_evict=false
eval_variant window32_max  "$out/window32/indexer.safetensors" "[indexmem]" --set indexmem.stat=max
eval_variant window32_r16  "$out/window32/indexer.safetensors" "[indexmem]" "${plain[@]}" --set indexmem.recent=16
for v in window_all min_gap4 pool_max max_gap4 window32_600; do
  eval_variant "$v" "$out/$v/indexer.safetensors" "[indexmem]" "${plain[@]}"
done
for v in window32 window32_600; do
  for h in 4 8 16 32 64; do
    eval_variant "${v}_h$h" "$out/$v/indexer.safetensors" "[indexmem]" --set indexmem.horizon=$h
  done
done
