#include "losses/distillation.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>

#include "ops/amx_panels.h"

namespace kvbound::losses {
namespace {

// Shapes, dtypes and the values the loss relies on, checked before any logits are formed. `fn` names the
// public function in the message.
void check_inputs(const char* fn, const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& head,
                  const at::Tensor& targets, const at::Tensor& weights) {
  TORCH_CHECK(student.dim() == 3 && teacher.sizes() == student.sizes(), fn,
              ": student_hidden and teacher_hidden must both be [B, T, d]; got ", student.sizes(), " and ",
              teacher.sizes());
  TORCH_CHECK(head.dim() == 2 && head.size(0) > 0 && head.size(1) == student.size(2), fn,
              ": head must be [V, d] with d = ", student.size(2), "; got ", head.sizes());
  TORCH_CHECK(targets.sizes() == student.sizes().slice(0, 2) && weights.sizes() == targets.sizes(), fn,
              ": targets and weights must be [B, T] = ", student.sizes().slice(0, 2), "; got ", targets.sizes(),
              " and ", weights.sizes());
  const at::ScalarType dtype = student.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && teacher.scalar_type() == dtype,
              fn, ": student_hidden and teacher_hidden must share one dtype (float32, bfloat16, float16); got ", dtype,
              " and ", teacher.scalar_type());
  TORCH_CHECK(at::isFloatingType(head.scalar_type()) && at::isFloatingType(weights.scalar_type()), fn,
              ": head and weights must be floating point; got ", head.scalar_type(), " and ", weights.scalar_type());
  TORCH_CHECK(targets.scalar_type() == at::kLong, fn, ": targets must be int64; got ", targets.scalar_type());
  TORCH_CHECK(teacher.device() == student.device() && head.device() == student.device() &&
                  targets.device() == student.device() && weights.device() == student.device(),
              fn, ": all inputs must be on one device");
  // A gradient that silently went nowhere would be a bug in the caller: say so.
  TORCH_CHECK(!teacher.requires_grad() && !head.requires_grad() && !weights.requires_grad(), fn,
              ": only student_hidden gets a gradient; teacher_hidden, head and weights must not require grad");
  TORCH_CHECK(!weights.lt(0).any().item<bool>(), fn, ": weights must be >= 0");
  const double total = weights.sum(at::kDouble).item<double>();
  TORCH_CHECK(total > 0, fn, ": the weights sum to ", total, "; at least one position needs a positive weight");
  const at::Tensor used = targets.masked_select(weights.gt(0));
  TORCH_CHECK(used.ge(0).all().item<bool>() && used.lt(head.size(0)).all().item<bool>(), fn,
              ": targets at positions with weight > 0 must be token ids in [0, ", head.size(0), ")");
}

// The inputs as the blocked loops read them: positions flattened to rows.
struct Rows {
  at::Tensor student, teacher;  // [N, d], stored dtype (converted to float32 a block at a time)
  at::Tensor head;              // [V, d] float32 (no copy when it already is)
  at::Tensor targets;           // [N]; 0 where the weight is 0, so that every row indexes a real token
  at::Tensor coef;              // [N] float32: w / Σw
};

Rows flatten(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& head, const at::Tensor& targets,
             const at::Tensor& weights) {
  const int64_t d = student.size(2);
  const at::Tensor w = weights.reshape({-1}).to(at::kFloat);
  return {student.reshape({-1, d}), teacher.reshape({-1, d}), head.to(at::kFloat),
          at::where(weights.reshape({-1}).gt(0), targets.reshape({-1}), 0), w / w.sum()};
}

// The logits h·Wᵀ of a block of rows, float32, into the first rows of a [rows, columns()] buffer (V columns
// used). Bfloat16 hidden states and head on an AMX CPU take the tile units (ops/amx_panels.h: the head packed once
// per loss, exact bf16 products summed in float32, as the float32 GEMM of the same widened values sums them in
// another order; the buffer's rows padded to whole panels of 64); anything else the float32 GEMM.
class HeadLogits {
 public:
  HeadLogits(const at::Tensor& head, const at::Tensor& hidden)
      : vocab_(head.size(0)),
        tiles_(hidden.is_cpu() && head.is_cpu() && hidden.scalar_type() == at::kBFloat16 &&
               head.scalar_type() == at::kBFloat16 && head.size(1) % 2 == 0 && ops::amx::bf16_available()) {
    if (tiles_) packed_ = ops::amx::pack_transposed_panels(head.contiguous());
  }
  int64_t columns() const { return tiles_ ? (vocab_ + ops::amx::kPanel - 1) / ops::amx::kPanel * ops::amx::kPanel : vocab_; }
  void into(const at::Tensor& buffer, const at::Tensor& hidden_rows, const at::Tensor& head_float) const {
    const int64_t n = hidden_rows.size(0), d = hidden_rows.size(1);
    if (!tiles_) {
      at::Tensor out = buffer.narrow(0, 0, n);
      at::mm_out(out, hidden_rows.to(at::kFloat), head_float.t());
      return;
    }
    const at::Tensor a = hidden_rows.contiguous();
    const auto* a_bits = static_cast<const uint16_t*>(a.const_data_ptr());
    const auto* panels = static_cast<const uint16_t*>(packed_.const_data_ptr());
    float* out = buffer.mutable_data_ptr<float>();
    at::parallel_for(0, columns() / ops::amx::kPanel, 8, [&](int64_t first, int64_t last) {
      ops::amx::multiply_panels(a_bits, n, d, d, panels, first, last, out, buffer.size(1));
      ops::amx::release();
    });
  }

