#!/usr/bin/env bash
# One training update on the default model (SmolLM2-135M, T = 512, B = 2, random tokens) of TRIM-KV (gate width
# 128, M_train 32) and IndexMem stage 1 (the indexer, DESIGN.md defaults) in kvbound and in PyTorch
# (bench/peers/trimkv_step_cpu.py, bench/peers/indexmem_step.py: the same formulas with transformers'
# model), each in float32 and in bfloat16 compute (the trained modules and the losses float32 in both), same
# threads, one after the other: JSON lines and the ratio at each dtype. Each prints its update's loss on the
# same tokens, a check that both compute the same step. Beside them, the time of the matrix products each update
# cannot avoid (bench_train_step's unavoidable_products_ms), which bounds the ratio any implementation can reach.
# In float32, kvbound's update runs twice, with the float32 GEMM and with bf16x3 products (model.fp32_products:
# three bfloat16 tile passes on AMX; PyTorch keeps its float32 GEMM), both against the same PyTorch run; on a CPU
# without AMX the bf16x3 run is skipped.
# PAIRS > 1 runs each comparison as that many back-to-back pairs (kvbound, then PyTorch) and prints every pair's
# ratio and their median and range: on a shared machine a neighbour slows one run of a pair, and a single pair's
# ratio moves with it (the same binary has read 361-492 ms here), while the median of pairs measured moments apart
# does not.
# METHODS: the updates to time (default "trimkv indexmem").
# Usage: scripts/bench_train_step.sh BUILD_DIR [THREADS] [STEPS] [PAIRS] [METHODS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
steps=${3:-4}
pairs=${4:-1}
methods=${5:-trimkv indexmem}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
T=512
B=2
for method in $methods; do
  case $method in
    trimkv) keys=(trimkv.gate_hidden=128 trimkv.budget=32) peer_args=(128 32) peer_script=bench/peers/trimkv_step_cpu.py ;;
    indexmem) keys=(indexmem.d_index=32 indexmem.window=32) peer_args=(32 32) peer_script=bench/peers/indexmem_step.py ;;
    *) echo "bench_train_step.sh: METHODS: unknown method '$method' (trimkv, indexmem)" >&2; exit 2 ;;
  esac
  for variant in float32:float32 float32:bf16x3 bfloat16:float32; do
    dtype=${variant%%:*} products=${variant##*:}
    if [[ $products == bf16x3 ]] && ! grep -qw amx_bf16 /proc/cpuinfo; then
      echo "$method update: bf16x3 products need AMX, which this CPU lacks: skipped"
      continue
    fi
    : >"$runs/ours"
    # the bf16x3 runs are compared with the float32 peer runs just measured
    [[ $products == float32 ]] && : >"$runs/peer"
    for ((pair = 0; pair < pairs; ++pair)); do
      "$build"/bench/bench_train_step "$model" "$method" "$T" "$B" "$steps" cpu "$dtype" \
        model.threads="$threads" model.fp32_products="$products" "${keys[@]}" | tail -n 1 | tee -a "$runs/ours"
      if [[ $products == float32 ]]; then
        .venv/bin/python "$peer_script" "$model" "$T" "$B" "$steps" "$threads" "${peer_args[@]}" "$dtype" \
          2>/dev/null | tail -n 1 | tee -a "$runs/peer"
      fi
    done
    .venv/bin/python - "$runs/ours" "$runs/peer" <<'PY'
import json, statistics, sys
ours, peers = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
k, p = ours[0], peers[0]
products = "" if k["fp32_products"] == "float32" else f" (kvbound's products: {k['fp32_products']})"
ratios = [q["ms_per_update"] / o["ms_per_update"] for o, q in zip(ours, peers)]
median = lambda runs, key: statistics.median(r[key] for r in runs)
head = (f"{p['method']} update T={p['T']} B={p['B']} threads={p['threads']} {p['dtype']}{products}: kvbound "
        f"{median(ours, 'ms_per_update'):.0f} ms (loss {k['loss']:.4f}), pytorch {median(peers, 'ms_per_update'):.0f} ms "
        f"(loss {p['loss']:.4f}), ratio")
if len(ratios) == 1:
    print(f"{head} {ratios[0]:.2f}x")
else:
    print(f"{head} {statistics.median(ratios):.2f}x, the median of {len(ratios)} back-to-back pairs "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x: {', '.join(f'{r:.2f}' for r in ratios)}; the times are medians too)")
if k.get("unavoidable_products_ms") is not None and k["fp32_products"] == "float32":
    floor = median(ours, "unavoidable_products_ms")
    print(f"  the update's unavoidable matrix products alone on kvbound's GEMM ({k['gemm']}): "
          f"{floor:.0f} ms = {floor / median(ours, 'ms_per_update'):.0%} of kvbound's "
          f"update; an update on this GEMM can be at most {median(peers, 'ms_per_update') / floor:.2f}x pytorch")
    if k["gemm"] != "aten":
        print(f"  the same products on ATen's GEMM (pytorch's): {median(ours, 'aten_unavoidable_products_ms'):.0f} ms")
PY
  done
done
