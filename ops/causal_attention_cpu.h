// Causal attention of a prefill chunk over the cache on the CPU in bfloat16 — or in float32 with its two products
// as bf16x3 (ops/bf16x3_linear.h: q, K, V and the softmax weights each the sum of two bfloat16 numbers, three
// tile passes per product) — on the AMX tile units through oneDNN's batch-reduce GEMM micro-kernels (ATen's
// cpublas::brgemm), or, in bfloat16 on a CPU with AVX512-BF16 and no AMX (AMD Zen 4/5), with VDPBF16PS
// (ops/bf16_dot_panels.h: Kᵀ and Vᵀ packed in its panels). SDPA's CPU flash kernel spends most of its
// non-GEMM time per (head, 64-query block) — two oneDNN GEMM calls each, K and V read again for every query head
// of a GQA group; here the G query heads of a group are one block of rows, K and V are packed once per KV
// head and layer, and the softmax is one pass per row (a chunk's keys fit the buffer, so no online rescaling).
// The result is SDPA's within bfloat16 rounding, not bit for bit (tests/test_causal_attention_cpu.cpp bounds it
// by the plain bfloat16 formula's error against float64); which kernel runs depends on the CPU (AMX or not), so
// bfloat16 results differ slightly between machines. In float32 it is within a small multiple of the plain float32
// formula's error (tested), not SDPA's float32 result: the backbone takes it only where a float32 model's products
// are bf16x3 by choice (model.fp32_products).
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// Whether causal_attention_cpu can take these inputs: CPU bfloat16 or float32 (all three alike) q [B, Hq, T, D], keys and values
// [B, Hkv, N, D] with unit stride along D (any other strides), Hq a multiple of Hkv ≥ 1, D 64 or 128,
// T ≤ N ≤ 4096 keys (a task's scores, ≤ 256 rows × 4096 keys in float32, stay a few MiB), no gradient to carry,
// and a CPU whose oneDNN micro-kernels pack bfloat16 (AMX) with oneDNN enabled, or, for bfloat16 inputs, one with
// AVX512-BF16.
bool causal_attention_cpu_supported(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values);

// Whether it is also the faster kernel, hence the one the backbone takes: T ≥ 192 queries in bfloat16 on AMX,
// any T with VDPBF16PS, ≥ 128 in float32. Measured on SmolLM2's heads (`bench_cpu_attention T CACHED THREADS`, SDPA's time over this kernel's),
// bfloat16: 0.72–0.94 at 64–128 queries, 1.07–1.10 at 192, 1.2–1.35 at 256–512 on a first chunk; 0.75 for 128
// queries after 256 cached keys, where the softmax over the cache dominates both; 0.98–1.09 for 192–512 queries
// after 3584–3904. float32 (2 threads): 0.52 / 0.75 at 32 / 64 queries, 1.36 at 128, 1.48–1.76 at 192–1024 on a
// first chunk; 0.79 for 64 after 320 cached, 1.21 for 128 after 256, 1.41 for 512 after 3584.
// With VDPBF16PS (bfloat16, AMD EPYC Zen 5, 2 threads, `... 30 5 bfloat16 tiles`): every chunk, 1.50 / 2.20 / 3.32
// / 3.96 / 5.0 / 5.8 at 32 / 64 / 96 / 128 / 256 / 512 queries on a first chunk, 2.1–2.8 for 2–64 after 256–320
// cached, 4.0 for 128 after 256 and for 512 after 3584, 7.6 / 9.7 for one query after 256 / 1024; the float32
// sgemm kernel it replaces there (bfloat16 widened) gave 0.90 / 0.97 / 1.44 / 1.47 / 1.70 / 1.92 on the same first
// chunks, 1.05 for 128 after 256 and 1.26 for 512 after 3584.
bool causal_attention_cpu_fits(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values);

// softmax(q·kᵀ/√D + causal mask)·v with the chunk's T queries the last T of the N positions (query t sees keys
// 0 … N − T + t): output [B, Hq, T, D] (a transposed view of [B, T, Hq, D] storage, as SDPA's CPU kernel
// returns it) and, where logsumexp is given, each row's log Σ exp over the keys it sees, float32 [B, Hq, T].
at::Tensor causal_attention_cpu(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                at::Tensor* logsumexp);

}  // namespace kvbound::ops
