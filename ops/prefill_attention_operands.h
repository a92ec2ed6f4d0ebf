// What both CPU prefill attention kernels (ops/causal_attention_cpu, ops/causal_attention_float32) take: q
// [B, Hq, T, D] over keys and values [B, Hkv, N, D] on the CPU, one dtype (float32 or bfloat16), Hq a multiple
// of Hkv, T ≤ N ≤ max_keys (the chunk after its cache), unit stride along D, no gradient. Each kernel adds its
// own head-dim rule.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <cstdint>

namespace kvbound::ops {

inline bool prefill_attention_operands(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                       int64_t max_keys) {
  const at::ScalarType dtype = q.scalar_type();
  if (!q.is_cpu() || !keys.is_cpu() || !values.is_cpu() || (dtype != at::kFloat && dtype != at::kBFloat16) ||
      keys.scalar_type() != dtype || values.scalar_type() != dtype || q.dim() != 4 || keys.dim() != 4 ||
      values.sizes() != keys.sizes())
    return false;
  const int64_t D = q.size(3), T = q.size(2), N = keys.size(2), Hkv = keys.size(1);
  if (keys.size(3) != D || keys.size(0) != q.size(0) || Hkv < 1 || q.size(1) % Hkv != 0 || T < 1 || N < T ||
      N > max_keys)
    return false;
  if (q.stride(3) != 1 || keys.stride(3) != 1 || values.stride(3) != 1) return false;
  return !(at::GradMode::is_enabled() && (q.requires_grad() || keys.requires_grad() || values.requires_grad()));
}

}  // namespace kvbound::ops
