// TRIM-KV's quality terms (DESIGN.md, "TRIM-KV"): forward KL(p_teacher ‖ p_student) over next-token
// distributions and next-token cross-entropy, both averaged over positions by their weights:
//
//   kl = Σ_{b,t} w[b,t]·KL(softmax(th[b,t]·Wᵀ) ‖ softmax(sh[b,t]·Wᵀ)) / Σ w
//   ce = Σ_{b,t} w[b,t]·(−log softmax(sh[b,t]·Wᵀ)[target[b,t]]) / Σ w
//
// Memory-bounded: logits exist for block_rows positions at a time (float32; with bfloat16 hidden states and head
// on an AMX CPU their products run on the tile units, ops/amx_panels.h), in the forward only, so no
// [B·T, V] tensor is ever allocated; peak extra memory is two [block_rows, V] float buffers and, for the
// backward, one or two [B·T, d] float tensors (plus a float32 copy of the head when it is stored in another
// dtype).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvbound::losses {

struct DistillationTerms {
  at::Tensor kl, ce;  // float32 scalars
};

// Which terms a loss will differentiate. kKlOnly saves one [rows, V] × [V, d] product per block (of four):
// ce is still computed, for logging, but a backward that reaches it with a non-zero gradient fails.
enum class DistillationGradients { kBoth, kKlOnly };

// student_hidden [B, T, d] (the final-norm output of the student; the only input that gets a gradient),
// teacher_hidden [B, T, d] (no grad), both float32, bfloat16 or float16 (logits are computed in float32);
// head [V, d] the frozen lm_head; targets [B, T] int64, the next token of each position (any value, e.g.
// −1, where the weight is 0); weights [B, T] ≥ 0 (a 0/1 mask or per-position weights, Σ w > 0).
// Gradients reach student_hidden only; teacher_hidden, head and weights must not require grad.
DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const at::Tensor& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows = 128,
                                    DistillationGradients gradients = DistillationGradients::kBoth);

// The same formulas over full [B, T, V] logits with plain ATen autograd: what tests compare with.
DistillationTerms distillation_loss_reference(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                              const at::Tensor& head, const at::Tensor& targets,
                                              const at::Tensor& weights);

}  // namespace kvbound::losses
