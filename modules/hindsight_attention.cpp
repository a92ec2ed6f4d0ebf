#include "modules/hindsight_attention.h"

#include <ATen/core/grad_mode.h>

#include "base/errors.h"
#include "modules/budgeted_cache.h"

namespace kvbound {
namespace {

// Keeps every layer's attention of the sequence (one chunk) over itself, averaged over each KV group's heads.
struct GroupAttention final : AttentionHook {
  std::vector<at::Tensor> per_layer;
  void after_attention(AttentionCall& call, KVCache& cache) override {
    per_layer.push_back(chunk_attention_probs(call, cache).mean(2));  // [B, Hkv, G, T, T] -> [B, Hkv, T, T]
  }
};

}  // namespace

Hindsight hindsight_attention(const Backbone& model, const at::Tensor& tokens, std::int64_t first_scored_row) {
  const std::int64_t T = tokens.size(1);
  if (first_scored_row < 0 || first_scored_row >= T)
    fail("hindsight", "first_scored_row", "must be in [0, " + std::to_string(T) + "), got " + std::to_string(first_scored_row));
  const at::NoGradGuard no_grad;
  GroupAttention hook;
  KVCache cache = model.make_cache();
  model.forward_hidden(tokens, cache, &hook);
  return {std::move(hook.per_layer), first_scored_row};
}

}  // namespace kvbound
