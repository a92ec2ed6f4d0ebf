// Task (a), long-text continuation: prefill the first part of a window in chunks under the budget,
// then teacher-force the rest token by token; score every position from `score_from` on against the
// same window under the full cache: next-token NLL, KL(p_full || p_budgeted) and top-1 agreement.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "modules/backbone.h"
#include "modules/eviction_policy.h"
#include "modules/hindsight_attention.h"

namespace kvbound {

struct ContinuationSettings {
  std::int64_t prefill_len = 1;  // tokens prefilled in chunks (BOS included); the rest is decoded
  std::int64_t chunk_size = 64;  // prefill chunk C: peak KV entries per layer stay <= budget + buffer + C
  std::int64_t score_from = 1;   // first scored position (>= prefill_len): position p is predicted at p-1
  std::int64_t buffer = 0;
  std::vector<std::int64_t> budgeted_layers;  // the layers held to the budget (empty: every layer)
  std::vector<double> layer_budget_shares;    // each layer's share of the L·M entries (empty: M in every layer)
  // What M bounds for every policy (each head, each layer's heads, or the model's); unset: each policy's own
  // (EvictionPolicy::budget_scope).
  std::optional<BudgetScope> budget_scope;
};

// The full-cache log-probabilities [S, V] of the scored positions of one window (computed once).
struct ContinuationReference {
  at::Tensor tokens;        // [T] int64, BOS first
  at::Tensor full_logprobs; // [S, V] float32, row i predicts tokens[score_from + i]
  Hindsight hindsight;      // for a hindsight policy (oracle) only: continuation_hindsight's, once per window
};

// Sums over scored positions; rates and means come from these.
struct ContinuationTotals {
  double nll = 0, kl = 0, agree = 0;
  std::int64_t scored = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  std::int64_t prefill_tokens = 0, decode_tokens = 0;
  std::int64_t peak_kv_bytes = 0;
};

ContinuationReference continuation_reference(const Backbone& model, const std::vector<std::int64_t>& window,
                                             const ContinuationSettings& settings);

// The full model's attention over every row that runs (the last token predicts nothing), rows from
// score_from − 1 scored: what an oracle ranks by (modules/hindsight_attention.h). One forward of T − 1 tokens.
Hindsight continuation_hindsight(const Backbone& model, const ContinuationReference& reference,
                                 const ContinuationSettings& settings);

// Runs one window under `policy` with `budget` entries per layer and KV head (ignored by `full`) and
// adds its sums to `totals`.
void run_continuation(const Backbone& model, EvictionPolicy& policy, std::int64_t budget,
                      const ContinuationSettings& settings, const ContinuationReference& reference,
                      ContinuationTotals& totals);

}  // namespace kvbound
