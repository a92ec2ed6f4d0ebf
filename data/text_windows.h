// Evaluation windows cut from real text: paragraphs (blank-line separated; single newlines inside a
// paragraph are kept) are picked with a seeded RNG, and a window is BOS + the tokens of the text that
// starts at that paragraph, truncated to a fixed length. The same seed gives the same windows.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace kvbound {

// A contiguous share of a text's paragraphs, [from, to) as fractions of their count: one text serves as a
// validation part (to pick checkpoints by) and a disjoint test part (to report), e.g. [0, 0.25) and [0.25, 1).
struct TextPart {
  double from = 0.0, to = 1.0;
};

class TextWindows {
 public:
  // Reads `path` (UTF-8 text); blank-line paragraph breaks become single newlines, as in the reference
  // protocol; keeps the paragraphs of `part` only, so no window reaches outside it. Throws kvbound::Error
  // naming the file (and `part_key` for a bad or empty part) when it is missing or has no paragraphs there.
  explicit TextWindows(const std::string& path, const TextPart& part = {}, const std::string& part_key = "text part");

  // `count` windows of exactly `length` token ids (BOS first), starting at distinct random paragraphs.
  // Throws when the text cannot supply them.
  std::vector<std::vector<std::int64_t>> sample(const Tokenizer& tokenizer, std::int64_t count, std::int64_t length,
                                                std::uint64_t seed) const;
  // `length` token ids of running text (no BOS) starting at a random paragraph: filler for retrieval.
  std::vector<std::int64_t> filler(const Tokenizer& tokenizer, std::int64_t length, std::uint64_t seed) const;

 private:
  // Text from paragraph `first` on, long enough to hold about `tokens` tokens.
  std::string text_from(std::size_t first, std::int64_t tokens) const;
  std::string path_;
  std::vector<std::string> paragraphs_;
};

}  // namespace kvbound
