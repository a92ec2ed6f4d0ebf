// Policies x budgets x tasks in one engine: every (policy, budget) pair sees the same windows and the
// same retrieval cases; `full` runs once (budget 0 in the results = unbounded).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "eval/continuation.h"
#include "eval/results.h"
#include "eval/retrieval.h"
#include "modules/backbone.h"
#include "modules/policies/registry.h"

namespace kvbound {

struct SweepSettings {
  std::vector<ConfiguredPolicy> policies;  // each run gets fresh instances (seeded from `seed`, window, case)
  std::vector<std::int64_t> budgets;
  bool run_continuation = true;
  bool run_retrieval = true;
  std::string text_path;           // real text: windows for continuation, filler for retrieval
  TextPart text_part;              // the share of its paragraphs used (eval.text_part)
  std::int64_t context_len = 256;  // continuation window length in tokens (BOS included)
  std::int64_t num_windows = 8;
  std::uint64_t seed = 0;
  ContinuationSettings continuation;
  RetrievalSettings retrieval;
};

EvalResults run_budget_sweep(const Backbone& model, const Tokenizer& tokenizer, const SweepSettings& settings);

}  // namespace kvbound
