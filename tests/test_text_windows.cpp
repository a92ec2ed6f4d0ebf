// Held-out text windows (data/text_windows.h): a part of the paragraphs is all a window ever sees, so a
// validation part and a test part of one text never share a token; a bad or empty part is named.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <string>

#include "base/errors.h"
#include "data/text_windows.h"
#include "data/tokenizer.h"
#include "test_env.h"

namespace kvbound {
namespace {

// 40 paragraphs "mark NN mark NN ...", blank lines between them.
std::string write_numbered_text(const test::TempDir& dir) {
  const std::string path = dir / "text.txt";
  std::ofstream out(path);
  for (int p = 0; p < 40; ++p) {
    for (int w = 0; w < 12; ++w) out << "mark " << (p < 10 ? "0" : "") << p << " ";
    out << "\n\n";
  }
  return path;
}

// The paragraph numbers a window's text shows.
std::vector<int> paragraphs_in(const Tokenizer& tokenizer, const std::vector<std::int64_t>& window) {
  const std::string text = tokenizer.decode(window);
  std::vector<int> found;
  const std::regex number("mark (\\d\\d)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), number); it != std::sregex_iterator(); ++it)
    found.push_back(std::stoi((*it)[1]));
  return found;
}

TEST(TextWindows, APartHoldsEveryWindowInside) {
  KVBOUND_REQUIRE_FILE(test::asset("stories260K/tok512.bin"));
  const auto tokenizer = load_tokenizer(test::asset("stories260K/tok512.bin"));
  test::TempDir dir("text_windows");
  const std::string path = write_numbered_text(dir);
  for (std::uint64_t seed = 0; seed < 5; ++seed) {
    for (const auto& w : TextWindows(path, {0.0, 0.25}).sample(*tokenizer, 3, 40, seed)) {
      const std::vector<int> seen = paragraphs_in(*tokenizer, w);
      ASSERT_FALSE(seen.empty());
      for (int p : seen) EXPECT_LT(p, 10) << "validation window reached paragraph " << p;
    }
    for (const auto& w : TextWindows(path, {0.25, 1.0}).sample(*tokenizer, 3, 40, seed))
      for (int p : paragraphs_in(*tokenizer, w)) EXPECT_GE(p, 10) << "test window reached paragraph " << p;
  }
}

TEST(TextWindows, ABadOrEmptyPartIsNamed) {
  test::TempDir dir("text_windows_bad");
  const std::string path = write_numbered_text(dir);
  for (const TextPart part : {TextPart{0.5, 0.5}, TextPart{-0.1, 0.5}, TextPart{0.2, 1.5}, TextPart{0.0, 0.01}}) {
    try {
      TextWindows(path, part, "eval.text_part");
      ADD_FAILURE() << "no error for [" << part.from << ", " << part.to << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": eval.text_part: "), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kvbound
