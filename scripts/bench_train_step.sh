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
# Usage: scripts/bench_train_step.sh BUILD_DIR [THREADS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
steps=${3:-4}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
T=512
B=2
for method in trimkv indexmem; do
  case $method in
    trimkv) keys=(trimkv.gate_hidden=128 trimkv.budget=32) peer_args=(128 32) peer_script=bench/peers/trimkv_step_cpu.py ;;
    indexmem) keys=(indexmem.d_index=32 indexmem.window=32) peer_args=(32 32) peer_script=bench/peers/indexmem_step.py ;;
  esac
  for variant in float32:float32 float32:bf16x3 bfloat16:float32; do
    dtype=${variant%%:*} products=${variant##*:}
    if [[ $products == bf16x3 ]] && ! grep -qw amx_bf16 /proc/cpuinfo; then
      echo "$method update: bf16x3 products need AMX, which this CPU lacks: skipped"
      continue
    fi
    ours=$("$build"/bench/bench_train_step "$model" "$method" "$T" "$B" "$steps" cpu "$dtype" \
      model.threads="$threads" model.fp32_products="$products" "${keys[@]}" | tail -n 1)
    printf '%s\n' "$ours"
    if [[ $products == float32 ]]; then  # the bf16x3 run is compared with the float32 peer just measured
      peer=$(.venv/bin/python "$peer_script" "$model" "$T" "$B" "$steps" "$threads" \
        "${peer_args[@]}" "$dtype" 2>/dev/null | tail -n 1)
      printf '%s\n' "$peer"
    fi
    .venv/bin/python - "$ours" "$peer" <<'PY'
import json, sys
k, p = (json.loads(a) for a in sys.argv[1:3])
products = "" if k["fp32_products"] == "float32" else f" (kvbound's products: {k['fp32_products']})"
print(f"{p['method']} update T={p['T']} B={p['B']} threads={p['threads']} {p['dtype']}{products}: kvbound "
      f"{k['ms_per_update']:.0f} ms (loss {k['loss']:.4f}), pytorch {p['ms_per_update']:.0f} ms "
      f"(loss {p['loss']:.4f}), ratio {p['ms_per_update'] / k['ms_per_update']:.2f}x")
if k.get("unavoidable_products_ms") is not None and k["fp32_products"] == "float32":
    print(f"  the update's unavoidable matrix products alone on kvbound's GEMM ({k['gemm']}): "
          f"{k['unavoidable_products_ms']:.0f} ms = {k['unavoidable_products_ms'] / k['ms_per_update']:.0%} of kvbound's "
          f"update; an update on this GEMM can be at most {p['ms_per_update'] / k['unavoidable_products_ms']:.2f}x pytorch")
    if k["gemm"] != "aten":
        print(f"  the same products on ATen's GEMM (pytorch's): {k['aten_unavoidable_products_ms']:.0f} ms")
PY
  done
done
