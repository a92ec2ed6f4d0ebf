// float32 linear layers on the bfloat16 tile units (AMX): x·Wᵀ with each float32 factor written as the sum of
// two bfloat16 numbers, x = x_hi + x_lo and W = W_hi + W_lo (hi the value rounded to bfloat16, lo the rest
// rounded again: 16 of float32's 24 significant bits), and the product formed as x_hi·W_hiᵀ + x_lo·W_hiᵀ +
// x_hi·W_loᵀ in float32 — "bf16x3", what PyTorch's float32 matmul precision "high" names. |x_lo| ≤ 2^-8·|x| and
// |x − x_hi − x_lo| ≤ 2^-17·|x|, so the terms it drops (x_lo·W_loᵀ and both remainders) are at most ~2^-15 of
// Σ|x|·|w| in the worst case and far less with random signs: tests/test_bf16x3_linear.cpp measures 7–38× the
// float32 GEMM's own largest error against float64. On a CPU with AMX the three bfloat16 passes take about half
// the time of one float32 pass (bench/bench_forward). The weight is split and packed once (ops/amx_panels.h), in
// as many bytes as its float32 copy. An infinite input or weight makes its row or column NaN (its lo is
// inf − inf), where a float32 GEMM may give ±inf.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvbound::ops {

// Whether this CPU runs bfloat16 tile products (ops/amx_panels.h); asked per call, as it follows mkldnn's switch.
bool bf16x3_available();

// A float32 weight [N, K] (a linear layer's out × in) as W_hi and W_lo, packed in panels of 64 output rows,
// K rounded up to even with a zero column.
class Bf16x3Weight {
 public:
  Bf16x3Weight() = default;
  explicit Bf16x3Weight(const at::Tensor& weight);
  bool defined() const { return hi_.defined(); }
  int64_t out_features() const { return out_; }
  int64_t in_features() const { return in_; }
  int64_t padded_in() const { return padded_in_; }
  const uint16_t* hi() const { return static_cast<const uint16_t*>(hi_.const_data_ptr()); }
  const uint16_t* lo() const { return static_cast<const uint16_t*>(lo_.const_data_ptr()); }

 private:
  at::Tensor hi_, lo_;
  int64_t out_ = 0, in_ = 0, padded_in_ = 0;
};

// One float32 row x [K] as x_hi and x_lo, bfloat16 bits each, zero-padded to `padded` ≥ K columns.
void split_row(const float* x, int64_t K, int64_t padded, uint16_t* hi, uint16_t* lo);

// Rows of a float32 input [..., K] as x_hi and x_lo ([M, K rounded up to even] bfloat16 each), split once for
// every weight that reads the same input (q, k and v; gate and up).
struct Bf16x3Rows {
  at::Tensor hi, lo;
  std::vector<int64_t> leading;  // the input's sizes but the last (the output keeps them)
  int64_t in_features = 0;
};
Bf16x3Rows split_rows(const at::Tensor& x);

// x·Wᵀ (+ bias, float32 [N], when defined) as float32 [..., N], without a gradient. The value of each output
// element depends on its row and column alone, not on the thread count or on the other rows.
at::Tensor bf16x3_linear(const Bf16x3Rows& x, const Bf16x3Weight& weight, const at::Tensor& bias = {});

// The same product for an input x that may carry a gradient (`rows` split off x, `weight` the float32 W that
// `tiles` was prepared from): the forward on the tiles, x's gradient dY·W by ATen's float32 GEMM. W and the
// bias are frozen (a weight that needs a gradient is an error).
at::Tensor bf16x3_linear(const at::Tensor& x, const Bf16x3Rows& rows, const Bf16x3Weight& tiles,
                         const at::Tensor& weight, const at::Tensor& bias = {});

}  // namespace kvbound::ops
