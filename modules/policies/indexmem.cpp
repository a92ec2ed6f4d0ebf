// indexmem (DESIGN.md, "IndexMem"): each cached key keeps a running statistic of the learned indexer's
// score I_g[s,t] over the queries s that have seen it — the mean (what the indexer was trained to predict,
// pooled by mean; default), optionally decayed so that the last ~H queries dominate (weights a^(age),
// a = 1 − 1/H: the training target pools over the last W queries, not over every query since the key was
// written), or the max (ablation) — and the `recent` newest tokens are always kept (without them eviction
// collapses). Scoring an old key against new queries needs its indexer key kI, so kI is
// per-entry state that follows the cache.
//
// Pre-eviction (default): a chunk's queries update the statistics of the cached keys *before* the chunk's
// attention, the cache is cut to M there, and attention runs over the kept set plus the chunk; the recent
// window is then the `recent` tokens just before the chunk. With pre_evict off the policy behaves like h2o:
// statistics after attention, cut after attention, recent window ending at the chunk's last token.
//
// indexmem.attention_weight α > 0 adds α·log of each entry's mean received attention (h2o's statistic, from
// the chunks that have attended so far) to its running indexer score, as trimkv.attention_weight does.
// An indexer with a key bias (indexmem.key_bias) adds each entry's b_g[t] to its statistic, as the training
// target's pooled score does.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/pow.h>

#include <cmath>
#include <limits>
#include <utility>

#include "base/errors.h"
#include "modules/indexer.h"
#include "modules/policies/registry.h"
#include "modules/policies/policy_state.h"

namespace kvbound::policies {
namespace {

struct IndexMemPolicySettings {
  std::int64_t recent = 8;
  bool use_max = false;
  std::int64_t horizon = 16;
  bool pre_evict = true;
  double attention_weight = 0;
};

IndexMemPolicySettings indexmem_policy_settings(const Config& c) {
  IndexMemPolicySettings s;
  s.recent = c.get_int("indexmem.recent");
  if (s.recent < 0) fail("config", "indexmem.recent", "must be >= 0");
  const std::string stat = c.get_string("indexmem.stat");
  if (stat != "mean" && stat != "max") fail("config", "indexmem.stat", "'" + stat + "' (mean, max)");
  s.use_max = stat == "max";
  s.horizon = c.get_int("indexmem.horizon");
  if (s.horizon < 0) fail("config", "indexmem.horizon", "must be >= 0 (0: every query weighs the same)");
  s.pre_evict = c.get_bool("indexmem.pre_evict");
  s.attention_weight = read_attention_weight(c, "indexmem.attention_weight");
  return s;
}

class IndexMem final : public EvictionPolicy {
 public:
  IndexMem(std::shared_ptr<const Indexer> indexer, const IndexMemPolicySettings& s)
      : indexer_(std::move(indexer)), recent_(s.recent), use_max_(s.use_max),
        decay_(s.horizon > 0 ? 1.0 - 1.0 / static_cast<double>(s.horizon) : 1.0), pre_evict_(s.pre_evict),
        attention_weight_(s.attention_weight) {}

  bool pre_evicts() const override { return pre_evict_; }
  bool needs_attention() const override { return attention_weight_ > 0; }

  void observe_before(const PolicyView& v) override {
    const at::NoGradGuard no_grad;  // a trainer's live indexer has trainable leaves; scores are constants here
    update_cached(v, v.cache->size(v.layer));
  }

  void observe(const PolicyView& v) override {
    const at::NoGradGuard no_grad;
    const AttentionCall& call = *v.call;
    const std::int64_t t = call.q.size(2), older = v.cache->size(v.layer) - t;
    if (!pre_evict_) update_cached(v, older);
    if (needs_attention()) attention_.observe(v);

    // The chunk's own entries: scored by the chunk's queries at or after them.
    const std::int64_t hkv = v.cache->positions(v.layer).size(1);
    const at::Tensor chunk_keys = indexer_->key(v.layer, call.normed_input, call.positions).expand({-1, hkv, -1, -1});
    const auto [q, w_heads] = chunk_queries(call);
    const at::Tensor I = indexer_->score(q, w_heads, chunk_keys);  // [B, Hkv, T, T]
    const at::Tensor visible = (call.positions.view({1, 1, -1, 1}) >= call.positions.view({1, 1, 1, -1})).expand_as(I);
    const auto l = static_cast<std::size_t>(v.layer);
    if (l >= keys_.size()) keys_.resize(l + 1);
    keys_[l] = keys_[l].defined() ? at::cat({keys_[l], chunk_keys}, 2) : chunk_keys.contiguous();

    const at::Tensor like = v.cache->positions(v.layer).to(at::kFloat);
    if (indexer_->settings().key_bias)
      bias_.extend(v.layer, older + t, like)
          .narrow(-1, older, t)
          .copy_(indexer_->key_bias(v.layer, call.normed_input).expand({-1, hkv, -1}));
    at::Tensor& stat = stat_.extend(v.layer, older + t, like);
    at::Tensor& seen = seen_.extend(v.layer, older + t, like);
    chunk_queries_[l] = {};  // the next chunk brings new queries
    if (use_max_) {
      stat.narrow(-1, older, t).copy_(I.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity()).amax(2));
      return;
    }
    const at::Tensor w = visible.to(at::kFloat) * query_weights(t, I.options());
    stat.narrow(-1, older, t).copy_((I * w).sum(2));
    seen.narrow(-1, older, t).copy_(w.sum(2));
  }

