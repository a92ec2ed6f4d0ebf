#include "train/trimkv_method.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/exp.h>

#include "losses/distillation.h"
#include "modules/policies/registry.h"

namespace kvbound {

TrimKVMethod::TrimKVMethod(const Backbone& model, const TrimKVSettings& settings, std::uint64_t seed)
    : model_(model), settings_(settings),
      gates_(std::make_shared<RetentionGates>(RetentionGates::init(model.config(), settings.gate, seed))) {}

StepLoss TrimKVMethod::loss(const Batch& batch) {
  at::Tensor teacher_hidden;
  {
    const at::NoGradGuard no_grad;
    KVCache cache = model_.make_cache();
    teacher_hidden = model_.forward_hidden(batch.inputs, cache);
  }
  GatedAttentionHook hook(*gates_);
  KVCache cache = model_.make_cache();
  const at::Tensor student_hidden = model_.forward_hidden(batch.inputs, cache, &hook);
  const losses::DistillationTerms d = losses::distillation_loss(student_hidden, teacher_hidden, model_.lm_head(),
                                                                batch.targets, batch.weights, settings_.loss_block_rows);
  const at::Tensor cap = losses::capacity_loss(hook.log_betas(), settings_.budget, settings_.capacity, batch.weights);
  StepLoss out;
  out.total = settings_.w_kl * d.kl + settings_.w_ntp * d.ce + settings_.lambda_cap * cap;
  out.terms = {{"kl", d.kl}, {"ce", d.ce}, {"cap", cap}};
  const at::NoGradGuard no_grad;
  out.stats["capacity"] = losses::expected_cache_size(hook.log_betas(), batch.weights);
  // Mean β per layer over real positions: how much each layer forgets.
  const at::Tensor w = batch.weights.unsqueeze(1);  // [B, 1, T]
  for (const at::Tensor& lb : hook.log_betas())
    out.per_layer.push_back(((at::exp(lb.detach()) * w).sum() / (w.sum() * lb.size(1))).item<double>());
  return out;
}

std::unique_ptr<EvictionPolicy> TrimKVMethod::eval_policy() const {
  PolicyOptions o;
  o.trimkv_gates = gates_;
  return make_policy("trimkv", o);
}

std::map<std::string, std::string> TrimKVMethod::metadata() const {
  const ModelConfig& c = model_.config();
  return {{"method", "trimkv"},
          {"backbone", model_.source()},
          {"architecture", c.architecture},
          {"num_layers", std::to_string(c.num_layers)},
          {"hidden_size", std::to_string(c.hidden_size)},
          {"num_kv_heads", std::to_string(c.num_kv_heads)},
          {"retention_gate_intermediate_size", std::to_string(gates_->hidden())},
          {"retention_gate_bias_init", std::to_string(settings_.gate.bias_init)},
          {"hidden_act", c.hidden_act},
          {"budget", std::to_string(settings_.budget)}};
}

}  // namespace kvbound
