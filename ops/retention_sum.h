// kvbound::ops::retention_sum: TRIM-KV's expected cache occupancy (DESIGN.md, "capacity"),
//
//   S[..., t] = Σ_{i≤t} β_i^(t−i) = Σ_{i≤t} exp((t−i)·log_beta[..., i])      for every t,
//
// over the last dimension of log_beta (any leading dims, e.g. [B, Hkv, T]). Backward:
// ∂S_t/∂log_beta_i = (t−i)·β_i^(t−i) for i ≤ t, so grad_log_beta[i] = Σ_{t≥i} grad_S[t]·(t−i)·β_i^(t−i).
//
// Tiled: every term is recomputed inside a block × block tile, so memory is O(numel) besides one tile per
// thread. Dispatcher ops kvbound::retention_sum_fwd / _bwd with a CPU kernel (float32/float64 arithmetic,
// bf16/fp16 computed in float32) and a CUDA kernel (ops/retention_sum_cuda.cu; fp32 accumulation).
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// block: the CPU kernel's tile edge (positions); the CUDA kernel has its own fixed tiles.
at::Tensor retention_sum(const at::Tensor& log_beta, int64_t block = 256);

// The naive formula with plain ATen ops (materialises [..., T, T]; autograd through ATen): tests and
// benches compare the kernels with it.
at::Tensor retention_sum_reference(const at::Tensor& log_beta);

}  // namespace kvbound::ops
