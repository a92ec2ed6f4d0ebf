#include "eval/retrieval.h"

#include <ATen/ops/tensor.h>

#include <cctype>
#include <random>

#include "base/errors.h"
#include "modules/memory_cache.h"
#include "modules/sampler.h"

namespace kvbound {

std::vector<RetrievalCase> make_retrieval_cases(const Tokenizer& tokenizer, const TextWindows& text,
                                                const RetrievalSettings& s) {
  const std::vector<std::int64_t> intro = tokenizer.encode(
      "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
      "I will quiz you about the pass key.\n",
      /*add_bos=*/true);
  const std::vector<std::int64_t> question = tokenizer.encode("\nWhat is the pass key? The pass key is", false);
  std::mt19937_64 rng(s.seed);
  std::vector<RetrievalCase> cases;
  for (double depth : s.depths) {
    if (depth < 0 || depth > 1) fail("eval", "retrieval.depths", "each depth must be in [0, 1]");
    for (std::int64_t i = 0; i < s.samples_per_depth; ++i) {
      RetrievalCase c;
      c.depth = depth;
      c.passkey = std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
      const std::vector<std::int64_t> needle =
          tokenizer.encode(" The pass key is " + c.passkey + ". Remember it. " + c.passkey + " is the pass key.\n", false);
      const std::int64_t filler_len = s.context_len - static_cast<std::int64_t>(intro.size() + needle.size() + question.size());
      if (filler_len < 16)
        fail("eval", "retrieval.context_len", std::to_string(s.context_len) + " leaves no room for filler text");
      const std::vector<std::int64_t> filler = text.filler(tokenizer, filler_len, rng());
      const auto split = static_cast<std::ptrdiff_t>(depth * static_cast<double>(filler_len));
      c.prompt = intro;
      c.prompt.insert(c.prompt.end(), filler.begin(), filler.begin() + split);
      c.prompt.insert(c.prompt.end(), needle.begin(), needle.end());
      c.prompt.insert(c.prompt.end(), filler.begin() + split, filler.end());
      c.question_start = static_cast<std::int64_t>(c.prompt.size());
      c.prompt.insert(c.prompt.end(), question.begin(), question.end());
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

namespace {

at::Tensor as_row(const std::vector<std::int64_t>& tokens) {
  return at::tensor(tokens, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
}

// Greedy answer tokens (EOS not included) after a chunked prefill of the prompt, under `hook` (null: full cache).
std::vector<std::int64_t> greedy_answer(const Backbone& model, const Tokenizer& tokenizer, AttentionHook* hook,
                                        const RetrievalSettings& s, const std::vector<std::int64_t>& prompt_tokens) {
  KVCache cache = model.make_cache();
  const at::Tensor prompt = as_row(prompt_tokens);
  const std::int64_t T = prompt.size(1);
  at::Tensor logits;
  for (std::int64_t start = 0; start < T; start += s.chunk_size) {
    const at::Tensor hidden = model.forward_hidden(prompt.narrow(1, start, std::min(s.chunk_size, T - start)), cache, hook);
    logits = model.logits(hidden[0][-1]);
  }
  Sampler greedy({});
  std::vector<std::int64_t> answer;
  for (std::int64_t i = 0; i < s.answer_tokens; ++i) {
    const std::int64_t next = greedy.next(logits);
    if (next == tokenizer.eos_id()) break;
    answer.push_back(next);
    logits = model.logits(model.forward_hidden(as_row({next}), cache, hook)[0][-1]);
  }
  return answer;
}

}  // namespace

Hindsight retrieval_hindsight(const Backbone& model, const Tokenizer& tokenizer, const RetrievalSettings& s,
                              const RetrievalCase& c) {
  std::vector<std::int64_t> seen = c.prompt;
  const std::vector<std::int64_t> full_answer = greedy_answer(model, tokenizer, nullptr, s, c.prompt);
  if (!full_answer.empty()) seen.insert(seen.end(), full_answer.begin(), full_answer.end() - 1);
  return hindsight_attention(model, as_row(seen), c.question_start);
}

std::string answer_retrieval(const Backbone& model, const Tokenizer& tokenizer, EvictionPolicy& policy,
                             std::int64_t budget, const RetrievalSettings& s, const RetrievalCase& c,
                             const Hindsight& hindsight) {
  if (policy.needs_hindsight()) policy.set_hindsight(hindsight);
  BudgetedHook hook(policy, budget, s.buffer, s.budgeted_layers,
                    s.layer_budget_shares.empty() ? std::vector<std::int64_t>{} : apportion_budget(budget, s.layer_budget_shares),
                    s.budget_scope.value_or(policy.budget_scope()));
  return tokenizer.decode(greedy_answer(model, tokenizer, hook.get(), s, c.prompt));
}

bool retrieval_correct(const std::string& answer, const std::string& passkey) {
  std::size_t i = 0;
  while (i < answer.size() && !std::isdigit(static_cast<unsigned char>(answer[i]))) ++i;
  std::size_t j = i;
  while (j < answer.size() && std::isdigit(static_cast<unsigned char>(answer[j]))) ++j;
  return j > i && answer.substr(i, j - i) == passkey;
}

}  // namespace kvbound
