// indexmem (DESIGN.md, "IndexMem"): each cached key keeps the running mean of the learned indexer's score
// I_g[s,t] over the queries s that have seen it (the statistic the indexer was trained to predict, pooled
// by mean), and the `recent` newest tokens are always kept (without them eviction collapses). Scoring an
// old key against new queries needs its indexer key kI, so kI is per-entry state that follows the cache.
// The statistics are updated after the chunk's attention, like h2o; updating them before it (pre-eviction,
// so the chunk's attention already runs over the kept set) is a follow-up.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>

#include "checkpoints/errors.h"
#include "modules/indexer.h"
#include "modules/policies/policy_factories.h"
#include "modules/policies/policy_state.h"

namespace kvbound::policies {
namespace {

class IndexMem final : public EvictionPolicy {
 public:
  IndexMem(std::shared_ptr<const Indexer> indexer, std::int64_t recent) : indexer_(std::move(indexer)), recent_(recent) {}

  void observe(const PolicyView& v) override {
    const at::NoGradGuard no_grad;  // a trainer's live indexer has trainable leaves; scores are constants here
    const AttentionCall& call = *v.call;
    const at::Tensor kpos = v.cache->positions(v.layer);  // [B, Hkv, N]: older entries, then the chunk
    const std::int64_t n = kpos.size(-1), hkv = kpos.size(1);
    const at::Tensor chunk_keys = indexer_->key(v.layer, call.normed_input, call.positions);  // [B, Hk, T, dI]
    const at::Tensor new_keys = chunk_keys.expand({-1, hkv, -1, -1});
    if (static_cast<std::size_t>(v.layer) >= keys_.size()) keys_.resize(static_cast<std::size_t>(v.layer) + 1);
    at::Tensor& keys = keys_[static_cast<std::size_t>(v.layer)];
    keys = keys.defined() ? at::cat({keys, new_keys}, 2) : new_keys.contiguous();

    const at::Tensor I = indexer_->score(indexer_->query(v.layer, call.q_pre_rope, call.positions),
                                         indexer_->head_weights(v.layer, call.normed_input), keys);  // [B, Hkv, T, N]
    const at::Tensor visible = kpos.unsqueeze(2) <= call.positions.view({1, 1, -1, 1});              // [B, Hkv, T, N]
    at::Tensor& sum = sum_.extend(v.layer, n, kpos.to(at::kDouble));
    at::Tensor& seen = seen_.extend(v.layer, n, kpos.to(at::kDouble));
    sum = sum + I.masked_fill(visible.logical_not(), 0).sum(2).to(at::kDouble);
    seen = seen + visible.sum(2).to(at::kDouble);
  }

  at::Tensor score(const PolicyView& v) override {
    const at::Tensor mean = sum_.get(v.layer) / seen_.get(v.layer).clamp_min(1);
    return protect_recent(mean, v.cache->positions(v.layer), v.call->positions[-1].item<std::int64_t>(), recent_);
  }

  void retained(std::int64_t layer, const at::Tensor& index) override {
    sum_.gather(layer, index);
    seen_.gather(layer, index);
    at::Tensor& keys = keys_.at(static_cast<std::size_t>(layer));
    keys = at::gather(keys, 2, index.unsqueeze(-1).expand({-1, -1, -1, keys.size(-1)}));
  }

 private:
  std::shared_ptr<const Indexer> indexer_;
  std::int64_t recent_;
  PerEntryState sum_, seen_;
  std::vector<at::Tensor> keys_;  // per layer [B, Hkv, N, dI]: each cached entry's indexer key
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_indexmem(const PolicyOptions& o) {
  if (!o.indexer) fail("config", "indexmem.weights", "policy indexmem needs an indexer file (kvbound export RUN_DIR --out FILE)");
  return std::make_unique<IndexMem>(o.indexer, o.indexmem_recent);
}

}  // namespace kvbound::policies
