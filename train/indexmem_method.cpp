#include "train/indexmem_method.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/tensor.h>

#include "losses/streaming_kl.h"
#include "modules/policies/registry.h"
#include "ops/pooled_attention_importance.h"
#include "ops/pooled_index_score.h"

namespace kvbound {
namespace {

// Captures, per layer of one plain forward over whole rows, the teacher target and the indexer's inputs.
// before_attention of a fresh cache sees exactly the full-sequence q [B, Hq, T, D] and k [B, Hkv, T, D].
class TeacherCapture final : public AttentionHook {
 public:
  explicit TeacherCapture(const IndexMemSettings& s) : s_(s) {}
  void before_attention(AttentionCall& call, KVCache&) override {
    importance.push_back(ops::pooled_attention_importance(call.q, call.k, s_.pool, s_.window, s_.min_gap));
    normed_input.push_back(call.normed_input);
    q_pre_rope.push_back(call.q_pre_rope);
    positions = call.positions;
  }
  std::vector<at::Tensor> importance, normed_input, q_pre_rope;
  at::Tensor positions;

 private:
  const IndexMemSettings& s_;
};

}  // namespace

IndexMemIndexerMethod::IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::uint64_t seed)
    : model_(model), settings_(settings),
      indexer_(std::make_shared<Indexer>(Indexer::init(model.config(), settings.indexer, seed))) {}

IndexMemIndexerMethod::IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings,
                                             std::shared_ptr<Indexer> indexer)
    : model_(model), settings_(settings), indexer_(std::move(indexer)) {}

StepLoss IndexMemIndexerMethod::loss(const Batch& batch) {
  // Ω(t) is "the last W queries of the row", so a padded row must not count its padding as queries: rows
  // are grouped by real length L (their weighted positions: padding, and a document's last token, which has
  // no target, are dropped) and each group runs on its first L columns. Rows whose keys all have an empty
  // Ω(t) (L <= min_gap) give no target and are skipped.
  const at::Tensor lengths = batch.weights.gt(0).sum(1).cpu();
  std::map<std::int64_t, std::vector<std::int64_t>> groups;
  for (std::int64_t b = 0; b < lengths.size(0); ++b) groups[lengths[b].item<std::int64_t>()].push_back(b);

  const std::int64_t num_layers = model_.config().num_layers;
  std::vector<at::Tensor> layer_kl(static_cast<std::size_t>(num_layers));
  std::int64_t rows = 0;
  for (const auto& [L, members] : groups) {
    const at::Tensor valid = ops::pooled_valid_keys(L, settings_.window, settings_.min_gap);
    if (L < 1 || !valid.any().item<bool>()) continue;
    const at::Tensor index = at::tensor(members, at::TensorOptions().dtype(at::kLong));
    TeacherCapture teacher(settings_);
    {
      const at::NoGradGuard no_grad;
      KVCache cache = model_.make_cache();
      model_.forward_hidden(batch.inputs.index_select(0, index).narrow(1, 0, L), cache, &teacher);
    }
    const auto n = static_cast<std::int64_t>(members.size());
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const auto i = static_cast<std::size_t>(l);
      const at::Tensor qI = indexer_->query(l, teacher.q_pre_rope[i], teacher.positions);
      const at::Tensor kI = indexer_->key(l, teacher.normed_input[i], teacher.positions);
      const at::Tensor w = indexer_->head_weights(l, teacher.normed_input[i]);
      const at::Tensor z = ops::pooled_index_score(qI, kI, w, settings_.pool, settings_.window, settings_.min_gap,
                                                   settings_.indexer.relu);
      const at::Tensor kl = losses::streaming_kl(teacher.importance[i], z, valid) * static_cast<double>(n);
      layer_kl[i] = layer_kl[i].defined() ? layer_kl[i] + kl : kl;
    }
    rows += n;
  }
  return layer_mean_loss(std::move(layer_kl), static_cast<double>(rows), "kl", indexer_->parameters());
}

std::unique_ptr<EvictionPolicy> IndexMemIndexerMethod::eval_policy() const {
  PolicyOptions o = settings_.policy_options;
  o.indexer = indexer_;
  return make_policy("indexmem", o);
}

std::map<std::string, std::string> IndexMemIndexerMethod::metadata() const {
  const ModelConfig& c = model_.config();
  std::map<std::string, std::string> m = indexer_metadata(settings_.indexer);
  m.insert({{"method", "indexmem"},
            {"stage", "indexer"},
            {"backbone", model_.source()},
            {"architecture", c.architecture},
            {"num_layers", std::to_string(c.num_layers)},
            {"hidden_size", std::to_string(c.hidden_size)},
            {"num_kv_heads", std::to_string(c.num_kv_heads)},
            {"pool", settings_.pool_name},
            {"window", std::to_string(settings_.window)},
            {"min_gap", std::to_string(settings_.min_gap)},
            {"recent", std::to_string(settings_.policy_options.indexmem_recent)},
            {"stat", settings_.policy_options.indexmem_stat},
            {"horizon", std::to_string(settings_.policy_options.indexmem_horizon)},
            {"pre_evict", settings_.policy_options.indexmem_pre_evict ? "true" : "false"}});
  return m;
}

}  // namespace kvbound
