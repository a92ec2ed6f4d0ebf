// Causal attention of a prefill chunk over the cache on the CPU, both products in float32 on the BLAS sgemm (MKL's
// in the torch wheel), no AMX: the plain float32 model's kernel, and a bfloat16 model's on a CPU with neither AMX
// nor AVX512-BF16 (ops/causal_attention_cpu takes bfloat16 on either): bfloat16 q, K and V widened once, the
// output rounded once, since SDPA's bfloat16 kernel there hands MKL's bfloat16 GEMM small blocks, which it
// converts and multiplies as float32 anyway. SDPA's CPU flash kernel at a
// 512-token chunk splits the keys in blocks of 512, so every query block
// multiplies against every key of the chunk and masks half of them away, and reads K and V again for each query
// head of a GQA group. Here the G query heads of a group are one block of rows, each block of queries multiplies
// only the keys it can see (half the products of a first chunk), and the softmax is one pass per row (a chunk's
// keys fit the buffer, so no online rescaling). The result is within a small multiple of the plain float32
// formula's error against float64, in bfloat16 of the plain bfloat16 formula's (tests/test_causal_attention_float32.cpp),
// not SDPA's bit for bit.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// Whether causal_attention_float32 can take these inputs: CPU float32 or bfloat16 (all three alike) q [B, Hq, T, D], keys and values
// [B, Hkv, N, D] with unit stride along D (any other strides), Hq a multiple of Hkv ≥ 1, 1 ≤ D ≤ 256,
// T ≤ N ≤ 4096 keys (a task's scores, ≤ 256 rows × 4096 keys, stay a few MiB), no gradient to carry.
bool causal_attention_float32_supported(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values);

// Whether it is also the faster kernel, hence the one the backbone takes: T ≥ 96 queries, and never bfloat16 on an
// AMX CPU (SDPA's bfloat16 products run on the tiles there; ops/causal_attention_cpu takes the longer chunks). Measured on SmolLM2's
// heads (`bench_cpu_attention T CACHED 2 9 3 64 30 7 float32 sgemm`, SDPA's time over this kernel's, 2 threads):
// 0.68 / 0.77 at 32 / 64 queries, 1.25 at 96, 1.33 at 128, 1.31–1.71 at 192–512 (1.73 at one thread), 1.39 at 1024
// on a first chunk; 0.95 for 64 after 320 cached, 1.01 for 128 after 256, 1.24 for 512 after 3584.
// bfloat16 on an AMD EPYC without AMX (`... 30 5 bfloat16 sgemm`, 2 threads): 1.15 / 1.07 at 32 / 64, 1.45 at 96,
// 1.30 at 128, 1.67 at 256, 1.90–2.05 at 512 on a first chunk; 1.14 for 64 after 320, 1.40 for 128 after 256, 1.42
// for 512 after 3584 (the same 96-query threshold kept for both dtypes).
bool causal_attention_float32_fits(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values);

// softmax(q·kᵀ/√D + causal mask)·v with the chunk's T queries the last T of the N positions (query t sees keys
// 0 … N − T + t): output [B, Hq, T, D] in q's dtype (a transposed view of [B, T, Hq, D] storage, as SDPA's CPU kernel
// returns it) and, where logsumexp is given, each row's log Σ exp over the keys it sees, float32 [B, Hq, T].
at::Tensor causal_attention_float32(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                    at::Tensor* logsumexp);

}  // namespace kvbound::ops
