// What a learned (or any) eviction policy keeps on one text, step by step, and the patterns the TRIM-KV paper
// reports about it (`kvbound inspect`): attention sinks held, heads that act as sliding windows, long-lived
// tokens.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "modules/backbone.h"
#include "modules/eviction_policy.h"
#include "modules/retention_gate.h"

namespace kvbound {

struct CacheTimeline {
  std::int64_t layers = 0, heads = 0, tokens = 0;
  std::vector<std::vector<std::vector<std::vector<bool>>>> held;  // [layer][KV head][step][position]
};

// Decodes `tokens` [T] one token at a time (a fresh cache, `budget` entries per layer and KV head) under
// `policy` and records which positions each layer and head holds after every step.
CacheTimeline record_cache_timeline(const Backbone& model, EvictionPolicy& policy, std::int64_t budget,
                                    const at::Tensor& tokens);

// Every token's log β from trained gates, [layers, KV heads, T] (float32, CPU), from one plain forward.
at::Tensor token_log_beta(const Backbone& model, const RetentionGates& gates, const at::Tensor& tokens);

struct HeadPattern {
  std::int64_t layer = 0, head = 0;
  double sink_held = 0;     // share of the steps after the cache first filled at which position 0 is held
  double recent_share = 0;  // mean share of the budget held by the `budget` most recent positions (1: a sliding window)
  double mean_beta = 0;     // mean retention β of the head's tokens (NaN without gates)
};

// Per-layer budget shares from trained gates (for eval.layer_budget_shares): how the L·M entries that budget M
// allows would spread over the layers if the gates' own scores (t − pos)·log β were compared across layers —
// the global top L·Hkv·M of every layer's and head's scores after a quarter, half, three quarters and all of
// each window [L, Hkv, T] in `log_betas` — counted per layer (+1, so that no share is 0) and scaled to mean 1.
// A fixed per-layer budget keeps each layer's memory bounded, which a global top-k would not.
std::vector<double> gate_layer_shares(const std::vector<at::Tensor>& log_betas, std::int64_t budget);

// One pattern per layer and KV head; `log_beta` [L, Hkv, T] may be undefined.
std::vector<HeadPattern> head_patterns(const CacheTimeline& timeline, std::int64_t budget, const at::Tensor& log_beta);

// For each position, the number of steps it stays held after it was written, averaged over layers and heads.
std::vector<double> token_lifetimes(const CacheTimeline& timeline);

}  // namespace kvbound
