// IndexMem stage 1 (DESIGN.md, "IndexMem"): the learned indexer alone, trained with
//   L_KL = KL(p_T ‖ p_S),  p_T ∝ the frozen backbone's pooled attention importance of each key (teacher),
//                          p_S = softmax of the indexer's pooled score (student),
// mean over batch, layers and KV heads. One frozen forward (no grad) yields every layer's teacher target and
// the indexer's inputs; the loss then needs only the indexer's own graph, never the backbone's.
// Registered as train.method indexmem (train/indexmem_method.cpp); evaluated by the indexmem policy.
#pragma once
#include "base/config.h"
#include "modules/backbone.h"
#include "modules/indexer.h"
#include "modules/policies/registry.h"
#include "ops/pooled_window.h"
#include "train/training_method.h"

namespace kvbound {

struct IndexMemSettings {
  IndexerSettings indexer;
  ops::PoolMode pool = ops::PoolMode::Mean;
  std::string pool_name = "mean";
  std::int64_t window = 32;  // Ω(t): the last `window` queries of the row (<= 0: every later query)
  std::int64_t min_gap = 0;  // Ω(t): only queries >= t + min_gap
  std::int64_t lead = 0;     // the student's Ω(t) ends `lead` queries before the row's end, the target's at it
  Config policy_config = kvbound::policy_config();  // the indexmem policy's keys, for the periodic eval
};

// The KL target's settings (indexmem.pool, .window, .min_gap, .lead; the policy keys) for an indexer with `indexer`
// settings; kvbound::Error naming the key for a bad value.
IndexMemSettings indexmem_settings(const Config& config, const IndexerSettings& indexer);

class IndexMemIndexerMethod final : public TrainingMethod {
 public:
  IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::uint64_t seed);
  // Continues training `indexer` (trainable leaves; its settings must equal settings.indexer).
  IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::shared_ptr<Indexer> indexer);

  std::string name() const override { return "indexmem"; }
  std::map<std::string, at::Tensor> named_parameters() const override { return indexer_->named_tensors(); }
  StepLoss loss(const Batch& batch) override;
  std::unique_ptr<EvictionPolicy> eval_policy() const override { return policy_.make(0); }
  std::map<std::string, std::string> metadata() const override;
  std::string per_layer_name() const override { return "kl_per_layer"; }

 private:
  const Backbone& model_;
  IndexMemSettings settings_;
  std::shared_ptr<Indexer> indexer_;
  ConfiguredPolicy policy_;  // indexmem with the live indexer
};

}  // namespace kvbound
