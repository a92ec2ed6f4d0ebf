#!/usr/bin/env bash
# Forward tokens/s of the C++ backbone vs transformers on the default model (T=512, same threads, both computing
# in DTYPE: float32, or bfloat16 with kvbound's error against its own float32 on the same tokens), and peak RSS
# after loading vs the fp32 weight bytes; and the time of the model's matrix products alone, which bounds the ratio
# any forward built on the same GEMM can reach (kvbound's GEMM: float32 on oneDNN where ops/onednn_linear.h
# prefers it, and then ATen's at::linear, transformers' GEMM, beside it). PRODUCTS bf16x3 forms kvbound's float32 products as three
# bfloat16 tile passes (model.fp32_products; transformers keeps its float32 GEMM) and prints their error against
# kvbound's float32 GEMM on the same tokens. Usage: scripts/bench.sh BUILD_DIR [THREADS] [DTYPE] [PRODUCTS]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
threads=${2:-$(nproc)}
dtype=${3:-float32}
products=${4:-float32}
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
cpp=$("$build"/bench/bench_forward "$model" 512 "$threads" 5 "$dtype" "$products")
hf=$(.venv/bin/python bench/bench_forward_hf.py "$model" 512 "$threads" 5 "$dtype" 2>/dev/null | tail -n 1)
echo "$cpp"
echo "$hf"
.venv/bin/python - "$cpp" "$hf" <<'PY'
import json, sys
c, h = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(f"forward T={c['T']} threads={c['threads']} {h['dtype']} (kvbound's products: {c['products']}): kvbound {c['tok_s']:.0f} tok/s, transformers "
      f"{h['tok_s']:.0f} tok/s, ratio {c['tok_s'] / h['tok_s']:.2f}x")
hf_s = c["T"] / h["tok_s"]
print(f"the model's matrix products alone (same shapes, dtype and threads) on kvbound's GEMM ({c['gemm']}): "
      f"{c['matrix_products_alone_s']:.3f} s = {c['matrix_products_alone_s'] / c['best_s']:.0%} of kvbound's forward; "
      f"a forward on this GEMM can be at most {hf_s / c['matrix_products_alone_s']:.2f}x transformers"
      + (" (bf16x3 products do not use this GEMM)" if c["products"] == "bf16x3" else ""))
if c["gemm"] != "aten":
    print(f"  the same products on ATen's GEMM (at::linear, transformers'): {c['aten_matrix_products_alone_s']:.3f} s = "
          f"{c['aten_matrix_products_alone_s'] / c['matrix_products_alone_s']:.2f}x kvbound's")
if c["compared_to_float32"]:
    print(f"{c['dtype']} with {c['products']} products vs float32 (kvbound, same tokens): mean KL {c['kl_to_float32']:.3g}, "
          f"top-1 agreement {c['top1_vs_float32']:.4f}, largest logit difference {c['max_logit_diff_to_float32']:.3g}")
print(f"peak RSS after load: kvbound {c['peak_rss_after_load_bytes'] / 2**20:.0f} MiB = "
      f"{c['peak_rss_after_load_bytes'] / c['fp32_weight_bytes']:.2f}x the fp32 weights "
      f"({c['fp32_weight_bytes'] / 2**20:.0f} MiB); transformers {h['peak_rss_after_load_bytes'] / 2**20:.0f} MiB")
PY
