// TRIM-KV training (DESIGN.md, "TRIM-KV"): the teacher is the frozen backbone with plain causal attention
// (no grad); the student is the same backbone whose attention is the gated retention attention (or, with
// trimkv.cut_budget, the deployment's cut forward with the gated attention's gradient: GatedAttentionHook);
//   L = w_kl · KL(p_teacher ‖ p_student) + w_ntp · CE + λ_cap · L_cap(M_train) + w_future · L_future,
// L_future the hindsight ranking loss (losses/future_attention.h) against the teacher's own attention.
// Registered as train.method trimkv (train/trimkv_method.cpp); evaluated by the trimkv policy.
#pragma once
#include "base/config.h"
#include "losses/capacity.h"
#include "losses/distillation.h"
#include "modules/backbone.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "train/training_method.h"

namespace kvbound {

struct TrimKVSettings {
  RetentionGateSettings gate;
  std::int64_t budget = 64;  // M_train: tighter than the deployment budget works best
  losses::CapacityMode capacity = losses::CapacityMode::PerHead;
  double w_kl = 0.5, w_ntp = 0.5, lambda_cap = 1.0;
  double w_future = 0.0;               // trimkv.w_future: weight of the hindsight ranking loss
  std::int64_t future_stride = 64;     // trimkv.future_stride: its cut points t = stride − 1, 2·stride − 1, …
  std::int64_t loss_block_rows = 128;  // positions whose vocabulary logits exist at once
  std::int64_t sinks = 0;              // trimkv.sinks: positions the student keeps at β = 1, as the policy does
  std::int64_t cut_budget = 0;         // trimkv.cut_budget: the cut student's M (0: the soft student)
  std::int64_t cut_chunk = 64;         // trimkv.cut_chunk: its chunk C
  Config policy_config = kvbound::policy_config();  // the trimkv policy's keys, for the periodic eval
};

class TrimKVMethod final : public TrainingMethod {
 public:
  // `start`: gates to continue from (train.init_from), copied; nullptr: fresh gates from `seed`.
  TrimKVMethod(const Backbone& model, const TrimKVSettings& settings, std::uint64_t seed,
               const RetentionGates* start = nullptr);

  std::string name() const override { return "trimkv"; }
  std::map<std::string, at::Tensor> named_parameters() const override { return gates_->named_tensors(); }
  StepLoss loss(const Batch& batch) override;
  std::unique_ptr<EvictionPolicy> eval_policy() const override { return policy_.make(0); }
  std::map<std::string, std::string> metadata() const override;
  std::string per_layer_name() const override { return "retention"; }
  std::map<std::string, std::vector<at::Tensor>> distributions(const Backbone& model,
                                                              const std::vector<at::Tensor>& windows) const override;

 private:
  const Backbone& model_;
  TrimKVSettings settings_;
  std::shared_ptr<RetentionGates> gates_;
  ConfiguredPolicy policy_;  // trimkv with the live gates
  losses::DistillationHead head_;  // the frozen LM head, prepared once
};

}  // namespace kvbound
