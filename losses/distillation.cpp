#include "losses/distillation.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

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

// Forms the logits h·Wᵀ of one block in `probs` (a view of the one [block_rows, V] buffer the loss
// allocates) and replaces them in place by their softmax; returns each row's logsumexp. In place, because
// any out-of-place step would allocate a second [block_rows, V] tensor.
at::Tensor softmax_in_place(const at::Tensor& h, const at::Tensor& head, at::Tensor& probs) {
  at::mm_out(probs, h, head.t());
  const at::Tensor max = probs.amax(1, /*keepdim=*/true);
  probs.sub_(max).exp_();
  const at::Tensor sum = probs.sum(1, /*keepdim=*/true);
  probs.div_(sum);
  return (max + sum.log()).squeeze(1);
}

// Both terms need only one [rows, V] tensor at a time because every product of a distribution with the
// logits h·Wᵀ is taken through the head instead: Σ_v p[v]·(h·Wᵀ)[v] = (p·W)·h. With E_p = p·W ([rows, d]):
//   KL(p_t ‖ p_s) = Σ_v p_t (z_t − z_s) − lse_t + lse_s = E_{p_t}·(h_t − h_s) − lse_t + lse_s
//   CE            = lse_s − W[target]·h_s
//   ∂/∂h_s        = dlogits·W = (g_kl + g_ce)·E_{p_s} − g_kl·E_{p_t} − g_ce·W[target]   (times w / Σw)
// The forward keeps E_{p_t} and E_{p_s} ([N, d] each, d/V of the logits' size), so the backward forms no
// logits at all: four [rows, V] × [V, d] products per block in all, where recomputing both softmaxes in the
// backward took seven. Without a gradient to come, E_{p_s} is not formed (three products).
class DistillationFunction : public torch::autograd::Function<DistillationFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& student,
                                                const at::Tensor& teacher, const at::Tensor& head,
                                                const at::Tensor& targets, const at::Tensor& weights,
                                                int64_t block_rows, bool gradient_follows) {
    const Rows in = flatten(student, teacher, head, targets, weights);
    const int64_t N = in.student.size(0), d = in.head.size(1);
    const at::Tensor kl_rows = at::empty({N}, in.head.options()), ce_rows = at::empty({N}, in.head.options());
    const at::Tensor expected_t = at::empty({N, d}, in.head.options());
    const at::Tensor expected_s = gradient_follows ? at::empty({N, d}, in.head.options()) : at::Tensor();
    const at::Tensor buffer = at::empty({std::min(block_rows, N), in.head.size(0)}, in.head.options());
    for (int64_t r0 = 0; r0 < N; r0 += block_rows) {
      const int64_t n = std::min(block_rows, N - r0);
      at::Tensor probs = buffer.narrow(0, 0, n);
      const at::Tensor s = in.student.narrow(0, r0, n).to(at::kFloat);
      const at::Tensor t = in.teacher.narrow(0, r0, n).to(at::kFloat);
      const at::Tensor lse_t = softmax_in_place(t, in.head, probs);
      at::Tensor e_t = expected_t.narrow(0, r0, n);
      at::mm_out(e_t, probs, in.head);
      const at::Tensor lse_s = softmax_in_place(s, in.head, probs);
      if (gradient_follows) {
        at::Tensor e_s = expected_s.narrow(0, r0, n);
        at::mm_out(e_s, probs, in.head);
      }
      kl_rows.narrow(0, r0, n).copy_((e_t * (t - s)).sum(1) - lse_t + lse_s);
      const at::Tensor target_rows = in.head.index_select(0, in.targets.narrow(0, r0, n));
      ce_rows.narrow(0, r0, n).copy_(lse_s - (target_rows * s).sum(1));
    }
    if (gradient_follows) {
      ctx->save_for_backward({student, head, in.targets, in.coef, expected_t, expected_s});  // no logits
    }
    return {(kl_rows * in.coef).sum(), (ce_rows * in.coef).sum()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    TORCH_INTERNAL_ASSERT(saved.size() == 6, "distillation_loss: a graph was recorded without the saved products");
    const at::Tensor &student = saved[0], &head = saved[1], &targets = saved[2], &coef = saved[3];
    const at::Tensor &expected_t = saved[4], &expected_s = saved[5];
    const at::Tensor g_kl = grad_outputs[0].to(at::kFloat), g_ce = grad_outputs[1].to(at::kFloat);
    const at::Tensor target_rows = head.index_select(0, targets).to(at::kFloat);
    const at::Tensor grad = ((g_kl + g_ce) * expected_s - g_kl * expected_t - g_ce * target_rows) * coef.unsqueeze(1);
    return {grad.view(student.sizes()).to(student.scalar_type()), {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const at::Tensor& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows) {
  check_inputs("distillation_loss", student_hidden, teacher_hidden, head, targets, weights);
  TORCH_CHECK(block_rows > 0, "distillation_loss: block_rows must be positive; got ", block_rows);
  const bool gradient_follows = at::GradMode::is_enabled() && student_hidden.requires_grad();
  const auto out =
      DistillationFunction::apply(student_hidden, teacher_hidden, head, targets, weights, block_rows, gradient_follows);
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
