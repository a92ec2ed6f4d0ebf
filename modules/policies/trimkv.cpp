// trimkv (Bui et al., 2025, "Cache What Lasts: Token Retention for Memory-Bounded KV Cache in LLMs"): each
// token gets a retention score log β_i per KV head from the layer's trained gate when it is written; at
// step t its keep-score is (t + o − pos_i)·log β_i = log β_i^(t+o−pos_i), its exponentially decayed importance.
// No attention is needed, and the newest tokens score highest, so they are kept.
//
// Options, each matching a rule of the official TrimKVCache (trimkv 0.1.5, cache_utils.py) so that gates
// trained here evict the same tokens there:
// - trimkv.score_offset o: kvbound's 0 scores the age since the newest token; the official cache scores
//   (seen_tokens + 1 − pos) = (t + 2 − pos), o = 2.
// - trimkv.cut: `exceeds` cuts a layer holding more than M + buffer entries (kvbound); `reaches` cuts it
//   at M + buffer or more (the official cache with buffer_size = buffer).
// - trimkv.lookahead n > 1: the expected retention over the next n steps instead of the current weight,
//   Σ_{k=1..n} β^(a+k) = β^(a+1)·(1 − β^n)/(1 − β) with a = t + o − pos, in logs as the official
//   compute_log_G does it (positive round-off of n·log β and log β clamped to −1e-9).
// - trimkv.sliding_window w: the w newest cached entries are always kept.
// And two rules of kvbound's own, not in the official cache: trimkv.sinks s keeps positions 0..s−1 (the
// attention sinks StreamingLLM keeps) whatever their gates say; trimkv.attention_weight α > 0 adds α·log of the
// entry's mean received attention (h2o's statistic) to its keep-score, ranking by β^(t+o−pos)·attention^α: the
// gate's prediction from the token itself weighed with the evidence of what the queries so far attended.
// trimkv.gated_read changes how the kept entries are read rather than which are kept: each query's logit of entry i
// gets (pos_q − pos_i)·log β_i added, the retention-gated attention the gates were trained under (the official
// package's rg_attn_flex with kv_positions), instead of plain attention over what is left.
// trimkv.budget_scope model is the official DynamicBudgetTrimKVCache (without its min_tokens_per_head): the scores
// are log retention weights in every layer and head alike, so one top-L·Hkv·M over all of them is meaningful.
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/expm1.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log1p.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <limits>

#include "base/errors.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"
#include "modules/policies/policy_state.h"
#include "modules/retention_gate.h"

namespace kvbound::policies {
namespace {

struct TrimKVOptions {
  std::int64_t score_offset = 0;
  bool cut_when_reached = false;
  std::int64_t lookahead = 1;
  std::int64_t sliding_window = 0;
  std::int64_t sinks = 0;
  double attention_weight = 0;
  bool gated_read = false;
  BudgetScope budget_scope = BudgetScope::Head;
};

TrimKVOptions trimkv_options(const Config& c) {
  TrimKVOptions o;
  o.score_offset = c.get_int("trimkv.score_offset");
  const std::string cut = c.get_string("trimkv.cut");
  if (cut != "exceeds" && cut != "reaches") fail("config", "trimkv.cut", "'" + cut + "' (exceeds, reaches)");
  o.cut_when_reached = cut == "reaches";
  o.lookahead = c.get_int("trimkv.lookahead");
  if (o.lookahead < 1) fail("config", "trimkv.lookahead", "must be >= 1");
  o.sliding_window = c.get_int("trimkv.sliding_window");
  if (o.sliding_window < 0) fail("config", "trimkv.sliding_window", "must be >= 0");
  o.sinks = c.get_int("trimkv.sinks");
  if (o.sinks < 0) fail("config", "trimkv.sinks", "must be >= 0");
  o.attention_weight = read_attention_weight(c, "trimkv.attention_weight");
  o.gated_read = c.get_bool("trimkv.gated_read");
  o.budget_scope = parse_budget_scope(c.get_string("trimkv.budget_scope"), "trimkv.budget_scope");
  return o;
}

// log(1 − e^x) for x <= 0, accurate on both sides of log(1/2) (the official _log1mexp).
at::Tensor log1mexp(const at::Tensor& x) {
  return at::where(x < std::log(0.5), at::log1p(-at::exp(x)), at::log(-at::expm1(x)));
}

class TrimKV final : public EvictionPolicy {
 public:
  TrimKV(std::shared_ptr<const RetentionGates> gates, const TrimKVOptions& options)
      : gates_(std::move(gates)), options_(options) {}

  std::int64_t tolerated_entries(std::int64_t budget, std::int64_t buffer) const override {
    return options_.cut_when_reached ? budget + buffer - 1 : budget + buffer;
  }

  bool needs_attention() const override { return options_.attention_weight > 0; }

  // A +mem policy writes what each head evicts, which a pooled budget does not give it: it is served per head.
  BudgetScope budget_scope() const override { return memory() ? BudgetScope::Head : options_.budget_scope; }

  at::Tensor read_log_decay(const PolicyView& v) override {
    if (!options_.gated_read) return {};
    chunk_log_beta_ = chunk_log_beta(v);
    if (v.cache->size(v.layer) == 0) return chunk_log_beta_;
    return at::cat({log_beta_.get(v.layer), chunk_log_beta_}, -1);
  }

