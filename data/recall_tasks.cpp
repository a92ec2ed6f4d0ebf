#include "data/recall_tasks.h"

#include <array>
#include <random>

#include "base/errors.h"

namespace kvbound {
namespace {

// {v}: the number; {n}: a name. The answer follows the question directly.
struct Template {
  const char* fact;
  const char* question;
  const char* answer;
};

constexpr std::array<Template, 8> kTemplates{{
    {"The secret number is {v}.", "What is the secret number? The secret number is", " {v}."},
    {"Remember this code: {v}. The code is {v}.", "What is the code? The code is", " {v}."},
    {"{n}'s room number is {v}.", "What is {n}'s room number? It is", " {v}."},
    {"{n} wrote the number {v} on a card and hid it.", "What number did {n} write on the card? The number was", " {v}."},
    {"The password for the gate is {v}.", "What is the password for the gate? The password is", " {v}."},
    {"The train to the city leaves from platform {v}.", "Which platform does the train to the city leave from? Platform",
     " {v}."},
    {"Important: the lucky number today is {v}. Do not forget {v}.", "What is today's lucky number? It is", " {v}."},
    {"{n} lives at number {v} on the long street.", "At what number does {n} live? {n} lives at number", " {v}."},
}};

constexpr std::array<const char*, 12> kNames{"Anna", "Tom",   "Lucy", "Peter", "Mary",  "James",
                                             "Emma", "Henry", "Rosa", "Oscar", "Clara", "Victor"};

std::string fill(std::string text, const std::string& value, const std::string& name) {
  for (const auto& [key, with] : {std::pair<std::string, std::string>{"{v}", value}, {"{n}", name}})
    for (std::size_t at = text.find(key); at != std::string::npos; at = text.find(key, at + with.size()))
      text.replace(at, key.size(), with);
  return text;
}

std::vector<std::int32_t> ids(const Tokenizer& tokenizer, const std::string& text) {
  std::vector<std::int32_t> out;
  for (std::int64_t id : tokenizer.encode(text, /*add_bos=*/false)) out.push_back(static_cast<std::int32_t>(id));
  return out;
}

}  // namespace

RecallTasks::RecallTasks(const Tokenizer& tokenizer, double share, std::uint64_t seed)
    : tokenizer_(tokenizer), share_(share), seed_(seed) {
  if (!(share >= 0 && share <= 1)) fail("config", "data.recall_share", "must be in [0, 1]");
}

std::optional<RecallTasks::Planted> RecallTasks::plant(std::int64_t epoch, std::int64_t row,
                                                      const std::vector<std::int32_t>& text) const {
  if (share_ <= 0) return std::nullopt;
  // Its own stream per (seed, epoch, row), apart from the row order's and the shift's; draws are taken with
  // `rng() % n` and a fixed-width uniform so the tasks do not depend on the standard library's distributions.
  std::mt19937_64 rng((seed_ ^ 0x5851F42D4C957F2Dull) * 0x9E3779B97F4A7C15ull +
                      static_cast<std::uint64_t>(epoch) * 0xBF58476D1CE4E5B9ull + static_cast<std::uint64_t>(row));
  const double draw = static_cast<double>(rng() >> 11) * 0x1.0p-53;
  if (draw >= share_) return std::nullopt;
  const Template& t = kTemplates[rng() % kTemplates.size()];
  const std::string name = kNames[rng() % kNames.size()];
  const std::size_t digits = 2 + rng() % 6;
  std::string value(1, static_cast<char>('1' + rng() % 9));
  while (value.size() < digits) value += static_cast<char>('0' + rng() % 10);
  // A fact or question starts a line or continues one, as in the documents it is planted in.
  const char* before_fact = rng() % 2 ? "\n" : " ";
  const char* before_question = rng() % 2 ? "\n" : " ";
  const std::vector<std::int32_t> fact = ids(tokenizer_, before_fact + fill(t.fact, value, name) + "\n");
  const std::vector<std::int32_t> question = ids(tokenizer_, before_question + fill(t.question, value, name));
  const std::vector<std::int32_t> answer = ids(tokenizer_, fill(t.answer, value, name));
  const auto T = static_cast<std::int64_t>(text.size());
  const std::int64_t filler = T - static_cast<std::int64_t>(fact.size() + question.size() + answer.size());
  if (filler < static_cast<std::int64_t>(fact.size())) return std::nullopt;  // a row too short for a task worth asking
  const auto depth = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(filler + 1));
  Planted p;
  p.tokens.reserve(text.size());
  p.tokens.insert(p.tokens.end(), text.begin(), text.begin() + depth);
  p.tokens.insert(p.tokens.end(), fact.begin(), fact.end());
  p.tokens.insert(p.tokens.end(), text.begin() + depth, text.begin() + filler);
  p.tokens.insert(p.tokens.end(), question.begin(), question.end());
  p.tokens.insert(p.tokens.end(), answer.begin(), answer.end());
  p.fact_start = depth;
  p.fact_length = static_cast<std::int64_t>(fact.size());
  p.answer_length = static_cast<std::int64_t>(answer.size());
  p.value = value;
  return p;
}

}  // namespace kvbound
