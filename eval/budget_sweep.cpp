#include "eval/budget_sweep.h"

#include <map>

#include "base/errors.h"
#include "base/progress.h"
#include "data/text_windows.h"

namespace kvbound {
namespace {

struct Run {
  const ConfiguredPolicy* policy;
  std::int64_t budget;  // 0 for an unbounded policy (full)
};

std::vector<Run> runs_of(const SweepSettings& s) {
  std::vector<Run> runs;
  for (const ConfiguredPolicy& p : s.policies) {
    if (!p.make(0)->bounded()) {
      runs.push_back({&p, 0});
      continue;
    }
    for (std::int64_t b : s.budgets) {
      if (b < 1) fail("eval", "budgets", "every budget must be >= 1, got " + std::to_string(b));
      runs.push_back({&p, b});
    }
  }
  if (runs.empty()) fail("eval", "policies", "no policy to evaluate");
  return runs;
}

// A fresh policy per run and window: policies keep per-sequence state.
std::unique_ptr<EvictionPolicy> fresh(const Run& run, std::uint64_t seed, std::uint64_t salt) {
  return run.policy->make(seed * 1000003 + salt);
}

}  // namespace

EvalResults run_budget_sweep(const Backbone& model, const Tokenizer& tokenizer, const SweepSettings& s) {
  const std::vector<Run> runs = runs_of(s);
  const TextWindows text(s.text_path, s.text_part, "eval.text_part");
  std::vector<std::vector<std::int64_t>> windows;
  if (s.run_continuation) windows = text.sample(tokenizer, s.num_windows, s.context_len, s.seed);
  std::vector<RetrievalCase> cases;
  if (s.run_retrieval) cases = make_retrieval_cases(tokenizer, text, s.retrieval);

  // The oracle's hindsight, once per window or case for every run that needs it.
  bool needs_hindsight = false;
  for (const Run& run : runs) needs_hindsight = needs_hindsight || run.policy->make(0)->needs_hindsight();

  ProgressBar progress("eval", static_cast<std::int64_t>(runs.size() * (windows.size() + cases.size())));
  std::map<std::size_t, ContinuationTotals> totals;
  for (std::size_t w = 0; w < windows.size(); ++w) {
    ContinuationReference ref = continuation_reference(model, windows[w], s.continuation);
    if (needs_hindsight) ref.hindsight = continuation_hindsight(model, ref, s.continuation);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      auto policy = fresh(runs[r], s.seed, w);
      run_continuation(model, *policy, std::max<std::int64_t>(runs[r].budget, 1), s.continuation, ref, totals[r]);
      progress.advance(1, "window " + std::to_string(w + 1) + " " + runs[r].policy->name());
    }
  }
  std::map<std::size_t, std::int64_t> correct;
  for (std::size_t c = 0; c < cases.size(); ++c) {
    const Hindsight hindsight = needs_hindsight ? retrieval_hindsight(model, tokenizer, s.retrieval, cases[c]) : Hindsight{};
    for (std::size_t r = 0; r < runs.size(); ++r) {
      auto policy = fresh(runs[r], s.seed, 7777 + c);
      const std::string answer =
          answer_retrieval(model, tokenizer, *policy, std::max<std::int64_t>(runs[r].budget, 1), s.retrieval, cases[c], hindsight);
      correct[r] += retrieval_correct(answer, cases[c].passkey) ? 1 : 0;
      progress.advance(1, "passkey " + std::to_string(c + 1) + " " + runs[r].policy->name());
    }
  }
  progress.finish();

  EvalResults results;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    ResultRow row{runs[r].policy->name(), runs[r].budget, {}};
    if (s.run_continuation) {
      const ContinuationTotals& t = totals[r];
      const double n = static_cast<double>(t.scored);
      row.metrics[metric::kNll] = t.nll / n;
      row.metrics[metric::kKlToFull] = t.kl / n;
      row.metrics[metric::kTop1Agree] = t.agree / n;
      row.metrics[metric::kPrefillTokS] = static_cast<double>(t.prefill_tokens) / t.prefill_seconds;
      row.metrics[metric::kDecodeTokS] = static_cast<double>(t.decode_tokens) / t.decode_seconds;
      row.metrics[metric::kPeakKvBytes] = static_cast<double>(t.peak_kv_bytes);
    }
    if (s.run_retrieval) row.metrics[metric::kRetrievalAcc] = static_cast<double>(correct[r]) / static_cast<double>(cases.size());
    results.rows.push_back(std::move(row));
  }
  return results;
}

}  // namespace kvbound
