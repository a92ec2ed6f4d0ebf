// Synthetic recall tasks in training rows (data/recall_tasks.h): a planted row keeps its length and its own
// text in order around the fact, ends with the question and the answer that states the fact's number, and
// which rows are planted, and how, is a function of (seed, epoch, row).
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "base/errors.h"
#include "data/recall_tasks.h"
#include "data/tokenizer.h"
#include "data/training_rows.h"
#include "test_env.h"

using namespace kvbound;

namespace {

std::vector<std::int32_t> prose(const Tokenizer& tokenizer, std::size_t length) {
  std::vector<std::int32_t> out;
  const std::string text = "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
                           "nothing to do: once or twice she had peeped into the book her sister was reading. ";
  while (out.size() < length)
    for (std::int64_t id : tokenizer.encode(text, false)) out.push_back(static_cast<std::int32_t>(id));
  out.resize(length);
  return out;
}

std::string decoded(const Tokenizer& tokenizer, const std::vector<std::int32_t>& ids, std::int64_t from, std::int64_t count) {
  return tokenizer.decode(std::vector<std::int64_t>(ids.begin() + from, ids.begin() + from + count));
}

}  // namespace

TEST(RecallTasks, PlantedRowKeepsItsLengthItsTextAndEndsWithTheFactsNumber) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  const auto tokenizer = load_tokenizer(test::default_model());
  const std::int64_t T = 128;
  const std::vector<std::int32_t> text = prose(*tokenizer, T);
  const RecallTasks tasks(*tokenizer, 1.0, 7);
  std::set<std::string> values, facts;
  std::set<std::int64_t> depths;
  for (std::int64_t row = 0; row < 40; ++row) {
    const auto p = tasks.plant(0, row, text);
    ASSERT_TRUE(p.has_value()) << "row " << row;
    ASSERT_EQ(static_cast<std::int64_t>(p->tokens.size()), T);
    // The text before the fact is the row's first tokens; after it the text goes on where it stopped.
    EXPECT_TRUE(std::equal(text.begin(), text.begin() + p->fact_start, p->tokens.begin()));
    const std::int64_t after = p->fact_start + p->fact_length;
    const std::int64_t question_start = T - p->answer_length;
    std::int64_t resumed = 0;  // filler tokens after the fact: the text from the depth on, up to the question
    while (after + resumed < question_start && p->tokens[static_cast<std::size_t>(after + resumed)] ==
                                                   text[static_cast<std::size_t>(p->fact_start + resumed)])
      ++resumed;
    EXPECT_GT(resumed, 0) << "row " << row;
    const std::string fact = decoded(*tokenizer, p->tokens, p->fact_start, p->fact_length);
    EXPECT_NE(fact.find(p->value), std::string::npos) << fact;
    EXPECT_EQ(fact.find("pass key"), std::string::npos) << "the eval's wording stays held out: " << fact;
    EXPECT_EQ(decoded(*tokenizer, p->tokens, question_start, p->answer_length), " " + p->value + ".");
    EXPECT_GE(p->value.size(), 2u);
    EXPECT_LE(p->value.size(), 7u);
    EXPECT_NE(p->value[0], '0');
    values.insert(p->value);
    depths.insert(p->fact_start);
    facts.insert(fact.substr(0, fact.find(p->value)));
    // A function of (seed, epoch, row): the same task again, another for the next epoch.
    EXPECT_EQ(tasks.plant(0, row, text)->tokens, p->tokens);
  }
  EXPECT_GE(values.size(), 38u);
  EXPECT_GE(depths.size(), 20u);
  EXPECT_GE(facts.size(), 8u);  // templates and line starts vary
  EXPECT_NE(tasks.plant(1, 0, text)->tokens, tasks.plant(0, 0, text)->tokens);
  EXPECT_NE(RecallTasks(*tokenizer, 1.0, 8).plant(0, 0, text)->tokens, tasks.plant(0, 0, text)->tokens);
}

TEST(RecallTasks, ShareOfPlantedRowsIsTheConfiguredOneAndTooShortRowsStayText) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  const auto tokenizer = load_tokenizer(test::default_model());
  const std::vector<std::int32_t> text = prose(*tokenizer, 96);
  const RecallTasks tasks(*tokenizer, 0.25, 3);
  std::int64_t planted = 0;
  const std::int64_t rows = 2000;
  for (std::int64_t row = 0; row < rows; ++row) planted += tasks.plant(2, row, text).has_value();
  EXPECT_NEAR(static_cast<double>(planted) / rows, 0.25, 0.03);  // binomial std 0.0097
  EXPECT_FALSE(RecallTasks(*tokenizer, 0.0, 3).plant(0, 0, text).has_value());
  EXPECT_FALSE(RecallTasks(*tokenizer, 1.0, 3).plant(0, 0, prose(*tokenizer, 24)).has_value());
  for (double bad : {-0.1, 1.5}) {
    try {
      RecallTasks(*tokenizer, bad, 3);
      ADD_FAILURE() << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("data.recall_share"), std::string::npos) << e.what();
    }
  }
}

// Through TrainingRows: with share 1 every full row is a task (its inputs and targets still one shifted stream,
// all of it scored), a short row stays as cut, and a reader opened afresh at a position gives the same batch.
TEST(RecallTasks, TrainingRowsPlantEveryFullRowAndResumeTheSameTasks) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  const auto tokenizer = load_tokenizer(test::default_model());
  test::TempDir dir("recall_rows");
  std::string doc;
  for (int i = 0; i < 48; ++i) doc += "Alice sat by the river with her sister, and the afternoon was long and warm. ";
  std::ofstream(dir / "docs.txt") << doc << "\n<|endoftext|>\nA short one.\n";
  const std::int64_t T = 128;  // room for every template: a task fills at most ~60 tokens
  const TrainingRows plain(dir / "docs.txt", *tokenizer, T, 5);
  const TrainingRows planted(dir / "docs.txt", *tokenizer, T, 5, RowCutting{}, 1.0);
  ASSERT_EQ(plain.num_rows(), planted.num_rows());
  DataPosition a, b;
  const Batch text = plain.next(plain.num_rows(), a), tasks = planted.next(planted.num_rows(), b);
  std::int64_t changed = 0, full_rows = 0;
  for (std::int64_t r = 0; r < text.inputs.size(0); ++r) {
    const bool full = text.weights[r].sum().item<double>() == static_cast<double>(T);
    EXPECT_TRUE(at::equal(text.weights[r], tasks.weights[r]));
    EXPECT_EQ(tasks.inputs[r][0].item<std::int64_t>(), tokenizer->bos_id());
    if (full)
      EXPECT_TRUE(at::equal(tasks.inputs[r].narrow(0, 1, T - 1), tasks.targets[r].narrow(0, 0, T - 1))) << "row " << r;
    else
      EXPECT_TRUE(at::equal(text.inputs[r], tasks.inputs[r])) << "row " << r;
    changed += full && !at::equal(text.inputs[r], tasks.inputs[r]);
    full_rows += full;
  }
  EXPECT_GE(full_rows, 4);
  EXPECT_EQ(changed, full_rows);
  EXPECT_EQ(text.tokens, tasks.tokens);
  const TrainingRows fresh(dir / "docs.txt", *tokenizer, T, 5, RowCutting{}, 1.0);
  DataPosition c{2, 1}, d{2, 1};
  EXPECT_TRUE(at::equal(planted.next(3, c).inputs, fresh.next(3, d).inputs));
}
