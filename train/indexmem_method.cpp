#include "train/indexmem_method.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>

#include "base/errors.h"
#include "losses/streaming_kl.h"
#include "ops/pooled_attention_importance.h"
#include "ops/pooled_index_score.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

TrainedModules live(const std::shared_ptr<Indexer>& indexer) {
  TrainedModules m;
  m.add<Indexer>(indexer);
  return m;
}

// Captures, per layer of one plain forward over whole rows (Backbone::teacher_attention_inputs), the teacher
// target and the indexer's inputs.
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

IndexMemSettings indexmem_settings(const Config& c, const IndexerSettings& indexer) {
  IndexMemSettings m;
  m.indexer = indexer;
  m.pool_name = c.get_string("indexmem.pool");
  if (m.pool_name != "mean" && m.pool_name != "max" && m.pool_name != "logsumexp")
    fail("config", "indexmem.pool", "'" + m.pool_name + "' (mean, max, logsumexp)");
  m.pool = ops::parse_pool_mode(m.pool_name);
  m.window = c.get_int("indexmem.window");
  m.min_gap = c.get_int("indexmem.min_gap");
  if (m.min_gap < 0) fail("config", "indexmem.min_gap", "must be >= 0");
  m.lead = c.get_int("indexmem.lead");
  if (m.lead < 0) fail("config", "indexmem.lead", "must be >= 0");
  m.policy_config = c;
  return m;
}

IndexMemIndexerMethod::IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings, std::uint64_t seed)
    : IndexMemIndexerMethod(model, settings,
                            std::make_shared<Indexer>(Indexer::init(model.config(), settings.indexer, seed))) {}

IndexMemIndexerMethod::IndexMemIndexerMethod(const Backbone& model, const IndexMemSettings& settings,
                                             std::shared_ptr<Indexer> indexer)
    : model_(model), settings_(settings), indexer_(std::move(indexer)),
      policy_("indexmem", settings.policy_config, live(indexer_)) {
  indexer_->to(model.device());
}

StepLoss IndexMemIndexerMethod::loss(const Batch& batch) {
  // Ω(t) is "the last W queries of the row", so a padded row must not count its padding as queries: rows
  // are grouped by real length L (their weighted positions: padding, and a document's last token, which has
  // no target, are dropped) and each group runs on its first L columns. Rows whose keys all have an empty
  // Ω(t) (L <= min_gap) give no target and are skipped.
  // With a lead, the student sees the row as it stood `lead` queries before its end (its first S = L − lead
  // columns: keys and queries) and is asked for the attention the row's last queries pay those keys: what the
  // policy must do, rank the cached keys by the queries seen so far for the queries still to come.
  const at::Tensor lengths = batch.weights.gt(0).sum(1).cpu();
  std::map<std::int64_t, std::vector<std::int64_t>> groups;
  for (std::int64_t b = 0; b < lengths.size(0); ++b) groups[lengths[b].item<std::int64_t>()].push_back(b);

  const std::int64_t num_layers = model_.config().num_layers;
  std::vector<at::Tensor> layer_kl(static_cast<std::size_t>(num_layers));
  std::int64_t rows = 0;
  for (const auto& [L, members] : groups) {
    const std::int64_t S = L - settings_.lead;  // the student's columns
    if (S < 1) continue;
    const at::Tensor valid = ops::pooled_valid_keys(S, settings_.window, settings_.min_gap);  // [S] bool, CPU
    if (!valid.any().item<bool>()) continue;
    const at::Tensor index = at::tensor(members, at::TensorOptions().dtype(at::kLong)).to(batch.inputs.device());
    const at::Tensor valid_here = valid.to(batch.inputs.device());
    TeacherCapture teacher(settings_);
    model_.teacher_attention_inputs(batch.inputs.index_select(0, index).narrow(1, 0, L), teacher);
    const auto n = static_cast<std::int64_t>(members.size());
    // Every Ω(t) lies within the row's last `window` queries: the indexer's queries and head weights are formed
    // there alone and handed to the score as its last rows (with window = 32 of 511 queries, the projections,
    // norms and RoPE of 16× fewer rows, and their backward; no zero rows padded in and sliced back out).
    const std::int64_t used = settings_.window > 0 ? std::min(settings_.window, S) : S, unused = S - used;
    // Every layer at once, layer l's rows at l·n … l·n + n − 1 of the batch dim (Indexer::keys): one op per
    // step for the norms, RoPE, the pooled score and the KL rather than one per layer.
    std::vector<at::Tensor> inputs, window_inputs, window_queries;
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const auto i = static_cast<std::size_t>(l);
      inputs.push_back(teacher.normed_input[i].narrow(1, 0, S));
      window_inputs.push_back(teacher.normed_input[i].narrow(1, unused, used));
      window_queries.push_back(teacher.q_pre_rope[i].narrow(2, unused, used));
    }
    const at::Tensor positions = teacher.positions.narrow(0, 0, S);
    const at::Tensor kI = indexer_->keys(inputs, positions);
    const at::Tensor qI = indexer_->queries(window_queries, positions.narrow(0, unused, used));
    const at::Tensor w = indexer_->head_weights(window_inputs);
    at::Tensor z = ops::pooled_index_score(qI, kI, w, settings_.pool, settings_.window, settings_.min_gap,
                                           settings_.indexer.relu);
    // A key-only term passes through every pool unchanged (mean, max and logsumexp over queries of I + b are
    // the pool of I, plus b); −inf (an empty Ω(t)) stays −inf.
    if (settings_.indexer.key_bias) z = z + indexer_->key_biases(inputs);
    // Each layer's mean over rows and KV heads, times n: groups of rows add up.
    const at::Tensor kl = losses::streaming_kl(at::cat(teacher.importance, 0).narrow(-1, 0, S), z, valid_here, num_layers) *
                          static_cast<double>(n);
    for (std::int64_t l = 0; l < num_layers; ++l) {
      const auto i = static_cast<std::size_t>(l);
      layer_kl[i] = layer_kl[i].defined() ? layer_kl[i] + kl[l] : kl[l];
    }
    rows += n;
  }
  return layer_mean_loss(std::move(layer_kl), static_cast<double>(rows), "kl", indexer_->parameters());
}

