#include "modules/memory_cache.h"

#include <ATen/ops/gather.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/sort.h>

#include <algorithm>
#include <numeric>

#include "base/errors.h"

namespace kvbound {

at::Tensor evicted_index(const at::Tensor& keep, std::int64_t n) {
  at::Tensor kept = at::zeros({keep.size(0), keep.size(1), n}, keep.options().dtype(at::kByte));
  kept.scatter_(-1, keep, 1);
  // A stable sort puts the evicted (0) entries first, each group in index (= position) order.
  const at::Tensor order = std::get<1>(at::sort(kept, /*stable=*/true, -1, /*descending=*/false));
  return order.narrow(-1, 0, n - keep.size(-1));
}

MemoryAugmentedCache::MemoryAugmentedCache(BudgetedCache& budgeted, std::shared_ptr<const LatentMemory> memory)
    : budgeted_(budgeted), memory_(std::move(memory)), state_(memory_->num_layers()) {
  budgeted_.on_evict([this](std::int64_t layer, const at::Tensor& keep, const KVCache& cache) {
    write_evicted(layer, keep, cache);
  });
}

void MemoryAugmentedCache::after_attention(AttentionCall& call, KVCache& cache) {
  const auto l = static_cast<std::size_t>(call.layer);
  // Read before the budgeted cache writes this chunk's evictions (see the header); the eviction only observes
  // q/k, so the mixed output can be set first. A slot read weighs the memory against what attention just saw.
  call.output = memory_->mix(call.layer, state_, call.q_pre_rope, call.output, call.logsumexp).to(call.output.scalar_type());
  budgeted_.after_attention(call, cache);
  // The state after this call's writes is the largest it has been (written once, then updated in place).
  if (layer_peak_bytes_.size() <= l) layer_peak_bytes_.resize(l + 1, 0);
  const MemoryState::Layer& state = state_.layer(call.layer);
  std::int64_t bytes = 0;
  for (const at::Tensor* t : {&state.mem, &state.z})
    if (t->defined()) bytes += static_cast<std::int64_t>(t->nbytes());
  layer_peak_bytes_[l] = std::max(layer_peak_bytes_[l], bytes);
}

void MemoryAugmentedCache::write_evicted(std::int64_t layer, const at::Tensor& keep, const KVCache& cache) {
  TORCH_CHECK(inv_freq_.defined(), "MemoryAugmentedCache: the attention call carries no RoPE frequencies (AttentionCall::inv_freq)");
  const at::Tensor index = evicted_index(keep, cache.size(layer));  // [B, Hkv, E]
  const at::Tensor rows = index.unsqueeze(-1).expand({-1, -1, -1, cache.keys(layer).size(-1)});
  const at::Tensor k_pre = undo_rope(at::gather(cache.keys(layer), 2, rows), at::gather(cache.positions(layer), 2, index), inv_freq_);
  memory_->write(layer, state_, k_pre, at::gather(cache.values(layer), 2, rows));
}

std::int64_t MemoryAugmentedCache::peak_bytes() const {
  return std::accumulate(layer_peak_bytes_.begin(), layer_peak_bytes_.end(), std::int64_t{0});
}

BudgetedHook::BudgetedHook(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer,
                           std::vector<std::int64_t> budgeted_layers, std::vector<std::int64_t> layer_budgets,
                           BudgetScope scope)
    : budgeted_(policy, budget, buffer, std::move(budgeted_layers), std::move(layer_budgets), scope) {
  if (!policy.memory()) return;
  if (scope != BudgetScope::Head)
    fail("config", "eval.budget_scope", "a +mem policy writes what each head evicts; a pooled budget (layer, model) is not built for it");
  memory_ = std::make_unique<MemoryAugmentedCache>(budgeted_, policy.memory());
}

}  // namespace kvbound
