// The budgeted KV cache: an AttentionHook that, after every chunk's attention in every layer, lets the
// policy observe the chunk and, when a layer holds more than budget + buffer entries per KV head,
// cuts it back to the policy's top-`budget` entries. A pre-evicting policy (EvictionPolicy::pre_evicts) is
// cut before the chunk's attention instead, over the older entries only. Either way, with chunked prefill
// (chunk C) and decode the cache never holds more than budget + buffer + C entries per layer and KV head.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "modules/backbone.h"
#include "modules/eviction_policy.h"

namespace kvbound {

class BudgetedCache final : public AttentionHook {
 public:
  // budget >= 1 entries per layer and KV head; buffer >= 0 extra entries tolerated before a cut. `layers`: the
  // layers held to the budget (empty: every layer); the others keep every entry while the policy still observes
  // them — an ablation that measures what evicting in those layers alone costs. `layer_budgets`: layer l's own
  // budget (each >= 1; empty: `budget` in every layer), e.g. apportion_budget's.
  BudgetedCache(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer = 0,
                std::vector<std::int64_t> layers = {}, std::vector<std::int64_t> layer_budgets = {});

  void before_attention(AttentionCall& call, KVCache& cache) override;
  void after_attention(AttentionCall& call, KVCache& cache) override;

  // Called on every cut (before or after attention), before KVCache::retain, with the kept entries `keep` [B, Hkv, M] (sorted) while
  // `cache` still holds every entry: the latent memory reads the evicted ones from it.
  using EvictionCallback = std::function<void(std::int64_t layer, const at::Tensor& keep, const KVCache& cache)>;
  void on_evict(EvictionCallback callback) { on_evict_ = std::move(callback); }

  // Largest number of entries any layer held (per KV head), and the sum over layers of each layer's
  // peak in bytes (keys + values): what the cache must be able to hold.
  std::int64_t peak_entries() const { return peak_entries_; }
  std::int64_t peak_kv_bytes() const;
  std::int64_t evictions() const { return evictions_; }

 private:
  void cut(const PolicyView& view, KVCache& cache);
  bool holds_to_budget(std::int64_t layer) const;
  std::int64_t budget_of(std::int64_t layer) const;

  EvictionPolicy& policy_;
  std::int64_t budget_, buffer_;
  std::vector<std::int64_t> layers_, layer_budgets_;
  std::int64_t peak_entries_ = 0, evictions_ = 0;
  std::vector<std::int64_t> layer_peak_bytes_;
  EvictionCallback on_evict_;
};

// Spreads the L·M entries that a budget of M per layer allows over L = shares.size() layers in proportion to
// `shares` (each > 0): each layer gets at least 1 and the per-layer budgets sum to exactly L·M (largest
// remainders round up). Equal shares give M in every layer.
// Fails naming eval.layer_budget_shares unless `shares` holds one finite share > 0 per layer of `num_layers`.
void check_layer_budget_shares(const std::vector<double>& shares, std::int64_t num_layers);
std::vector<std::int64_t> apportion_budget(std::int64_t budget, const std::vector<double>& shares);

// Attention probabilities of the chunk's queries over every cache entry, [B, Hkv, G, T, N] in float32,
// masked by position (an entry is visible to a query at or after its position).
at::Tensor chunk_attention_probs(const AttentionCall& call, const KVCache& cache);

}  // namespace kvbound
