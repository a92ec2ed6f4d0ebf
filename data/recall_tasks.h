// Synthetic recall tasks planted in training rows (`data.recall_share`).
//
// Prose rarely asks, at its end, for a token read hundreds of tokens before, so a policy trained only to match
// the attention of prose learns nothing about keeping such a token, and a deployment that is later asked for
// it (passkey retrieval, a name, a number in a document) finds it evicted. A planted row keeps the row's own
// text as the filler and makes its end such a question:
//
//   text[0, a) · fact(v) · text[a, m) · question · answer(v)        (exactly the row's T tokens)
//
// where v is a random number of 2–7 digits, the fact and question come from one of a few templates (none of
// them the passkey task's wording in eval/retrieval.cpp, which stays held out), and the depth a is uniform in
// [0, m]. Every token stays a target: the teacher still answers from the full context, so the losses ask the
// student (gates, indexer, memory) to keep what the answer needs.
//
// Which rows are planted, and how, is a function of (seed, epoch, row) alone: a resumed run sees the same rows.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace kvbound {

class RecallTasks {
 public:
  // `share` in [0, 1]: the expected share of full rows that become a task.
  RecallTasks(const Tokenizer& tokenizer, double share, std::uint64_t seed);

  struct Planted {
    std::vector<std::int32_t> tokens;           // the row's T tokens
    std::int64_t fact_start = 0, fact_length = 0;  // where the fact sits in `tokens`
    std::int64_t answer_length = 0;             // the answer is the last answer_length tokens
    std::string value;                          // the number the answer states
  };
  // Row `row` of epoch `epoch`, whose `text` holds its T tokens (T − 1 inputs after BOS and the last target),
  // as a task of the same length; nullopt when the row stays text (not drawn, or too short to hold a task).
  std::optional<Planted> plant(std::int64_t epoch, std::int64_t row, const std::vector<std::int32_t>& text) const;

 private:
  const Tokenizer& tokenizer_;
  double share_;
  std::uint64_t seed_;
};

}  // namespace kvbound
