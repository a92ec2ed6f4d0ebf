// The budgeted KV cache: an AttentionHook that, after every chunk's attention in every layer, lets the
// policy observe the chunk and, when a layer holds more than budget + buffer entries per KV head,
// cuts it back to the policy's top-`budget` entries. A pre-evicting policy (EvictionPolicy::pre_evicts) is
// cut before the chunk's attention instead, over the older entries only. Either way, with chunked prefill
// (chunk C) and decode the cache never holds more than budget + buffer + C entries per layer and KV head.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "modules/backbone.h"
#include "modules/eviction_policy.h"

namespace kvbound {

// `name` (head, layer, model) as a BudgetScope (modules/eviction_policy.h); anything else fails naming `field`.
BudgetScope parse_budget_scope(const std::string& name, const std::string& field);

class BudgetedCache final : public AttentionHook {
 public:
  // budget >= 1 entries per layer and KV head; buffer >= 0 extra entries tolerated before a cut. `layers`: the
  // layers held to the budget (empty: every layer); the others keep every entry while the policy still observes
  // them — an ablation that measures what evicting in those layers alone costs. `layer_budgets`: layer l's own
  // budget (each >= 1; empty: `budget` in every layer), e.g. apportion_budget's.
  // `scope`: a pooled scope takes neither `layers` nor `layer_budgets`, and `model` no pre-evicting policy.
  BudgetedCache(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer = 0,
                std::vector<std::int64_t> layers = {}, std::vector<std::int64_t> layer_budgets = {},
                BudgetScope scope = BudgetScope::Head);

  void before_attention(AttentionCall& call, KVCache& cache) override;
  void after_attention(AttentionCall& call, KVCache& cache) override;

  // Called on every cut (before or after attention), before KVCache::retain, with the kept entries `keep` [B, Hkv, M] (sorted) while
  // `cache` still holds every entry: the latent memory reads the evicted ones from it.
  using EvictionCallback = std::function<void(std::int64_t layer, const at::Tensor& keep, const KVCache& cache)>;
  void on_evict(EvictionCallback callback) { on_evict_ = std::move(callback); }

  // Largest number of entries any layer held (per KV head; under a pooled scope, the fullest head's), and the
  // bytes (keys + values) the cache must be able to hold: under `head` and `layer` the sum over layers of each
  // layer's peak, under `model` (whose layers trade entries) the largest the whole cache ever held; padding slots
  // are left out (a store that packs each head's entries, as the official flattened cache does, holds no padding).
  std::int64_t peak_entries() const { return peak_entries_; }
  std::int64_t peak_kv_bytes() const;
  std::int64_t evictions() const { return evictions_; }

 private:
  void cut(const PolicyView& view, KVCache& cache);
  // Keep-scores of view.layer's entries, checked against the cache's shape; −inf at padding slots.
  at::Tensor scores_of(const PolicyView& view, const KVCache& cache);
  // Keeps, per batch row, the top (|layers|·Hkv·M) of `scores` (one [B, Hkv, N_l] per layer of `layers`) over all
  // of them: each head of each layer keeps its share, the others become padding.
  void pooled_cut(const std::vector<std::int64_t>& layers, const std::vector<at::Tensor>& scores, KVCache& cache);
  void after_attention_pooled(const PolicyView& view, KVCache& cache);
  // Whether `layer` holds more than the policy tolerates: per head under `head`, over its heads' sum under a pooled scope.
  bool over_budget(std::int64_t layer, const KVCache& cache) const;
  bool holds_to_budget(std::int64_t layer) const;
  std::int64_t budget_of(std::int64_t layer) const;

  EvictionPolicy& policy_;
  std::int64_t budget_, buffer_;
  std::vector<std::int64_t> layers_, layer_budgets_;
  BudgetScope scope_;
  // scope model: whether the chunk in flight ends with a cut (decided at layer 0), and its layers' scores so far.
  bool model_cut_pending_ = false;
  std::vector<at::Tensor> pending_scores_;
  std::int64_t peak_entries_ = 0, evictions_ = 0, peak_live_bytes_ = 0;
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
