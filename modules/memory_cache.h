// The latent memory around a budgeted cache ("<policy>+mem", DESIGN.md "Latent memory"), and the one
// place the engine builds its per-sequence hook, so continuation and retrieval treat "+mem" alike.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/eviction_policy.h"
#include "modules/latent_memory.h"

namespace kvbound {

// Per layer and chunk: (0) a pre-evicting policy cuts the older entries before attention, writing them into
// the memory; (1) mix the memory's read for the chunk's queries, from the memory as it stands, into the
// attention output (LatentMemory::mix: add, or slot against the logsumexp of what the attention saw);
// (2) let the budgeted cache observe and evict, writing every evicted entry into the memory. The read
// comes before the evictions of (2) are written because the chunk's attention already saw those entries
// (they were still cached): reading them back would count them twice. The entries of (0) the chunk's
// attention never saw, so the read includes them. The memory trainer
// (train/memory_method) replays exactly this order.
//
// The cache holds post-RoPE keys, the memory wants pre-RoPE ones: the evicted keys are rotated back at their
// own positions (undo_rope; equal to the pre-RoPE keys up to float rounding, and the trainer replays through
// this same hook). A copy of the pre-RoPE keys beside the cache would be exact but cost half the cache's
// bytes again; the memory's own state is what "+mem" adds to the bounded cache.
class MemoryAugmentedCache final : public AttentionHook {
 public:
  MemoryAugmentedCache(BudgetedCache& budgeted, std::shared_ptr<const LatentMemory> memory);
  MemoryAugmentedCache(const MemoryAugmentedCache&) = delete;  // the budgeted cache's callback points here
  MemoryAugmentedCache& operator=(const MemoryAugmentedCache&) = delete;
  ~MemoryAugmentedCache() override { budgeted_.on_evict(nullptr); }  // the cache may outlive this hook

  void before_attention(AttentionCall& call, KVCache& cache) override {
    inv_freq_ = call.inv_freq;  // a pre-evicting policy's cut below writes evicted keys, rotated back with it
    call.wants_logsumexp = memory_->needs_retained_lse();
    budgeted_.before_attention(call, cache);
  }
  void after_attention(AttentionCall& call, KVCache& cache) override;
  const MemoryState& state() const { return state_; }
  // Peak bytes this hook holds beside the cache, summed over layers: the memory state (Mem and z, once written).
  std::int64_t peak_bytes() const;

 private:
  void write_evicted(std::int64_t layer, const at::Tensor& keep, const KVCache& cache);

  BudgetedCache& budgeted_;
  std::shared_ptr<const LatentMemory> memory_;
  MemoryState state_;
  at::Tensor inv_freq_;  // the backbone's RoPE frequencies, from the call in flight (before_attention)
  std::vector<std::int64_t> layer_peak_bytes_;
};

// The engine's hook for one sequence: a BudgetedCache, wrapped by a MemoryAugmentedCache when the policy
// carries a latent memory (make_policy("<policy>+mem")).
class BudgetedHook {
 public:
  // `budgeted_layers`, `layer_budgets`: as BudgetedCache's `layers` (empty: every layer) and `layer_budgets`.
  // `scope`: as BudgetedCache's; a pooled one takes no latent memory.
  BudgetedHook(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer = 0,
               std::vector<std::int64_t> budgeted_layers = {}, std::vector<std::int64_t> layer_budgets = {},
               BudgetScope scope = BudgetScope::Head);
  BudgetedHook(const BudgetedHook&) = delete;
  BudgetedHook& operator=(const BudgetedHook&) = delete;

  AttentionHook* get() { return memory_ ? static_cast<AttentionHook*>(memory_.get()) : &budgeted_; }
  const BudgetedCache& budgeted() const { return budgeted_; }
  // What serving this sequence holds at most: the cache's keys and values, plus a latent memory's state when
  // there is one.
  std::int64_t peak_kv_bytes() const { return budgeted_.peak_kv_bytes() + (memory_ ? memory_->peak_bytes() : 0); }

 private:
  BudgetedCache budgeted_;
  std::unique_ptr<MemoryAugmentedCache> memory_;
};

// Indices [B, Hkv, N − M] of the entries not in `keep` [B, Hkv, M] (sorted) out of N, in increasing order.
at::Tensor evicted_index(const at::Tensor& keep, std::int64_t n);

}  // namespace kvbound
