// kvbound::ops::gathered_row_dot: each row of b dotted with the row of a an index picks for its position,
//
//   out[b, h, t] = Σ_d a[b, h, index[t], d] · b[b, h, t, d],
//
// the last step of the linear mean score (ops/pooled_index_score.cpp), where a holds the few suffix sums of the
// window's queries and b every key. The formula in ATen ops (index_select, a product, a sum) writes the gathered
// rows and the product, each as large as b, and their backward writes two more; the fused CPU pass reads b once
// forward and writes its gradient once backward.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// a [B, H, N, d], b [B, H, T, d] (unit stride along d; any other strides), index [T] int64 in [0, N) -> [B, H, T].
// CPU float32 / float64 take the fused pass (b's gradient in b's layout); anything else the ATen formula.
// Differentiable in a and b.
at::Tensor gathered_row_dot(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b);

// The formula in ATen ops: the tests compare the fused pass with it.
at::Tensor gathered_row_dot_reference(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b);

}  // namespace kvbound::ops
