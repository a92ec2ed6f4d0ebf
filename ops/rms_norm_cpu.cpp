// The CPU kernel of kvbound::rms_norm for float32 and bfloat16: one pass per row computes the mean square in
// float32, a second writes weight * cast<T>(x * rsqrt(ms + eps)), vectorized (ops/cpu_vector.h); the ATen
// composition (ops/rms_norm.h) made ~8 passes over the row with a float32 copy in between. Other dtypes take
// that composition. The rounding steps are the formula's; only the order in which the squares are summed
// differs (a fixed one here), so results agree to float32 rounding (tests/test_ops.cpp holds it to the
// formula's own error, and a row's result to be the same wherever the row sits).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "ops/cpu_vector.h"
#include "ops/rms_norm.h"

namespace kvbound::ops {
namespace {

KVBOUND_VECTOR_CLONES void rms_norm_rows_float(const float* x, const float* w, float* y, int64_t rows, int64_t cols,
                                               float eps) {
  for (int64_t r = 0; r < rows; ++r, x += cols, y += cols) {
    const float sum = cpu::fixed_order_sum(cols, [x](int64_t i) { return x[i] * x[i]; });
    const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) y[i] = w[i] * (x[i] * inv_rms);
  }
}

KVBOUND_VECTOR_CLONES void rms_norm_rows_bf16(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows,
                                              int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r, x += cols, y += cols) {
    const float sum = cpu::fixed_order_sum(cols, [x](int64_t i) {
      const float v = cpu::bf16_to_float(x[i]);
      return v * v;
    });
    const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
    // normed rounds to bfloat16 before the weight multiplies it, as in the formula.
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) {
      const float normed = cpu::bf16_to_float(cpu::float_to_bf16(cpu::bf16_to_float(x[i]) * inv_rms));
      y[i] = cpu::float_to_bf16(cpu::bf16_to_float(w[i]) * normed);
    }
  }
}

// dx = r·(g⊙w) − r³·x·Σ(g⊙w·x)/D per row, r = rsqrt(mean(x²) + eps): the input gradient of the formula with
// the bfloat16 rounding of the normalised value passed straight through, as ATen's autograd of it passes it.
// g⊙w is formed in float32 (ATen's autograd rounds it to bfloat16 first: a difference within that rounding).
template <typename T, typename Load, typename Store>
inline void rms_norm_backward_row(const T* g, const T* x, const T* w, T* dx, int64_t cols, float eps, Load load,
                                  Store store) {
  const float sum = cpu::fixed_order_sum(cols, [&](int64_t i) { return load(x[i]) * load(x[i]); });
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
  const float dot = cpu::fixed_order_sum(cols, [&](int64_t i) { return load(g[i]) * load(w[i]) * load(x[i]); });
  const float coef = inv_rms * inv_rms * inv_rms * dot / static_cast<float>(cols);
#pragma omp simd
  for (int64_t i = 0; i < cols; ++i) dx[i] = store(inv_rms * (load(g[i]) * load(w[i])) - coef * load(x[i]));
}

KVBOUND_VECTOR_CLONES void rms_norm_backward_rows_float(const float* g, const float* x, const float* w, float* dx,
                                                        int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r, g += cols, x += cols, dx += cols)
    rms_norm_backward_row(g, x, w, dx, cols, eps, [](float v) { return v; }, [](float v) { return v; });
}

KVBOUND_VECTOR_CLONES void rms_norm_backward_rows_bf16(const uint16_t* g, const uint16_t* x, const uint16_t* w,
                                                       uint16_t* dx, int64_t rows, int64_t cols, float eps) {
  for (int64_t r = 0; r < rows; ++r, g += cols, x += cols, dx += cols)
    rms_norm_backward_row(g, x, w, dx, cols, eps, cpu::bf16_to_float, cpu::float_to_bf16);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kBFloat16) || weight.scalar_type() != dtype || x.dim() == 0)
    return rms_norm_reference(x, weight, eps);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "kvbound::rms_norm: weight must be [",
              x.size(-1), "]; got ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t cols = xc.size(-1), rows = cols == 0 ? 0 : xc.numel() / cols;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));  // ~64 KiB of float32 per task
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      rms_norm_rows_float(xc.const_data_ptr<float>() + begin * cols, wc.const_data_ptr<float>(),
                          y.mutable_data_ptr<float>() + begin * cols, end - begin, cols, eps_f);
    else
      rms_norm_rows_bf16(static_cast<const uint16_t*>(xc.const_data_ptr()) + begin * cols,
                         static_cast<const uint16_t*>(wc.const_data_ptr()),
                         static_cast<uint16_t*>(y.mutable_data_ptr()) + begin * cols, end - begin, cols, eps_f);
  });
  return y;
}

}  // namespace

bool rms_norm_input_gradient_fused(const at::Tensor& x, const at::Tensor& weight) {
  const at::ScalarType dtype = x.scalar_type();
  return x.is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype &&
         x.dim() > 0 && weight.dim() == 1 && weight.size(0) == x.size(-1);
}

at::Tensor rms_norm_input_gradient(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(rms_norm_input_gradient_fused(x, weight) && grad.sizes() == x.sizes(),
              "kvbound::rms_norm_input_gradient: expected CPU float32/bfloat16 x and weight [", x.size(-1),
              "] of its dtype and a gradient of x's shape; got ", x.sizes(), " ", x.scalar_type(), ", ", weight.sizes(),
              " ", weight.scalar_type(), ", ", grad.sizes());
  const at::ScalarType dtype = x.scalar_type();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = grad.to(dtype).contiguous();
  at::Tensor dx = at::empty_like(xc);
  const int64_t cols = xc.size(-1), rows = cols == 0 ? 0 : xc.numel() / cols;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (dtype == at::kFloat)
      rms_norm_backward_rows_float(gc.const_data_ptr<float>() + begin * cols, xc.const_data_ptr<float>() + begin * cols,
                                   wc.const_data_ptr<float>(), dx.mutable_data_ptr<float>() + begin * cols, end - begin,
                                   cols, eps_f);
    else
      rms_norm_backward_rows_bf16(static_cast<const uint16_t*>(gc.const_data_ptr()) + begin * cols,
                                  static_cast<const uint16_t*>(xc.const_data_ptr()) + begin * cols,
                                  static_cast<const uint16_t*>(wc.const_data_ptr()),
                                  static_cast<uint16_t*>(dx.mutable_data_ptr()) + begin * cols, end - begin, cols, eps_f);
  });
  return dx;
}

}  // namespace kvbound::ops

TORCH_LIBRARY_IMPL(kvbound, CPU, m) { m.impl("rms_norm", &kvbound::ops::rms_norm_cpu); }
