#include "ops/gated_activation.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>

#include <algorithm>

#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

// e^−g of a stretch of the row goes to a buffer on the stack first, then the gate reads it: in one loop GCC
// specialises the division for exp_float's clamped constants (ops/cpu_vector.h), three divisions per lane.
constexpr int64_t kStretch = 256;

KVBOUND_VECTOR_CLONES void silu_gate_float(const float* gate, const float* up, float* out, int64_t n) {
  float e[kStretch];
  for (int64_t s = 0; s < n; s += kStretch) {
    const int64_t m = std::min(kStretch, n - s);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) e[i] = cpu::exp_float(-gate[s + i]);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) out[s + i] = gate[s + i] / (1.f + e[i]) * up[s + i];
  }
}

KVBOUND_VECTOR_CLONES void silu_gate_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  using cpu::bf16_to_float;
  using cpu::float_to_bf16;
  float e[kStretch];
  for (int64_t s = 0; s < n; s += kStretch) {
    const int64_t m = std::min(kStretch, n - s);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) e[i] = cpu::exp_float(-bf16_to_float(gate[s + i]));
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) {
      const float g = bf16_to_float(gate[s + i]);
      const float silu = bf16_to_float(float_to_bf16(g / (1.f + e[i])));
      out[s + i] = float_to_bf16(silu * bf16_to_float(up[s + i]));
    }
  }
}

}  // namespace

at::Tensor silu_gate(const at::Tensor& gate, const at::Tensor& up) {
  const at::ScalarType dtype = gate.scalar_type();
  const bool fused = gate.is_cpu() && up.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                     up.scalar_type() == dtype && gate.sizes() == up.sizes() &&
                     !(at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad()));
  if (!fused) return at::silu(gate) * up;
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor out = at::empty_like(g);
  at::parallel_for(0, g.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      silu_gate_float(g.const_data_ptr<float>() + begin, u.const_data_ptr<float>() + begin,
                      out.mutable_data_ptr<float>() + begin, end - begin);
    else
      silu_gate_bf16(static_cast<const uint16_t*>(g.const_data_ptr()) + begin,
                     static_cast<const uint16_t*>(u.const_data_ptr()) + begin,
                     static_cast<uint16_t*>(out.mutable_data_ptr()) + begin, end - begin);
  });
  return out;
}

}  // namespace kvbound::ops
