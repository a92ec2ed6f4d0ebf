// RoPE's rotation in transformers' rotate-half convention: x·cos + rotate_half(x)·sin, rotate_half(x) =
// [−x₂, x₁] for the two halves of the head dim. One call site for the backbone's queries and keys and the
// indexer's.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::ops {

// x [..., D] with cos, sin broadcasting against it (the angles of x's positions, each frequency twice, in x's
// dtype). A CPU float32 / bfloat16 x of shape [B, H, T, D] with unit stride along D, cos and sin [T, D] without
// a gradient takes one fused pass (ops/rope.cpp) whose result equals the formula's bit for bit, every rounding
// step included; a float32 x that needs a gradient takes it both ways (its gradient, too, the formula's bit for
// bit: the indexer's keys in IndexMem training); anything else takes the formula in ATen ops (autograd included).
at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// [−x₂, x₁] along the last dim.
at::Tensor rotate_half(const at::Tensor& x);

}  // namespace kvbound::ops
