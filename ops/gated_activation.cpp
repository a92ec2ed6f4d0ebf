#include "ops/gated_activation.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <utility>

#include "ops/amx_panels.h"
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

// silu(gate)·up as silu_gate_float rounds it, then split as split_row splits it. Its own copy of the staging loop
// on purpose: both written as one template handing each value to a store callback made the bf16x3 forward 6%
// slower (bench_forward 512 2 5 float32 bf16x3, alternated 3×: 0.310–0.324 s against 0.330–0.337 s).
KVBOUND_VECTOR_CLONES void silu_gate_split(const float* gate, const float* up, uint16_t* hi, uint16_t* lo, int64_t n) {
  float e[kStretch];
  for (int64_t s = 0; s < n; s += kStretch) {
    const int64_t m = std::min(kStretch, n - s);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) e[i] = cpu::exp_float(-gate[s + i]);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) {
      const float v = gate[s + i] / (1.f + e[i]) * up[s + i];
      const uint16_t h = cpu::float_to_bf16(v);
      hi[s + i] = h;
      lo[s + i] = cpu::float_to_bf16(v - cpu::bf16_to_float(h));
    }
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

// d_gate = d_out·up·σ(g)·(1 + g·(1 − σ(g))), d_up = d_out·g·σ(g), in float32 and rounded once to the dtype
// (ATen's autograd of silu(gate)·up rounds silu(gate) and d_out·up to bfloat16 on the way: differences within
// those roundings). σ(g) = 1 / (1 + e^−g) with e^−g staged in a buffer, as the forward does. The staging loop is
// written out in each kernel on purpose: folded into one helper taking the second loop as a lambda, the bf16
// forward took 0.296–0.302 s instead of 0.257–0.261 (`bench_forward MODEL 512 1 5 bfloat16`, 3 alternations).
template <typename T, typename Load, typename Store>
inline void silu_gate_backward_span(const T* d_out, const T* gate, const T* up, T* d_gate, T* d_up, int64_t n,
                                    Load load, Store store) {
  float e[kStretch];
  for (int64_t s = 0; s < n; s += kStretch) {
    const int64_t m = std::min(kStretch, n - s);
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) e[i] = cpu::exp_float(-load(gate[s + i]));
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) {
      const float g = load(gate[s + i]), sigma = 1.f / (1.f + e[i]), dy = load(d_out[s + i]);
      d_up[s + i] = store(dy * (g * sigma));
      d_gate[s + i] = store(dy * load(up[s + i]) * (sigma * (1.f + g * (1.f - sigma))));
    }
  }
}

KVBOUND_VECTOR_CLONES void silu_gate_backward_float(const float* d_out, const float* gate, const float* up,
                                                    float* d_gate, float* d_up, int64_t n) {
  silu_gate_backward_span(d_out, gate, up, d_gate, d_up, n, [](float v) { return v; }, [](float v) { return v; });
}

KVBOUND_VECTOR_CLONES void silu_gate_backward_bf16(const uint16_t* d_out, const uint16_t* gate, const uint16_t* up,
                                                   uint16_t* d_gate, uint16_t* d_up, int64_t n) {
  silu_gate_backward_span(d_out, gate, up, d_gate, d_up, n, cpu::bf16_to_float, cpu::float_to_bf16);
}

bool fused_here(const at::Tensor& gate, const at::Tensor& up) {
  const at::ScalarType dtype = gate.scalar_type();
  return gate.is_cpu() && up.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         up.scalar_type() == dtype && gate.sizes() == up.sizes();
}

// Both input gradients of silu(gate)·up in one pass over the saved inputs (nothing else is saved: ATen's autograd
// of the formula keeps silu(gate) too and makes five passes).
std::pair<at::Tensor, at::Tensor> silu_gate_backward(const at::Tensor& d_out, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  const at::ScalarType dtype = gate.scalar_type();
  const at::Tensor g = gate.contiguous(), u = up.contiguous(), dy = d_out.to(dtype).contiguous();
  at::Tensor d_gate = at::empty_like(g), d_up = at::empty_like(u);
  at::parallel_for(0, g.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      silu_gate_backward_float(dy.const_data_ptr<float>() + begin, g.const_data_ptr<float>() + begin,
                               u.const_data_ptr<float>() + begin, d_gate.mutable_data_ptr<float>() + begin,
                               d_up.mutable_data_ptr<float>() + begin, end - begin);
    else
      silu_gate_backward_bf16(static_cast<const uint16_t*>(dy.const_data_ptr()) + begin,
                              static_cast<const uint16_t*>(g.const_data_ptr()) + begin,
                              static_cast<const uint16_t*>(u.const_data_ptr()) + begin,
                              static_cast<uint16_t*>(d_gate.mutable_data_ptr()) + begin,
                              static_cast<uint16_t*>(d_up.mutable_data_ptr()) + begin, end - begin);
  });
  return {d_gate, d_up};
}

// The fused forward of same-shape CPU float32 or bfloat16 tensors.
at::Tensor silu_gate_forward(const at::Tensor& gate, const at::Tensor& up) {
  const at::ScalarType dtype = gate.scalar_type();
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

class SiluGateFunction : public torch::autograd::Function<SiluGateFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return silu_gate_forward(gate, up);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto [d_gate, d_up] = silu_gate_backward(grad_outputs[0], saved[0], saved[1]);
    return {d_gate, d_up};
  }
};


}  // namespace

Bf16x3Rows silu_gate_rows(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(fused_here(gate, up) && gate.scalar_type() == at::kFloat && gate.dim() >= 1 &&
                  !(at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad())),
              "silu_gate_rows: expected two same-shape CPU float32 tensors without a gradient");
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const int64_t K = g.size(-1), padded = amx::round_up(K, 2), M = K == 0 ? 0 : g.numel() / K;
  Bf16x3Rows rows;
  rows.hi = at::empty({M, padded}, g.options().dtype(at::kBFloat16));
  rows.lo = at::empty({M, padded}, g.options().dtype(at::kBFloat16));
  rows.leading.assign(g.sizes().begin(), g.sizes().end() - 1);
  rows.in_features = K;
  auto* hi = static_cast<uint16_t*>(rows.hi.mutable_data_ptr());
  auto* lo = static_cast<uint16_t*>(rows.lo.mutable_data_ptr());
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      silu_gate_split(g.const_data_ptr<float>() + r * K, u.const_data_ptr<float>() + r * K, hi + r * padded,
                      lo + r * padded, K);
      for (int64_t k = K; k < padded; ++k) hi[r * padded + k] = lo[r * padded + k] = 0;
    }
  });
  return rows;
}

at::Tensor silu_gate(const at::Tensor& gate, const at::Tensor& up) {
  if (!fused_here(gate, up)) return at::silu(gate) * up;
  if (at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad()))
    return SiluGateFunction::apply(gate, up);
  return silu_gate_forward(gate, up);
}

}  // namespace kvbound::ops
