#include "data/text_windows.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "base/errors.h"

namespace kvbound {

TextWindows::TextWindows(const std::string& path, const TextPart& part, const std::string& part_key) : path_(path) {
  if (!(part.from >= 0 && part.from < part.to && part.to <= 1))
    fail(path, part_key, "[" + std::to_string(part.from) + ", " + std::to_string(part.to) + "] must satisfy 0 <= from < to <= 1");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "", "cannot open text file");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  std::string current;
  std::size_t i = 0;
  while (i <= text.size()) {
    const std::size_t end = std::min(text.find('\n', i), text.size());
    std::string line = text.substr(i, end - i);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) {
      if (!current.empty()) paragraphs_.push_back(std::move(current));
      current.clear();
    } else {
      current += current.empty() ? line : "\n" + line;
    }
    i = end + 1;
  }
  if (!current.empty()) paragraphs_.push_back(std::move(current));
  if (paragraphs_.empty()) fail(path, "", "no text");
  const auto n = static_cast<double>(paragraphs_.size());
  const auto first = static_cast<std::ptrdiff_t>(part.from * n), last = static_cast<std::ptrdiff_t>(part.to * n);
  paragraphs_ = std::vector<std::string>(paragraphs_.begin() + first, paragraphs_.begin() + last);
  if (paragraphs_.empty()) fail(path, part_key, "holds none of the text's " + std::to_string(static_cast<long>(n)) + " paragraphs");
}

std::string TextWindows::text_from(std::size_t first, std::int64_t tokens) const {
  // Real text runs at >= 1.5 bytes per token for every tokenizer here; 8 bytes per token is ample.
  const std::size_t want = static_cast<std::size_t>(tokens) * 8 + 64;
  std::string out;
  for (std::size_t p = first; p < paragraphs_.size() && out.size() < want; ++p) out += (out.empty() ? "" : "\n") + paragraphs_[p];
  return out;
}

std::vector<std::vector<std::int64_t>> TextWindows::sample(const Tokenizer& tokenizer, std::int64_t count,
                                                           std::int64_t length, std::uint64_t seed) const {
  std::vector<std::size_t> order(paragraphs_.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  std::vector<std::vector<std::int64_t>> windows;
  for (std::size_t p : order) {
    if (static_cast<std::int64_t>(windows.size()) == count) break;
    std::vector<std::int64_t> ids = tokenizer.encode(text_from(p, length), /*add_bos=*/true);
    if (tokenizer.bos_id() < 0) ids.insert(ids.begin(), tokenizer.eos_id() >= 0 ? tokenizer.eos_id() : 0);
    if (static_cast<std::int64_t>(ids.size()) < length) continue;  // too close to the end of the text
    ids.resize(static_cast<std::size_t>(length));
    windows.push_back(std::move(ids));
  }
  if (static_cast<std::int64_t>(windows.size()) < count)
    fail(path_, "", "holds only " + std::to_string(windows.size()) + " windows of " + std::to_string(length) +
                        " tokens starting at a paragraph, " + std::to_string(count) + " asked");
  return windows;
}

std::vector<std::int64_t> TextWindows::filler(const Tokenizer& tokenizer, std::int64_t length, std::uint64_t seed) const {
  std::vector<std::int64_t> ids;
  std::mt19937_64 rng(seed);
  for (int attempt = 0; attempt < 64; ++attempt) {
    const std::size_t p = std::uniform_int_distribution<std::size_t>(0, paragraphs_.size() - 1)(rng);
    ids = tokenizer.encode(text_from(p, length), /*add_bos=*/false);
    if (static_cast<std::int64_t>(ids.size()) >= length) {
      ids.resize(static_cast<std::size_t>(length));
      return ids;
    }
  }
  fail(path_, "", "too short for " + std::to_string(length) + " tokens of filler text");
}

}  // namespace kvbound
