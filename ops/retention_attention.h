// kvbound::ops::retention_attention: TRIM-KV's training attention (DESIGN.md, "TRIM-KV").
//
//   out[b,h,t] = Σ_{i≤t} softmax_i( q_t·k_i/√D + (t−i)·log_beta[b,g(h),i] ) v_i,   g(h) = h / (Hq/Hkv),
//
// i.e. causal attention whose exp-scores are weighted by β_i^(t−i). q: [B, Hq, T, D]; k, v: [B, Hkv, T, D];
// log_beta: [B, Hkv, T] (≤ 0, one retention score per token per KV head). Gradients flow to all four.
//
// Memory-bounded, FlashAttention-2 style: the forward walks key blocks with an online softmax and saves
// only the row logsumexp [B, Hq, T]; the backward recomputes the probabilities block by block. No T×T
// tensor exists on either path. Dispatcher ops kvbound::retention_attention_fwd / _bwd, with a CPU kernel
// (blocked, parallel over batch × head × query block; float32/float64 arithmetic, bf16/fp16 computed in
// float32; float32 tile products by oneDNN's brgemm micro-kernel) and CUDA kernels (ops/retention_attention_cuda.cu; fp32/bf16/fp16 inputs, fp32 accumulation; bf16/fp16
// with head dim 64 or 128 on tensor cores, ops/retention_attention_mma.cu).
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// query_block × key_block are the CPU kernel's tile sizes (any positive values; T need not be a multiple).
// The CUDA kernel's tiles are fixed by its warp layout and ignore them.
at::Tensor retention_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& log_beta, int64_t query_block = 64, int64_t key_block = 64);

// The naive formula with plain ATen ops (materialises the [B, Hq, T, T] scores; autograd through ATen):
// the reference that tests and benches compare the kernels with.
at::Tensor retention_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& log_beta);

}  // namespace kvbound::ops
