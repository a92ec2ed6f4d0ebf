// Task (b), synthetic passkey retrieval: a 5-digit pass key is hidden at a chosen depth of real filler
// text; after the question the model greedily answers under the budget (chunked prefill, then decode).
// Exact match of the first number in the answer. Deterministic for a seed.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "data/text_windows.h"
#include "modules/backbone.h"
#include "modules/eviction_policy.h"
#include "modules/hindsight_attention.h"

namespace kvbound {

struct RetrievalSettings {
  std::int64_t context_len = 512;      // prompt length in tokens
  std::vector<double> depths = {0.1, 0.5, 0.9};  // where the needle sits, as a fraction of the filler
  std::int64_t samples_per_depth = 4;
  std::int64_t chunk_size = 64;
  std::int64_t buffer = 0;
  std::vector<std::int64_t> budgeted_layers;  // the layers held to the budget (empty: every layer)
  std::vector<double> layer_budget_shares;    // each layer's share of the L·M entries (empty: M in every layer)
  // What M bounds for every policy (each head, each layer's heads, or the model's); unset: each policy's own
  // (EvictionPolicy::budget_scope).
  std::optional<BudgetScope> budget_scope;
  std::int64_t answer_tokens = 8;
  std::uint64_t seed = 0;
};

struct RetrievalCase {
  std::vector<std::int64_t> prompt;
  std::string passkey;
  double depth = 0;
  std::int64_t question_start = 0;  // the question's first position in `prompt`
};

std::vector<RetrievalCase> make_retrieval_cases(const Tokenizer& tokenizer, const TextWindows& text,
                                                const RetrievalSettings& settings);

// The full model's attention over every row that produces its own greedy answer (the prompt, then the answer but
// its last token), the question's and the answer's rows scored: what an oracle ranks by. Once per case.
Hindsight retrieval_hindsight(const Backbone& model, const Tokenizer& tokenizer, const RetrievalSettings& settings,
                              const RetrievalCase& c);

// Greedy answer of the model under `policy` and `budget` for one case (the decoded answer text). A hindsight
// policy (oracle) is first handed `hindsight` (retrieval_hindsight's).
std::string answer_retrieval(const Backbone& model, const Tokenizer& tokenizer, EvictionPolicy& policy,
                             std::int64_t budget, const RetrievalSettings& settings, const RetrievalCase& c,
                             const Hindsight& hindsight = {});

// Whether the first run of digits in `answer` is exactly `passkey`.
bool retrieval_correct(const std::string& answer, const std::string& passkey);

}  // namespace kvbound
