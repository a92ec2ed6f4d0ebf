#!/usr/bin/env bash
# One TRIM-KV training update on the default model (SmolLM2-135M, T = 512, B = 2, gate width 128, M_train 32,
# random tokens) in kvbound (float32 and bfloat16 compute) and in PyTorch (bench/peers/trimkv_step_cpu.py: the
# same formulas with transformers' model, float32), same threads, one after the other: JSON lines and the ratios.
# Both print the update's loss on the same tokens, a check that they compute the same step.
# Usage: scripts/bench_train_step.sh BUILD_DIR [THREADS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
steps=${3:-4}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
T=512
B=2
kv() {  # dtype
  "$build"/bench/bench_train_step "$model" trimkv "$T" "$B" "$steps" cpu "$1" model.threads="$threads" \
    trimkv.gate_hidden=128 trimkv.budget=32 | tail -n 1
}
fp32=$(kv float32)
bf16=$(kv bfloat16)
peer=$(.venv/bin/python bench/peers/trimkv_step_cpu.py "$model" "$T" "$B" "$steps" "$threads" 128 32 2>/dev/null | tail -n 1)
printf '%s\n%s\n%s\n' "$fp32" "$bf16" "$peer"
.venv/bin/python - "$fp32" "$bf16" "$peer" <<'PY'
import json, sys
f, b, p = (json.loads(a) for a in sys.argv[1:])
for k in (f, b):
    print(f"trimkv update T={p['T']} B={p['B']} threads={p['threads']}: kvbound {k['dtype']} {k['ms_per_update']:.0f} ms "
          f"(loss {k['loss']:.4f}), pytorch float32 {p['ms_per_update']:.0f} ms (loss {p['loss']:.4f}), "
          f"ratio {p['ms_per_update'] / k['ms_per_update']:.2f}x")
PY
