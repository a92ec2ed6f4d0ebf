// An eviction policy scores every cached token per (batch, KV head); the budgeted cache keeps the
// top-M. One file per policy in modules/policies/, one line in modules/policies/policy_list.h (kvpress
// style): the file declares the policy's config keys and builds it (modules/policies/registry.h).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "modules/backbone.h"
#include "modules/hindsight_attention.h"
#include "modules/kv_cache.h"

namespace kvbound {

class LatentMemory;

// What a policy may look at after a chunk's attention in one layer (or, for a pre-evicting policy's
// observe_before/score, before it: the cache then holds only the entries older than the chunk).
struct PolicyView {
  std::int64_t layer = 0;
  const AttentionCall* call = nullptr;  // the chunk: q/k/v [B, H, T, D] (post-RoPE), positions [T]
  const KVCache* cache = nullptr;       // the older entries followed by the chunk (before attention: older only)
  // Attention probabilities of the chunk's queries over the cache entries, [B, Hkv, G, T, N]
  // (G = query heads per KV head); defined only for policies whose needs_attention() is true.
  at::Tensor probs;
};

// What the budget M bounds. `head`: every (layer, KV head) holds at most M entries. `layer`: a layer's KV heads
// share M·Hkv entries, the policy's top scores over all of them (Ada-KV's allocation). `model`: every head of every
// layer shares M·Hkv·L entries, cut once all layers have seen a chunk (the official package's
// DynamicBudgetTrimKVCache). The pooled scopes compare scores across heads (and layers), so they suit a policy
// whose scores mean the same in every head; the cache holds as many entries as under `head` (BudgetedCache).
enum class BudgetScope { Head, Layer, Model };

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // False for `full`: the cache is never cut.
  virtual bool bounded() const { return true; }
  // The most entries a layer may hold (per KV head) after a chunk without being cut back to `budget`.
  virtual std::int64_t tolerated_entries(std::int64_t budget, std::int64_t buffer) const { return budget + buffer; }
  // Whether observe() needs PolicyView::probs (computed only then: it costs a T x N matrix per head).
  virtual bool needs_attention() const { return false; }
  // Called after every chunk's attention, before any eviction; keeps the policy's running state
  // aligned with the cache (new entries are always appended at the end).
  virtual void observe(const PolicyView& view) { (void)view; }
  // A pre-evicting policy (DESIGN.md, indexmem) is cut *before* a chunk's attention: the budgeted cache
  // calls observe_before() while the cache holds only the older entries (the chunk's queries update their
  // statistics), then score() over those entries and the cut, and never cuts after attention; observe()
  // then only adds the chunk's own entries. The chunk's attention so runs over the kept set plus the chunk.
  virtual bool pre_evicts() const { return false; }
  virtual void observe_before(const PolicyView& view) { (void)view; }
  // A hindsight policy (`oracle`) ranks entries by what the full-cache model's later queries attend to, which no
  // deployable policy can know: the engine that runs it (eval's continuation and retrieval) hands it, before the
  // sequence's first chunk, the full model's attention over the sequence (modules/hindsight_attention.h).
  virtual bool needs_hindsight() const { return false; }
  virtual void set_hindsight(Hindsight hindsight) { (void)hindsight; }
  // A policy that also says how the cache is read (trimkv.gated_read) gives, before a chunk's attention (the cache
  // holding the older entries only), one log decay rate per entry the chunk will attend, [B, Hkv, N + T]: the cached
  // entries', then the chunk's own (AttentionCall::key_log_decay). Undefined (the default): a plain read.
  virtual at::Tensor read_log_decay(const PolicyView& view) { (void)view; return {}; }
  // The scope the policy is served under unless the eval names one for every policy (eval.budget_scope).
  virtual BudgetScope budget_scope() const { return BudgetScope::Head; }
  // Keep-scores [B, Hkv, N] for the cache entries of view.layer (higher = keep).
  virtual at::Tensor score(const PolicyView& view) = 0;
  // The cache kept entries `index` [B, Hkv, M] (sorted) of `layer`: gather per-entry state.
  virtual void retained(std::int64_t layer, const at::Tensor& index) { (void)layer; (void)index; }

  // The latent memory a "<policy>+mem" name attaches (null otherwise). Scoring never looks at it: the
  // engine's hook (BudgetedHook, modules/memory_cache.h) wraps its budgeted cache in the memory.
  const std::shared_ptr<const LatentMemory>& memory() const { return memory_; }
  void attach_memory(std::shared_ptr<const LatentMemory> memory) { memory_ = std::move(memory); }

 private:
  std::shared_ptr<const LatentMemory> memory_;
};

}  // namespace kvbound