 private:
  int64_t vocab_;
  bool tiles_;
  at::Tensor packed_;
};

// Replaces each row of `logits` ([n, V], a view of a buffer the loss allocated once) by its softmax, written into
// `probs` (which may be `logits` itself: in place, because any out-of-place step would allocate another [n, V]
// tensor); returns each row's logsumexp. Teacher and student rows go through this one function, so equal
// logits give bitwise-equal probabilities and logsumexps (a KL of exactly 0 for a student equal to its teacher).
at::Tensor softmax_rows(const at::Tensor& logits, at::Tensor& probs) {
  const at::Tensor max = logits.amax(1, /*keepdim=*/true);
  at::sub_out(probs, logits, max).exp_();
  const at::Tensor sum = probs.sum(1, /*keepdim=*/true);
  probs.div_(sum);
  return (max + sum.log()).squeeze(1);
}

// Σ_v a[r, v]·b[r, v] per row of two [n, V] blocks, without an [n, V] product tensor.
at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  return at::bmm(a.unsqueeze(1), b.unsqueeze(2)).view({a.size(0)});
}

// Both terms need only two [rows, V] buffers at a time because every product of a distribution with the head
// is taken through the head instead: Σ_v p[v]·W[v] = p·W ([rows, d]). Per block:
//   KL(p_t ‖ p_s) = Σ_v p_t·z_t − Σ_v p_t·z_s − lse_t + lse_s     (z = h·Wᵀ; two row dots over the buffers)
//   CE            = lse_s − W[target]·h_s
//   ∂/∂h_s        = g_kl·(p_s − p_t)·W + g_ce·(p_s·W − W[target])   (times w / Σw)
// The forward keeps G = (p_s − p_t)·W and, when the ce term will be differentiated, E_s = p_s·W ([N, d] each,
// d/V of the logits' size), so the backward forms no logits: per block two products for the logits and one
// or two into the head, where recomputing both softmaxes in the backward took seven. Without a gradient to
// come, only the logits are formed.
class DistillationFunction : public torch::autograd::Function<DistillationFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& student,
                                                const at::Tensor& teacher, const at::Tensor& head,
                                                const at::Tensor& targets, const at::Tensor& weights,
                                                int64_t block_rows, bool gradient_follows, bool ce_gradient) {
    const Rows in = flatten(student, teacher, head, targets, weights);
    const int64_t N = in.student.size(0), d = in.head.size(1), V = in.head.size(0);
    const at::Tensor kl_rows = at::empty({N}, in.head.options()), ce_rows = at::empty({N}, in.head.options());
    const at::Tensor kl_grad = gradient_follows ? at::empty({N, d}, in.head.options()) : at::Tensor();
    const at::Tensor expected_s = gradient_follows && ce_gradient ? at::empty({N, d}, in.head.options()) : at::Tensor();
    const HeadLogits head_logits(head, student);
    const int64_t buffer_rows = std::min(block_rows, N);
    const at::Tensor logits_buffer = at::empty({buffer_rows, head_logits.columns()}, in.head.options());
    const at::Tensor teacher_buffer = at::empty({buffer_rows, head_logits.columns()}, in.head.options());
    for (int64_t r0 = 0; r0 < N; r0 += block_rows) {
      const int64_t n = std::min(block_rows, N - r0);
      at::Tensor logits = logits_buffer.narrow(0, 0, n).narrow(1, 0, V), p_t = teacher_buffer.narrow(0, 0, n).narrow(1, 0, V);
      const at::Tensor s = in.student.narrow(0, r0, n).to(at::kFloat);
      head_logits.into(logits_buffer, in.teacher.narrow(0, r0, n), in.head);
      const at::Tensor lse_t = softmax_rows(logits, p_t);
      const at::Tensor teacher_mean_logit = row_dot(p_t, logits);  // Σ p_t·z_t
      head_logits.into(logits_buffer, in.student.narrow(0, r0, n), in.head);
      const at::Tensor cross_mean_logit = row_dot(p_t, logits);  // Σ p_t·z_s
      at::Tensor& p_s = logits;
      const at::Tensor lse_s = softmax_rows(logits, p_s);
      kl_rows.narrow(0, r0, n).copy_(teacher_mean_logit - cross_mean_logit - lse_t + lse_s);
      const at::Tensor target_rows = in.head.index_select(0, in.targets.narrow(0, r0, n));
      ce_rows.narrow(0, r0, n).copy_(lse_s - (target_rows * s).sum(1));
      if (!gradient_follows) continue;
      if (ce_gradient) {
        at::Tensor e_s = expected_s.narrow(0, r0, n);
        at::mm_out(e_s, p_s, in.head);
      }
      at::Tensor g = kl_grad.narrow(0, r0, n);
      at::mm_out(g, p_s.sub_(p_t), in.head);
    }
    if (gradient_follows) {
      ctx->saved_data["ce_gradient"] = ce_gradient;
      ctx->save_for_backward({student, head, in.targets, in.coef, kl_grad, expected_s});  // no logits
    }
    return {(kl_rows * in.coef).sum(), (ce_rows * in.coef).sum()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    TORCH_INTERNAL_ASSERT(saved.size() == 6, "distillation_loss: a graph was recorded without the saved products");
    const at::Tensor &student = saved[0], &head = saved[1], &targets = saved[2], &coef = saved[3];
    const at::Tensor &kl_grad = saved[4], &expected_s = saved[5];
    const at::Tensor g_kl = grad_outputs[0].to(at::kFloat), g_ce = grad_outputs[1].to(at::kFloat);
    at::Tensor grad = g_kl * kl_grad;
    if (ctx->saved_data["ce_gradient"].toBool()) {
      grad = grad + g_ce * (expected_s - head.index_select(0, targets).to(at::kFloat));
    } else {  // one host sync per backward, the price of failing loudly instead of a silently wrong gradient
      TORCH_CHECK(g_ce.eq(0).item<bool>(), "distillation_loss: the ce term was formed with DistillationGradients::"
                  "kKlOnly (for logging); a loss that differentiates it needs kBoth");
    }
    grad = grad * coef.unsqueeze(1);
    return {grad.view(student.sizes()).to(student.scalar_type()), {}, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const at::Tensor& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows, DistillationGradients gradients) {
  check_inputs("distillation_loss", student_hidden, teacher_hidden, head, targets, weights);
  TORCH_CHECK(block_rows > 0, "distillation_loss: block_rows must be positive; got ", block_rows);
  const bool gradient_follows = at::GradMode::is_enabled() && student_hidden.requires_grad();
  const auto out = DistillationFunction::apply(student_hidden, teacher_hidden, head, targets, weights, block_rows,
                                               gradient_follows, gradients == DistillationGradients::kBoth);
  return {out[0], out[1]};
}

DistillationTerms distillation_loss_reference(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                              const at::Tensor& head, const at::Tensor& targets,
                                              const at::Tensor& weights) {
  check_inputs("distillation_loss_reference", student_hidden, teacher_hidden, head, targets, weights);
  const at::Tensor head_t = head.to(at::kFloat).t();
  const at::Tensor log_p_s = at::log_softmax(at::matmul(student_hidden.to(at::kFloat), head_t), -1);
  const at::Tensor log_p_t = at::log_softmax(at::matmul(teacher_hidden.to(at::kFloat), head_t), -1);
  const at::Tensor kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1);
  const at::Tensor safe_targets = at::where(weights.gt(0), targets, 0);
  const at::Tensor ce = -log_p_s.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1);
  const at::Tensor w = weights.to(at::kFloat);
  return {(w * kl).sum() / w.sum(), (w * ce).sum() / w.sum()};
}

}  // namespace kvbound::losses
