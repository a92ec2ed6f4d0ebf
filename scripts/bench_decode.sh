#!/usr/bin/env bash
# Decode tokens/s and peak KV bytes of the budgeted engine at context 4K on the default model (CPU):
# full vs h2o and streaming_llm at M = 64 and 256. Usage: scripts/bench_decode.sh BUILD_DIR [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
out=$(mktemp)
for run in "full 0" "streaming_llm 64" "streaming_llm 256" "h2o 64" "h2o 256"; do
  set -- $run
  "$build"/bench/bench_decode "$model" 4096 "$1" "$(( $2 > 0 ? $2 : 1 ))" "$threads" 64 256 | tee -a "$out"
done
.venv/bin/python - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
full = next(r for r in rows if r["policy"] == "full")
for r in rows[1:]:
    print(f"{r['policy']:>14} M={r['budget']:<4} decode {r['decode_tok_s']:.1f} tok/s = {r['decode_tok_s'] / full['decode_tok_s']:.2f}x full; "
          f"peak KV {r['peak_kv_bytes'] / 2**20:.1f} MiB = {r['peak_kv_bytes'] / full['peak_kv_bytes']:.3f}x full ({full['peak_kv_bytes'] / 2**20:.1f} MiB)")
PY
rm -f "$out"
