#include "eval/continuation.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/tensor.h>

#include <chrono>

#include "base/errors.h"
#include "modules/memory_cache.h"

namespace kvbound {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void check(const ContinuationSettings& s, std::int64_t T) {
  if (s.prefill_len < 1 || s.prefill_len >= T)
    fail("eval", "prefill_len", "must be in [1, context_len), got " + std::to_string(s.prefill_len));
  if (s.score_from < s.prefill_len || s.score_from >= T)
    fail("eval", "score_from", "must be in [prefill_len, context_len), got " + std::to_string(s.score_from));
  if (s.chunk_size < 1) fail("eval", "chunk_size", "must be >= 1");
}

}  // namespace

ContinuationReference continuation_reference(const Backbone& model, const std::vector<std::int64_t>& window,
                                             const ContinuationSettings& settings) {
  const auto T = static_cast<std::int64_t>(window.size());
  check(settings, T);
  ContinuationReference ref;
  ref.tokens = at::tensor(window, at::TensorOptions().dtype(at::kLong));
  KVCache cache = model.make_cache();
  const at::Tensor hidden = model.forward_hidden(ref.tokens.unsqueeze(0), cache)[0];
  // Only the scored rows go through the vocabulary projection (never T x V at once).
  const at::Tensor rows = hidden.narrow(0, settings.score_from - 1, T - settings.score_from);
  ref.full_logprobs = at::log_softmax(model.logits(rows), -1, at::kFloat);
  return ref;
}

Hindsight continuation_hindsight(const Backbone& model, const ContinuationReference& ref,
                                 const ContinuationSettings& settings) {
  const std::int64_t T = ref.tokens.size(0);
  return hindsight_attention(model, ref.tokens.narrow(0, 0, T - 1).unsqueeze(0), settings.score_from - 1);
}

void run_continuation(const Backbone& model, EvictionPolicy& policy, std::int64_t budget,
                      const ContinuationSettings& settings, const ContinuationReference& ref,
                      ContinuationTotals& totals) {
  const std::int64_t T = ref.tokens.size(0);
  check(settings, T);
  BudgetedHook hook(policy, budget, settings.buffer, settings.budgeted_layers,
                    settings.layer_budget_shares.empty() ? std::vector<std::int64_t>{}
                                                         : apportion_budget(budget, settings.layer_budget_shares),
                    settings.budget_scope.value_or(policy.budget_scope()));
  KVCache cache = model.make_cache();
  // On the device once: a host tensor would be copied (a synchronising copy) for every decoded token. The
  // reference pass has checked these ids against the vocabulary.
  const at::Tensor tokens = ref.tokens.unsqueeze(0).to(model.device());
  if (policy.needs_hindsight()) policy.set_hindsight(ref.hindsight);

  // Prefill in chunks; only the last row's logits are needed (it predicts the first decoded token).
  auto t0 = Clock::now();
  at::Tensor last_hidden;
  for (std::int64_t s = 0; s < settings.prefill_len; s += settings.chunk_size) {
    const std::int64_t n = std::min(settings.chunk_size, settings.prefill_len - s);
    last_hidden = model.forward_hidden(tokens.narrow(1, s, n), cache, hook.get())[0][-1];
  }
  totals.prefill_seconds += seconds_since(t0);
  totals.prefill_tokens += settings.prefill_len;

  // Teacher-forced decode: row p-1 predicts token p.
  std::vector<at::Tensor> rows;
  if (settings.score_from == settings.prefill_len) rows.push_back(last_hidden.unsqueeze(0));
  t0 = Clock::now();
  for (std::int64_t t = settings.prefill_len; t < T - 1; ++t) {
    const at::Tensor h = model.forward_hidden(tokens.narrow(1, t, 1), cache, hook.get())[0];
    if (t + 1 >= settings.score_from) rows.push_back(h);
  }
  totals.decode_seconds += seconds_since(t0);
  totals.decode_tokens += T - 1 - settings.prefill_len;

  const at::Tensor logprobs = at::log_softmax(model.logits(at::cat(rows, 0)), -1, at::kFloat);  // [S, V]
  const at::Tensor targets = ref.tokens.narrow(0, settings.score_from, T - settings.score_from).to(logprobs.device());
  const at::Tensor full = ref.full_logprobs;
  totals.nll += -logprobs.gather(1, targets.unsqueeze(1)).sum().item<double>();
  totals.kl += (full.exp() * (full - logprobs)).sum().item<double>();
  totals.agree += (full.argmax(-1) == logprobs.argmax(-1)).sum().item<double>();
  totals.scored += targets.size(0);
  totals.peak_kv_bytes = std::max(totals.peak_kv_bytes, hook.peak_kv_bytes());
}

}  // namespace kvbound
