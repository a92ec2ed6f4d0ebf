// IndexMem stage 1 (DESIGN.md, "IndexMem"): the learned indexer alone, trained with
//   L_KL = KL(p_T ‖ p_S),  p_T ∝ the frozen backbone's pooled attention importance of each key (teacher),
//                          p_S = softmax of the indexer's pooled score (student),
// mean over batch, layers and KV heads. One frozen forward (no grad) yields every layer's teacher target and
// the indexer's inputs; the loss then needs only the indexer's own graph, never the backbone's.
#pragma once
#include "modules/backbone.h"
#include "modules/indexer.h"
#include "ops/pooled_window.h"
#include "train/training_method.h"

namespace kvbound {

struct IndexMemSettings {
  IndexerSettings indexer;
  ops::PoolMode pool = ops::PoolMode::Mean;
  std::string pool_name = "mean";
  std::int64_t window = 32;  // Ω(t): the last `window` queries of the row (<= 0: every later query)
  std::int64_t min_gap = 0;  // Ω(t): only queries >= t + min_gap
  PolicyOptions policy_options;  // the eval policy's settings (indexmem.recent, .stat, .pre_evict)
};

class IndexMemIndexerMethod final : public TrainingMethod {
 public:
  IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::uint64_t seed);
  // Continues training `indexer` (trainable leaves; its settings must equal settings.indexer).
  IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::shared_ptr<Indexer> indexer);

  std::string name() const override { return "indexmem"; }
  std::map<std::string, at::Tensor> named_parameters() const override { return indexer_->named_tensors(); }
  StepLoss loss(const Batch& batch) override;
  std::unique_ptr<EvictionPolicy> eval_policy() const override;
  std::map<std::string, std::string> metadata() const override;
  std::string per_layer_name() const override { return "kl_per_layer"; }

 private:
  const Backbone& model_;
  IndexMemSettings settings_;
  std::shared_ptr<Indexer> indexer_;
};

}  // namespace kvbound
