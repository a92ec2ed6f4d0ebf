#include "losses/distillation.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>

#include "ops/amx_panels.h"
#include "ops/bf16_dot_panels.h"
#include "ops/bf16_product_engine.h"
#include "ops/distillation_rows.h"
#include "ops/onednn_linear.h"

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
  at::Tensor student, teacher;  // [N, d], stored dtype
  at::Tensor targets;           // [N]; 0 where the weight is 0, so that every row indexes a real token
  at::Tensor coef;              // [N] float32: w / Σw
};

Rows flatten(const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& targets,
             const at::Tensor& weights) {
  const int64_t d = student.size(2);
  const at::Tensor w = weights.reshape({-1}).to(at::kFloat);
  return {student.reshape({-1, d}), teacher.reshape({-1, d}),
          at::where(weights.reshape({-1}).gt(0), targets.reshape({-1}), 0), w / w.sum()};
}

using ops::amx::round_up;

// Both terms need only two [rows, V] float buffers at a time because every product of a distribution with the
// head is taken through the head instead: Σ_v p[v]·W[v] = p·W ([rows, d]). Per block (ops/distillation_rows.h):
//   KL(p_t ‖ p_s) = Σ_v p_t·(z_t − z_s) − lse_t + lse_s     (z = h·Wᵀ)
//   CE            = lse_s − z_s[target]
//   ∂/∂h_s        = g_kl·(p_s − p_t)·W + g_ce·(p_s − onehot(target))·W   (times w / Σw)
// The forward keeps G = (p_s − p_t)·W and, when the ce term will be differentiated, C = (p_s − onehot)·W ([N, d]
// each, d/V of the logits' size), so the backward forms no logits and reads no head. Without a gradient to come,
// only the logits are formed. On the tile units (DistillationHead::on_tiles) both probability rows go to bfloat16
// buffers for their products, as every other product of a bfloat16 forward takes bfloat16 operands; each is formed
// in float32 and rounded once (p_s − 1 at the target included, so a confident position keeps its small gradient).
class DistillationFunction : public torch::autograd::Function<DistillationFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& student,
                                                const at::Tensor& teacher, const at::Tensor& targets,
                                                const at::Tensor& weights, const DistillationHead* head,
                                                int64_t block_rows, bool gradient_follows, bool ce_gradient) {
    const Rows in = flatten(student, teacher, targets, weights);
    const bool tiles = head->on_tiles(student);
    const at::Tensor head_float = tiles ? at::Tensor() : head->float_weight();
    const int64_t N = in.student.size(0), d = head->weight().size(1), V = head->weight().size(0);
    const at::TensorOptions f32 = in.student.options().dtype(at::kFloat);
    const at::Tensor kl_rows = at::empty({N}, f32), ce_rows = at::empty({N}, f32);
    // On the tiles the products into the head write whole panels of 64 columns: [N, d rounded up], narrowed.
    const int64_t grad_columns = tiles ? round_up(d, ops::amx::kPanel) : d;
    const at::Tensor kl_grad = gradient_follows ? at::empty({N, grad_columns}, f32) : at::Tensor();
    const at::Tensor ce_grad = gradient_follows && ce_gradient ? at::empty({N, grad_columns}, f32) : at::Tensor();
    const int64_t buffer_rows = std::min(block_rows, N);
    // oneDNN writes no given buffer (DistillationHead::logits): each block's logits are new tensors there.
    const bool buffered = tiles || !ops::onednn::float32_preferred();
    const at::Tensor student_buffer = buffered ? at::empty({buffer_rows, head->logit_columns(tiles)}, f32) : at::Tensor();
    const at::Tensor teacher_buffer = buffered ? at::empty({buffer_rows, head->logit_columns(tiles)}, f32) : at::Tensor();
    // bfloat16 probability rows for the tiles: V rounded up to an even K (the pairs of oneDNN's layout), the
    // padding columns zero for good.
    at::Tensor diff_bf16, ce_bf16;
    if (tiles && gradient_follows) {
      diff_bf16 = at::zeros({buffer_rows, head->mix_depth()}, in.student.options());
      if (ce_gradient) ce_bf16 = at::zeros({buffer_rows, head->mix_depth()}, in.student.options());
    }
    for (int64_t r0 = 0; r0 < N; r0 += block_rows) {
      const int64_t n = std::min(block_rows, N - r0);
      const at::Tensor z_t = head->logits(teacher_buffer, in.teacher.narrow(0, r0, n), head_float, tiles).narrow(1, 0, V);
      const at::Tensor z_s = head->logits(student_buffer, in.student.narrow(0, r0, n), head_float, tiles).narrow(1, 0, V);
      const at::Tensor block_targets = in.targets.narrow(0, r0, n);
      const at::Tensor target_logit = z_s.gather(1, block_targets.unsqueeze(1)).squeeze(1);
      ops::GradientRows rows;
      if (gradient_follows) {
        rows.difference = tiles ? diff_bf16.narrow(0, 0, n).narrow(1, 0, V) : z_s;
        if (ce_gradient) {
          rows.student_minus_target = tiles ? ce_bf16.narrow(0, 0, n).narrow(1, 0, V) : z_t;
          rows.targets = block_targets;
        }
      }
      const ops::DistillationRows terms = ops::distillation_rows(z_t, z_s, rows);
      kl_rows.narrow(0, r0, n).copy_(terms.kl);
      ce_rows.narrow(0, r0, n).copy_(terms.lse_student - target_logit);
      if (!gradient_follows) continue;
      if (tiles) {
        head->mix_into(kl_grad.narrow(0, r0, n), diff_bf16.narrow(0, 0, n));
        if (ce_gradient) head->mix_into(ce_grad.narrow(0, r0, n), ce_bf16.narrow(0, 0, n));
        continue;
      }
      head->mix_float_into(kl_grad.narrow(0, r0, n), rows.difference, head_float);
      if (ce_gradient) head->mix_float_into(ce_grad.narrow(0, r0, n), rows.student_minus_target, head_float);
    }
    if (gradient_follows) {
      ctx->saved_data["ce_gradient"] = ce_gradient;
      ctx->save_for_backward({student, in.coef, kl_grad.narrow(1, 0, d),
                              ce_gradient ? ce_grad.narrow(1, 0, d) : ce_grad});  // no logits
    }
    return {(kl_rows * in.coef).sum(), (ce_rows * in.coef).sum()};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    TORCH_INTERNAL_ASSERT(saved.size() == 4, "distillation_loss: a graph was recorded without the saved products");
    const at::Tensor &student = saved[0], &coef = saved[1], &kl_grad = saved[2], &ce_grad = saved[3];
    const at::Tensor g_kl = grad_outputs[0].to(at::kFloat), g_ce = grad_outputs[1].to(at::kFloat);
    at::Tensor grad = g_kl * kl_grad;
    if (ctx->saved_data["ce_gradient"].toBool()) {
      grad = grad + g_ce * ce_grad;
    } else {  // one host sync per backward, the price of failing loudly instead of a silently wrong gradient
      TORCH_CHECK(g_ce.eq(0).item<bool>(), "distillation_loss: the ce term was formed with DistillationGradients::"
                  "kKlOnly (for logging); a loss that differentiates it needs kBoth");
    }
    grad = grad * coef.unsqueeze(1);
    return {grad.view(student.sizes()).to(student.scalar_type()), {}, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

DistillationHead::DistillationHead(const at::Tensor& head) : weight_(head) {
  TORCH_CHECK(head.dim() == 2 && head.size(0) > 0 && head.size(1) > 0 && at::isFloatingType(head.scalar_type()),
              "DistillationHead: head must be a floating-point [V, d] matrix; got ", head.sizes(), " ",
              head.scalar_type());
  const int64_t V = head.size(0), d = head.size(1);
  const ops::Bf16ProductEngine engine = ops::bf16_product_engine();
  if (head.is_cpu() && head.scalar_type() == at::kBFloat16 && d % 2 == 0 && engine != ops::Bf16ProductEngine::kNone) {
    amx_ = engine == ops::Bf16ProductEngine::kTiles;
    const auto pack = amx_ ? +[](const at::Tensor& rows) { return ops::amx::pack_transposed_panels(rows); }
                           : +[](const at::Tensor& rows) { return ops::bf16_dot::pack_transposed_panels(rows); };
    logit_panels_ = pack(head.contiguous());
    // Wᵀ with V rounded up to an even K (a zero column when V is odd), packed in panels of 64 of its d rows.
    at::Tensor transposed = at::zeros({d, round_up(V, 2)}, head.options());
    transposed.narrow(1, 0, V).copy_(head.t());
    mix_panels_ = pack(transposed);
    return;
  }
  float_ = head.to(at::kFloat);
}

bool DistillationHead::on_tiles(const at::Tensor& hidden) const {
  // The AMX check is asked again each call: it follows the mkldnn switch (ops/amx_panels.h).
  return logit_panels_.defined() && hidden.is_cpu() && hidden.scalar_type() == at::kBFloat16 &&
         (!amx_ || ops::amx::bf16_available());
}

at::Tensor DistillationHead::float_weight() const { return float_.defined() ? float_ : weight_.to(at::kFloat); }

int64_t DistillationHead::logit_columns(bool tiles) const {
  return tiles ? round_up(weight_.size(0), ops::amx::kPanel) : weight_.size(0);
}

int64_t DistillationHead::mix_depth() const { return round_up(weight_.size(0), 2); }

at::Tensor DistillationHead::logits(const at::Tensor& buffer, const at::Tensor& hidden_rows,
                                   const at::Tensor& head_float, bool tiles) const {
  const int64_t n = hidden_rows.size(0), d = hidden_rows.size(1);
  if (!tiles && ops::onednn::float32_preferred()) return ops::onednn::linear(hidden_rows.to(at::kFloat), head_float);
  at::Tensor out = buffer.narrow(0, 0, n);
  if (!tiles) {
    at::mm_out(out, hidden_rows.to(at::kFloat), head_float.t());
    return out;
  }
  const at::Tensor a = hidden_rows.contiguous();
  const auto* a_bits = static_cast<const uint16_t*>(a.const_data_ptr());
  const auto* panels = static_cast<const uint16_t*>(logit_panels_.const_data_ptr());
  float* c = buffer.mutable_data_ptr<float>();
  at::parallel_for(0, buffer.size(1) / ops::amx::kPanel, 8, [&](int64_t first, int64_t last) {
    if (!amx_) return ops::bf16_dot::multiply_panels(a_bits, n, d, d, panels, first, last, c, buffer.size(1));
    ops::amx::multiply_panels(a_bits, n, d, d, panels, first, last, c, buffer.size(1));
    ops::amx::release();
  });
  return out;
}

void DistillationHead::mix_float_into(const at::Tensor& out, const at::Tensor& probabilities,
                                      const at::Tensor& head_float) const {
  if (ops::onednn::float32_preferred()) {
    out.copy_(ops::onednn::mm(probabilities, head_float));  // [n, d]: d / V of the logits' bytes
    return;
  }
  at::Tensor o = out;
  at::mm_out(o, probabilities, head_float);
}

void DistillationHead::mix_into(const at::Tensor& out, const at::Tensor& probabilities) const {
  const int64_t n = probabilities.size(0), K = mix_depth(), panels = out.size(1) / ops::amx::kPanel;
  TORCH_INTERNAL_ASSERT(probabilities.size(1) == K && probabilities.stride(1) == 1 && out.stride(1) == 1 &&
                        out.size(1) % ops::amx::kPanel == 0);
  const auto* a_bits = static_cast<const uint16_t*>(probabilities.const_data_ptr());
  const auto* packed = static_cast<const uint16_t*>(mix_panels_.const_data_ptr());
  float* c = out.mutable_data_ptr<float>();
  if (!amx_) {
    // d / 64 panels (9 for SmolLM2) split unevenly over the threads: rows split instead, each C element still
    // summed in one order.
    at::parallel_for(0, n, 6, [&](int64_t begin, int64_t end) {
      ops::bf16_dot::multiply_panels(a_bits + begin * probabilities.stride(0), end - begin, K, probabilities.stride(0),
                                     packed, 0, panels, c + begin * out.stride(0), out.stride(0));
    });
    return;
  }
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    ops::amx::multiply_panels_k_sliced(a_bits, n, K, probabilities.stride(0), packed, first, last, c, out.stride(0));
    ops::amx::release();
  });
}

DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const DistillationHead& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows, DistillationGradients gradients) {
  check_inputs("distillation_loss", student_hidden, teacher_hidden, head.weight(), targets, weights);
  TORCH_CHECK(block_rows > 0, "distillation_loss: block_rows must be positive; got ", block_rows);
  const bool gradient_follows = at::GradMode::is_enabled() && student_hidden.requires_grad();
  const auto out = DistillationFunction::apply(student_hidden, teacher_hidden, targets, weights, &head, block_rows,
                                               gradient_follows, gradients == DistillationGradients::kBoth);
  return {out[0], out[1]};
}

DistillationTerms distillation_loss(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden,
                                    const at::Tensor& head, const at::Tensor& targets, const at::Tensor& weights,
                                    int64_t block_rows, DistillationGradients gradients) {
  return distillation_loss(student_hidden, teacher_hidden, DistillationHead(head), targets, weights, block_rows,
                           gradients);
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