std::map<std::string, std::string> IndexMemIndexerMethod::metadata() const {
  std::map<std::string, std::string> m = indexer_metadata(settings_.indexer);
  m.merge(backbone_metadata(model_));
  m.insert({{"method", "indexmem"},
            {"stage", "indexer"},
            {"pool", settings_.pool_name},
            {"window", std::to_string(settings_.window)},
            {"min_gap", std::to_string(settings_.min_gap)},
            {"lead", std::to_string(settings_.lead)},
            {"recent", std::to_string(settings_.policy_config.get_int("indexmem.recent"))},
            {"stat", settings_.policy_config.get_string("indexmem.stat")},
            {"horizon", std::to_string(settings_.policy_config.get_int("indexmem.horizon"))},
            {"pre_evict", settings_.policy_config.get_bool("indexmem.pre_evict") ? "true" : "false"}});
  return m;
}

namespace methods {
namespace {

IndexerSettings indexer_settings_of(const Config& c) {
  IndexerSettings s;
  s.d_index = c.get_int("indexmem.d_index");
  s.key_heads = c.get_string("indexmem.key_heads");
  s.rope = c.get_bool("indexmem.rope");
  s.relu = c.get_bool("indexmem.relu");
  s.key_bias = c.get_bool("indexmem.key_bias");
  return s;
}

void load_indexer(const SafetensorsFile& file, const std::string& path, const Backbone& model, TrainedModules& modules) {
  auto indexer = std::make_shared<Indexer>(
      Indexer::from_tensors(file.tensors, model.config(), indexer_settings(file.metadata, path), path));
  indexer->to(model.device());
  modules.add<Indexer>(indexer);
}

}  // namespace

extern const MethodRegistration indexmem{
    "indexmem",
    "IndexMem stage 1: the learned indexer (streaming KL to the pooled attention); evaluated by the indexmem policy",
    nullptr,
    {"indexmem.weights"},
    [](ConfigSchema& s) {
      s.add("indexmem.d_index", ConfigType::Int, "32", "indexer key/query size d_I (16..64; even with rope)")
          .add("indexmem.key_heads", ConfigType::String, "kv", "indexer keys: kv (one per KV head) | 1 (one shared key)")
          .add("indexmem.rope", ConfigType::Bool, "true", "RoPE on the indexer's queries and keys")
          .add("indexmem.relu", ConfigType::Bool, "false", "ReLU on indexer logits before the head-weighted sum")
          .add("indexmem.key_bias", ConfigType::Bool, "false",
               "a learned query-independent score per key (W_b x_t), added to every query's score of it")
          .add("indexmem.pool", ConfigType::String, "mean", "pooling over each key's query window: mean | max | logsumexp")
          .add("indexmem.window", ConfigType::Int, "32", "pool over the last W queries of the row (<= 0: every later query)")
          .add("indexmem.min_gap", ConfigType::Int, "0", "pool only over queries >= key position + min_gap")
          .add("indexmem.lead", ConfigType::Int, "0",
               "the indexer scores a row's keys by its queries up to `lead` before the row's end, for the target of "
               "the row's last queries (0: the same queries)");
    },
    [](ConfigSchema& s) {
      s.add("indexmem.weights", ConfigType::String, "\"\"",
            "indexmem: indexer file from `kvbound export` (required by policy indexmem)");
    },
    [](const Config&) { return std::string("indexmem"); },
    [](MethodSetup& setup) -> std::unique_ptr<TrainingMethod> {
      return std::make_unique<IndexMemIndexerMethod>(
          setup.model, indexmem_settings(setup.config, indexer_settings_of(setup.config)), setup.seed);
    },
    load_indexer,
    [](const Config& c, const Backbone& model, TrainedModules& modules, std::map<std::string, std::string>& meta) {
      load_weights_key(c, "indexmem.weights", model, modules, meta, load_indexer);
    },
    {}};

}  // namespace methods
}  // namespace kvbound
