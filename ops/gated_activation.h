// SwiGLU's gate: silu(gate) ⊙ up, the product the Llama-family MLP sends through its down projection.
#pragma once
#include <ATen/core/Tensor.h>

#include "ops/bf16x3_linear.h"

namespace kvbound::ops {

// silu(gate) * up for same-shape tensors. On the CPU in float32 or bfloat16: one fused vectorized pass
// (ops/gated_activation.cpp) with the formula's rounding steps (silu rounded to the dtype, then the product); its
// exp is ops/cpu_vector.h's (within 1 ulp of the exact one), so results agree with ATen's silu to float32
// rounding, not bit for bit. With a gradient to carry, an autograd function whose backward forms both input
// gradients in one fused pass from the saved inputs (in float32, rounded once). Elsewhere at::silu(gate) * up.
at::Tensor silu_gate(const at::Tensor& gate, const at::Tensor& up);

// The same product for a float32 CPU pair without a gradient, written straight as bf16x3 rows (the down
// projection's input on the tiles, ops/bf16x3_linear.h) instead of a float32 tensor that split_rows would read
// again: equal to split_rows(silu_gate(gate, up)) bit for bit.
Bf16x3Rows silu_gate_rows(const at::Tensor& gate, const at::Tensor& up);

}  // namespace kvbound::ops
