#include "ops/rope.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>

#include <torch/csrc/autograd/custom_function.h>

#include "ops/cpu_vector.h"

// Compiled with -ffp-contract=off (CMakeLists.txt): a product and a sum fused into one FMA would round once where
// the formula's separate ATen ops round twice.
namespace kvbound::ops {
namespace {

// One row of D values: out = x·c + rot(x)·s, rot(x)[i] = −x[i + D/2] for i < D/2, x[i − D/2] after.
KVBOUND_VECTOR_CLONES void rope_row_float(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
#pragma omp simd
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

// The same with each ATen op's bfloat16 rounding: both products, then their sum.
KVBOUND_VECTOR_CLONES void rope_row_bf16(const uint16_t* x, const uint16_t* c, const uint16_t* s, uint16_t* out,
                                         int64_t D) {
  using cpu::bf16_to_float;
  using cpu::float_to_bf16;
  const auto rounded = [](float v) { return bf16_to_float(float_to_bf16(v)); };
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i)
    out[i] = float_to_bf16(rounded(bf16_to_float(x[i]) * bf16_to_float(c[i])) +
                           rounded(-bf16_to_float(x[i + half]) * bf16_to_float(s[i])));
#pragma omp simd
  for (int64_t i = half; i < D; ++i)
    out[i] = float_to_bf16(rounded(bf16_to_float(x[i]) * bf16_to_float(c[i])) +
                           rounded(bf16_to_float(x[i - half]) * bf16_to_float(s[i])));
}

// x's gradient for one row: ∂/∂x Σ g·(x·c + rot(x)·s) = g·c + rotᵀ(g·s), rotᵀ(v)[i] = v[i + D/2] for i < D/2,
// −v[i − D/2] after: the products and sum ATen's autograd of the formula forms, in its order (the zero halves
// it adds along the way are exact), so float32 gradients equal the formula's bit for bit. No assumption on s.
KVBOUND_VECTOR_CLONES void rope_row_float_backward(const float* g, const float* c, const float* s, float* out, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = g[i] * c[i] + g[i + half] * s[i + half];
#pragma omp simd
  for (int64_t i = half; i < D; ++i) out[i] = g[i] * c[i] + -(g[i - half] * s[i - half]);
}

// Whether the fused pass takes x, cos and sin: a CPU [B, H, T, D] x with unit stride along D, cos and sin
// [T, D] of its dtype; with a gradient for x, float32 only (FusedRopeFunction), none for cos and sin.
bool takes_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType dtype = x.scalar_type();
  if (!x.is_cpu() || (dtype != at::kFloat && dtype != at::kBFloat16) || x.dim() != 4 || x.size(3) % 2 != 0) return false;
  if (at::GradMode::is_enabled() &&
      (cos.requires_grad() || sin.requires_grad() || (x.requires_grad() && dtype != at::kFloat)))
    return false;
  for (const at::Tensor* t : {&cos, &sin})
    if (!t->is_cpu() || t->scalar_type() != dtype || t->dim() != 2 || t->size(0) != x.size(2) ||
        t->size(1) != x.size(3) || !t->is_contiguous())
      return false;
  return x.stride(3) == 1 && x.is_non_overlapping_and_dense();
}

// out[b, h, t] = row(x[b, h, t], cos[t], sin[t]) for every row, out in x's layout (a head-transposed view stays
// one) unless given another.
template <typename Element, typename Row>
at::Tensor map_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, Row row,
                    at::IntArrayRef out_strides = {}) {
  at::Tensor out = out_strides.empty() ? at::empty_like(x) : at::empty_strided(x.sizes(), out_strides, x.options());
  const int64_t H = x.size(1), T = x.size(2), D = x.size(3), rows = x.size(0) * H * T;
  const auto* x_data = static_cast<const Element*>(x.const_data_ptr());
  const auto* c = static_cast<const Element*>(cos.const_data_ptr());
  const auto* s = static_cast<const Element*>(sin.const_data_ptr());
  auto* out_data = static_cast<Element*>(out.mutable_data_ptr());
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (H * T), h = r / T % H, t = r % T;
      row(x_data + b * x.stride(0) + h * x.stride(1) + t * x.stride(2), c + t * D, s + t * D,
          out_data + b * out.stride(0) + h * out.stride(1) + t * out.stride(2), D);
    }
  });
  return out;
}

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (x.scalar_type() == at::kBFloat16) return map_rows<uint16_t>(x, cos, sin, rope_row_bf16);
  return map_rows<float>(x, cos, sin, rope_row_float);
}

// The fused pass forward and backward for a float32 x that needs a gradient (cos and sin constants). x's gradient
// comes out in x's layout, whatever the incoming gradient's: x is typically a head-transposed view of a norm's
// output (the indexer's keys), whose backward then reads its gradient's rows in place instead of copying them.
class FusedRopeFunction : public torch::autograd::Function<FusedRopeFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["x_strides"] = x.strides().vec();
    return fused_rope(x, cos, sin);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = grad_outputs[0];
    if (!takes_fused(grad, saved[0], saved[1])) grad = grad.contiguous();
    const std::vector<int64_t> x_strides = ctx->saved_data["x_strides"].toIntVector();
    return {map_rows<float>(grad, saved[0], saved[1], rope_row_float_backward, x_strides), {}, {}};
  }
};

}  // namespace

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!takes_fused(x, cos, sin)) return x * cos + rotate_half(x) * sin;
  if (at::GradMode::is_enabled() && x.requires_grad()) return FusedRopeFunction::apply(x, cos, sin);
  return fused_rope(x, cos, sin);
}

}  // namespace kvbound::ops
