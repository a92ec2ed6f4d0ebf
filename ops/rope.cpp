#include "ops/rope.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>

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

bool takes_fused(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::ScalarType dtype = x.scalar_type();
  if (!x.is_cpu() || (dtype != at::kFloat && dtype != at::kBFloat16) || x.dim() != 4 || x.size(3) % 2 != 0) return false;
  if (at::GradMode::is_enabled() && (x.requires_grad() || cos.requires_grad() || sin.requires_grad())) return false;
  for (const at::Tensor* t : {&cos, &sin})
    if (!t->is_cpu() || t->scalar_type() != dtype || t->dim() != 2 || t->size(0) != x.size(2) ||
        t->size(1) != x.size(3) || !t->is_contiguous())
      return false;
  return x.stride(3) == 1 && x.is_non_overlapping_and_dense();
}

}  // namespace

at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  if (!takes_fused(x, cos, sin)) return x * cos + rotate_half(x) * sin;
  at::Tensor out = at::empty_like(x);  // x's strides: a head-transposed view stays one
  const int64_t H = x.size(1), T = x.size(2), D = x.size(3), rows = x.size(0) * H * T;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto* x_bytes = static_cast<const char*>(x.const_data_ptr());
  auto* out_bytes = static_cast<char*>(out.mutable_data_ptr());
  const int64_t size = static_cast<int64_t>(x.element_size());
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (H * T), h = row / T % H, t = row % T;
      const int64_t x_at = (b * x.stride(0) + h * x.stride(1) + t * x.stride(2)) * size;
      const int64_t out_at = (b * out.stride(0) + h * out.stride(1) + t * out.stride(2)) * size;
      if (bf16)
        rope_row_bf16(reinterpret_cast<const uint16_t*>(x_bytes + x_at),
                      static_cast<const uint16_t*>(cos.const_data_ptr()) + t * D,
                      static_cast<const uint16_t*>(sin.const_data_ptr()) + t * D,
                      reinterpret_cast<uint16_t*>(out_bytes + out_at), D);
      else
        rope_row_float(reinterpret_cast<const float*>(x_bytes + x_at), cos.const_data_ptr<float>() + t * D,
                       sin.const_data_ptr<float>() + t * D, reinterpret_cast<float*>(out_bytes + out_at), D);
    }
  });
  return out;
}

}  // namespace kvbound::ops
