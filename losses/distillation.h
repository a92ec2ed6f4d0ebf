// TRIM-KV's quality terms (DESIGN.md, "TRIM-KV"): forward KL(p_teacher ‖ p_student) over next-token
// distributions and next-token cross-entropy, both averaged over positions by their weights:
//
//   kl = Σ_{b,t} w[b,t]·KL(softmax(th[b,t]·Wᵀ) ‖ softmax(sh[b,t]·Wᵀ)) / Σ w
//   ce = Σ_{b,t} w[b,t]·(−log softmax(sh[b,t]·Wᵀ)[target[b,t]]) / Σ w
//
// Memory-bounded: logits exist for block_rows positions at a time (float32; with bfloat16 hidden states and head
// on an AMX CPU their products run on the tile units, ops/amx_panels.h, on an AVX512-BF16 one through
// ops/bf16_dot_panels.h; float32 ones on oneDNN where ops/onednn_linear.h prefers it), in the forward only, so no
// [B·T, V] tensor is ever allocated; peak extra memory is two [block_rows, V] float buffers (on the tile units
// one or two [block_rows, V] bfloat16 ones beside them, the probabilities multiplied into the head) and, for the
// backward, one or two [B·T, d] float tensors (d rounded up to 64 on the tile units). Per row the softmaxes, the
// KL and the probabilities are one fused pass on CPU (ops/distillation_rows.h).
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

// The frozen LM head W [V, d] in the forms the loss multiplies it in, made once per head rather than per update
// (a trainer keeps one): a bfloat16 head on an AMX CPU packed twice for the tile units, W for the logits h·Wᵀ and
// Wᵀ for the products p·W into the head (2·V·d bfloat16 values) — on a CPU with AVX512-BF16 but no AMX, the same
// two packings for its dot-product kernel (ops/bf16_dot_panels.h); any other head as a float32 copy (none when it
// is float32 already). "On the tiles" below means either bfloat16 panel engine.
class DistillationHead {
 public:
  explicit DistillationHead(const at::Tensor& head);
  const at::Tensor& weight() const { return weight_; }  // as given

  // The loss's building blocks (losses/distillation.cpp).
  bool on_tiles(const at::Tensor& hidden) const;  // bfloat16 CPU hidden states and a packed head
  at::Tensor float_weight() const;
  int64_t logit_columns(bool tiles) const;  // V, or V rounded up to whole panels of 64 on the tiles
  int64_t mix_depth() const;                // V rounded up to even: the K of p·W on the tiles
  // hidden_rows·Wᵀ as float32 [n, logit_columns]: buffer[:n], or a new tensor where oneDNN forms the float32
  // product (ops/onednn_linear.h; it writes no given buffer, which may be undefined there). head_float is
  // float_weight() off the tiles.
  at::Tensor logits(const at::Tensor& buffer, const at::Tensor& hidden_rows, const at::Tensor& head_float,
                    bool tiles) const;
  // out [n, d rounded up to 64] float32 = probabilities [n, mix_depth()] bfloat16 · W, on the tiles.
  void mix_into(const at::Tensor& out, const at::Tensor& probabilities) const;
  // out [n, d] = probabilities [n, V] float32 · head_float, off the tiles.
  void mix_float_into(const at::Tensor& out, const at::Tensor& probabilities, const at::Tensor& head_float) const;

 private:
  at::Tensor weight_, float_, logit_panels_, mix_panels_;
  bool amx_ = false;  // the panels are oneDNN's for the AMX tiles; else ops/bf16_dot_panels.h's
};

// student_hidden [B, T, d] (the final-norm output of the student; the only input that gets a gradient),
// teacher_hidden [B, T, d] (no grad), both float32, bfloat16 or float16 (logits are computed in float32);
// head [V, d] the frozen lm_head; targets [B, T] int64, the next token of each position (any value, e.g.
// −1, where the weight is 0); weights [B, T] ≥ 0 (a 0/1 mask or per-position weights, Σ w > 0).
// Gradients reach student_hidden only; teacher_hidden, head and weights must not require grad.
DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const DistillationHead& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows = 128,
                                    DistillationGradients gradients = DistillationGradients::kBoth);

// The same with the head prepared for this call alone.
DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const at::Tensor& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows = 128,
                                    DistillationGradients gradients = DistillationGradients::kBoth);

// The same formulas over full [B, T, V] logits with plain ATen autograd: what tests compare with.
DistillationTerms distillation_loss_reference(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                              const at::Tensor& head, const at::Tensor& targets,
                                              const at::Tensor& weights);

}  // namespace kvbound::losses