  at::Tensor score(const PolicyView& v) override {
    const at::Tensor& stat = stat_.get(v.layer);
    at::Tensor value = use_max_ ? stat : stat / seen_.get(v.layer).clamp_min(1);
    if (indexer_->settings().key_bias) value = value + bias_.get(v.layer);
    if (needs_attention()) value = add_attention_evidence(value, attention_, v.layer, attention_weight_);
    // Pre-eviction keeps the `recent` tokens just before the chunk; otherwise those ending at its last token.
    const std::int64_t newest = pre_evict_ ? v.call->start - 1 : v.call->start + v.call->q.size(2) - 1;
    return protect_recent(value, v.cache->positions(v.layer), newest, recent_);
  }

  void retained(std::int64_t layer, const at::Tensor& index) override {
    stat_.gather(layer, index);
    seen_.gather(layer, index);
    if (indexer_->settings().key_bias) bias_.gather(layer, index);
    if (needs_attention()) attention_.gather(layer, index);
    at::Tensor& keys = keys_.at(static_cast<std::size_t>(layer));
    keys = at::gather(keys, 2, index.unsqueeze(-1).expand({-1, -1, -1, keys.size(-1)}));
  }

 private:
  // The chunk's indexer queries qI and head weights w: computed once per chunk and layer, shared by the
  // statistics' update before attention and the chunk's own entries after it (observe() drops them).
  std::pair<at::Tensor, at::Tensor> chunk_queries(const AttentionCall& call) {
    const auto l = static_cast<std::size_t>(call.layer);
    if (l >= chunk_queries_.size()) chunk_queries_.resize(l + 1);
    auto& [q, w] = chunk_queries_[l];
    if (!q.defined()) {
      q = indexer_->query(call.layer, call.q_pre_rope, call.positions);
      w = indexer_->head_weights(call.layer, call.normed_input);
    }
    return {q, w};
  }

  // The chunk's queries score the `older` entries cached before it (every one of them precedes the chunk).
  void update_cached(const PolicyView& v, std::int64_t older) {
    if (older == 0) return;
    const at::Tensor keys = keys_.at(static_cast<std::size_t>(v.layer));
    const auto [q, w_heads] = chunk_queries(*v.call);
    const at::Tensor I = indexer_->score(q, w_heads, keys.narrow(2, 0, older));  // [B, Hkv, T, older]
    at::Tensor stat = stat_.get(v.layer).narrow(-1, 0, older);
    if (use_max_) {
      stat.copy_(at::maximum(stat, I.amax(2)));
      return;
    }
    const std::int64_t t = I.size(2);
    const at::Tensor w = query_weights(t, I.options());  // [T, 1]
    const double carried = std::pow(decay_, static_cast<double>(t));
    stat.mul_(carried).add_((I * w).sum(2));
    seen_.get(v.layer).narrow(-1, 0, older).mul_(carried).add_(w.sum());
  }

  // Weight of each of a chunk's T queries in the running mean, [T, 1] like `options`: decay^(T−1−s) (all 1
  // undecayed).
  at::Tensor query_weights(std::int64_t t, const at::TensorOptions& options) const {
    const at::Tensor age = at::arange(t - 1, -1, -1, options);
    return at::pow(decay_, age).view({t, 1});
  }

  std::shared_ptr<const Indexer> indexer_;
  std::int64_t recent_;
  bool use_max_;
  double decay_;  // a of the decayed mean (1: the plain mean)
  bool pre_evict_;
  double attention_weight_;
  MeanReceivedAttention attention_;  // indexmem.attention_weight > 0 only
  PerEntryState stat_, seen_;     // per layer [B, Hkv, N]: running weighted sum (or max) of I over the queries
                                  // that saw each entry, and the sum of their weights
  PerEntryState bias_;            // per layer [B, Hkv, N]: each entry's key bias b_g (indexers with key_bias)
  std::vector<at::Tensor> keys_;  // per layer [B, Hkv, N, dI]: each cached entry's indexer key
  std::vector<std::pair<at::Tensor, at::Tensor>> chunk_queries_;  // per layer: the current chunk's qI, w
};

}  // namespace

extern const PolicyRegistration indexmem{
    "indexmem", PolicyKind::Learned, "the keys with the highest running indexer score (pre-evicting), and the indexmem.recent newest",
    [](ConfigSchema& s) {
      s.add("indexmem.recent", ConfigType::Int, "8", "indexmem policy: most recent tokens always kept")
          .add("indexmem.stat", ConfigType::String, "mean", "indexmem policy: running statistic of a key's scores: mean | max")
          .add("indexmem.horizon", ConfigType::Int, "16",
               "indexmem policy, stat mean: decay older queries' scores by a = 1 - 1/H (0: every query weighs the same)")
          .add("indexmem.pre_evict", ConfigType::Bool, "true",
               "indexmem policy: evict before a chunk's attention (false: after it, like h2o)")
          .add("indexmem.attention_weight", ConfigType::Float, "0",
               "indexmem policy: add this times log(mean received attention), h2o's statistic, to the running score "
               "(0: off)");
    },
    [](const Config& c, const TrainedModules& modules) -> PolicyMaker {
      const IndexMemPolicySettings s = indexmem_policy_settings(c);
      std::shared_ptr<const Indexer> indexer = modules.find<Indexer>();
      if (!indexer) fail("config", "indexmem.weights", "policy indexmem needs an indexer file (kvbound export RUN_DIR --out FILE)");
      return [indexer, s](std::uint64_t) { return std::make_unique<IndexMem>(indexer, s); };
    }};

}  // namespace kvbound::policies
