#include "modules/memory_cache.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/sort.h>

#include <algorithm>
#include <numeric>

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
  if (pre_rope_keys_.size() <= l) pre_rope_keys_.resize(l + 1);
  at::Tensor& keys = pre_rope_keys_[l];
  keys = keys.defined() ? at::cat({keys, call.k_pre_rope}, 2) : call.k_pre_rope;
  if (layer_peak_bytes_.size() <= l) layer_peak_bytes_.resize(l + 1, 0);
  const MemoryState::Layer& state = state_.layer(call.layer);
  std::int64_t bytes = static_cast<std::int64_t>(keys.nbytes());
  for (const at::Tensor* t : {&state.mem, &state.z})
    if (t->defined()) bytes += static_cast<std::int64_t>(t->nbytes());
  layer_peak_bytes_[l] = std::max(layer_peak_bytes_[l], bytes);
  // Read before the budgeted cache writes this chunk's evictions (see the header); the eviction only observes
  // q/k, so the mixed output can be set first. A slot read weighs the memory against what attention just saw.
  call.output = memory_->mix(call.layer, state_, call.q_pre_rope, call.output, call.logsumexp).to(call.output.scalar_type());
  budgeted_.after_attention(call, cache);
}

void MemoryAugmentedCache::write_evicted(std::int64_t layer, const at::Tensor& keep, const KVCache& cache) {
  at::Tensor& keys = pre_rope_keys_.at(static_cast<std::size_t>(layer));
  const std::int64_t D = keys.size(-1);
  auto rows = [D](const at::Tensor& index) { return index.unsqueeze(-1).expand({-1, -1, -1, D}); };
  const at::Tensor evicted = rows(evicted_index(keep, cache.size(layer)));
  memory_->write(layer, state_, at::gather(keys, 2, evicted), at::gather(cache.values(layer), 2, evicted));
  keys = at::gather(keys, 2, rows(keep));
}

std::int64_t MemoryAugmentedCache::peak_bytes() const {
  return std::accumulate(layer_peak_bytes_.begin(), layer_peak_bytes_.end(), std::int64_t{0});
}

BudgetedHook::BudgetedHook(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer)
    : budgeted_(policy, budget, buffer) {
  if (policy.memory()) memory_ = std::make_unique<MemoryAugmentedCache>(budgeted_, policy.memory());
}

}  // namespace kvbound