  void observe(const PolicyView& v) override {
    if (needs_attention()) attention_.observe(v);
    const std::int64_t n = v.cache->size(v.layer), t = v.call->positions.size(0);
    const at::Tensor kpos = v.cache->positions(v.layer);
    at::Tensor& log_beta = log_beta_.extend(v.layer, n, kpos.to(at::kFloat));
    log_beta.narrow(-1, n - t, t).copy_(options_.gated_read ? chunk_log_beta_ : chunk_log_beta(v));
  }

  at::Tensor score(const PolicyView& v) override {
    const auto now = static_cast<double>(v.call->start + v.call->q.size(2) - 1 + options_.score_offset);
    const at::Tensor age = now - v.cache->positions(v.layer).to(at::kFloat);
    const at::Tensor& log_beta = log_beta_.get(v.layer);
    at::Tensor score = options_.lookahead == 1 ? age * log_beta : lookahead_score(age, log_beta);
    if (needs_attention()) score = add_attention_evidence(score, attention_, v.layer, options_.attention_weight);
    if (options_.sliding_window > 0) {
      const std::int64_t w = std::min(options_.sliding_window, score.size(-1));
      score.narrow(-1, score.size(-1) - w, w).fill_(std::numeric_limits<float>::infinity());
    }
    if (options_.sinks > 0)
      score.masked_fill_(v.cache->positions(v.layer) < options_.sinks, std::numeric_limits<float>::infinity());
    return score;
  }

  void retained(std::int64_t layer, const at::Tensor& index) override {
    log_beta_.gather(layer, index);
    if (needs_attention()) attention_.gather(layer, index);
  }

 private:
  // The chunk's log β [B, Hkv, T]; 0 (β = 1) at the sinks, as the student had them in training.
  at::Tensor chunk_log_beta(const PolicyView& v) const {
    at::Tensor log_beta = gates_->log_beta(v.layer, v.call->normed_input);
    if (options_.sinks > 0) log_beta.masked_fill_(v.call->positions.view({1, 1, -1}) < options_.sinks, 0);
    return log_beta;
  }

  at::Tensor lookahead_score(const at::Tensor& age, const at::Tensor& log_beta) const {
    const at::Tensor eps = at::full_like(log_beta, -1e-9);
    const at::Tensor steps = log_beta * static_cast<double>(options_.lookahead);
    return (age + 1) * log_beta + log1mexp(at::where(steps > 0, eps, steps)) -
           log1mexp(at::where(log_beta > 0, eps, log_beta));
  }

  std::shared_ptr<const RetentionGates> gates_;
  TrimKVOptions options_;
  PerEntryState log_beta_;
  at::Tensor chunk_log_beta_;  // gated_read: the chunk's, from read_log_decay to observe
  MeanReceivedAttention attention_;  // trimkv.attention_weight > 0 only
};

}  // namespace

extern const PolicyRegistration trimkv{
    "trimkv", PolicyKind::Learned, "the tokens with the highest decayed retention (t + offset - pos)·log β from trained gates",
    [](ConfigSchema& s) {
      s.add("trimkv.score_offset", ConfigType::Int, "0",
            "trimkv policy: score (t + offset - pos)·log β (0: kvbound; 2: the official cache)")
          .add("trimkv.cut", ConfigType::String, "exceeds",
               "trimkv policy: cut a layer holding more than M + eval.buffer entries (exceeds) or that many (reaches: "
               "the official cache)")
          .add("trimkv.lookahead", ConfigType::Int, "1",
               "trimkv policy: score by the retention expected over the next n steps (1: the current one)")
          .add("trimkv.sliding_window", ConfigType::Int, "0", "trimkv policy: the newest w cached tokens are always kept")
          .add("trimkv.sinks", ConfigType::Int, "0",
               "trimkv policy: positions 0..s-1 (attention sinks) are always kept (kvbound's rule, not the official cache's); "
               "trimkv training: the student keeps them at beta = 1")
          .add("trimkv.attention_weight", ConfigType::Float, "0",
               "trimkv policy: add this times log(mean received attention), h2o's statistic, to the keep-score (0: off; "
               "kvbound's rule, not the official cache's)")
          .add("trimkv.budget_scope", ConfigType::String, "head",
               "trimkv policy: what M bounds unless eval.budget_scope names it for every policy: head (M per layer and KV "
               "head), layer (a layer's heads share Hkv*M) or model (every head shares L*Hkv*M, the official "
               "DynamicBudgetTrimKVCache); trimkv+mem is served per head")
          .add("trimkv.gated_read", ConfigType::Bool, "false",
               "trimkv policy: read the kept entries as in training, each query's logit of entry i plus (pos_q - pos_i)·log β_i "
               "(the official rg_attn_flex with kv_positions; false: plain attention)");
    },
    [](const Config& c, const TrainedModules& modules) -> PolicyMaker {
      const TrimKVOptions options = trimkv_options(c);
      std::shared_ptr<const RetentionGates> gates = modules.find<RetentionGates>();
      if (!gates) fail("config", "trimkv.gates", "policy trimkv needs a gates file (kvbound export RUN_DIR --out FILE)");
      return [gates, options](std::uint64_t) { return std::make_unique<TrimKV>(gates, options); };
    }};

}  // namespace kvbound::policies
