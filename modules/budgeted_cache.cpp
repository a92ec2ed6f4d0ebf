#include "modules/budgeted_cache.h"

#include <ATen/core/grad_mode.h>

#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/errors.h"

namespace kvbound {
namespace {

// Every call that has the policy observe, score or keep entries runs without autograd: its statistics and
// scores only choose entries, and no gradient flows through a choice. A forward trained end to end (the
// memory's KL) runs with gradients, and a running statistic with a graph (h2o's sum) would keep every chunk's
// graph alive.
template <typename PolicyCall>
decltype(auto) without_grad(PolicyCall&& call) {
  const at::NoGradGuard no_grad;
  return call();
}

}  // namespace

at::Tensor chunk_attention_probs(const AttentionCall& call, const KVCache& cache) {
  const at::Tensor keys = cache.keys(call.layer);       // [B, Hkv, N, D]
  const at::Tensor kpos = cache.positions(call.layer);  // [B, Hkv, N]
  const std::int64_t B = keys.size(0), Hkv = keys.size(1), N = keys.size(2), D = keys.size(3);
  const std::int64_t T = call.q.size(2), G = call.q.size(1) / Hkv;
  const at::Tensor q = call.q.reshape({B, Hkv, G, T, D}).to(at::kFloat);
  at::Tensor logits = at::matmul(q, keys.to(at::kFloat).unsqueeze(2).transpose(-1, -2)) / std::sqrt(double(D));
  const at::Tensor visible = kpos.view({B, Hkv, 1, 1, N}) <= call.positions.view({1, 1, 1, T, 1});
  logits = logits.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity());
  return at::softmax(logits, -1);
}

BudgetedCache::BudgetedCache(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer,
                             std::vector<std::int64_t> layers, std::vector<std::int64_t> layer_budgets)
    : policy_(policy), budget_(budget), buffer_(buffer), layers_(std::move(layers)), layer_budgets_(std::move(layer_budgets)) {
  if (budget < 1) fail("eval", "budget", "must be >= 1, got " + std::to_string(budget));
  if (buffer < 0) fail("eval", "buffer", "must be >= 0, got " + std::to_string(buffer));
  for (const std::int64_t layer : layers_)
    if (layer < 0) fail("eval", "budgeted_layers", "layer indices must be >= 0, got " + std::to_string(layer));
  for (const std::int64_t b : layer_budgets_)
    if (b < 1) fail("eval", "layer budgets", "every layer's budget must be >= 1, got " + std::to_string(b));
}

std::int64_t BudgetedCache::budget_of(std::int64_t layer) const {
  if (layer_budgets_.empty()) return budget_;
  TORCH_CHECK(layer < static_cast<std::int64_t>(layer_budgets_.size()), "BudgetedCache: no budget for layer ", layer, " (",
              layer_budgets_.size(), " layer budgets)");
  return layer_budgets_[static_cast<std::size_t>(layer)];
}

bool BudgetedCache::holds_to_budget(std::int64_t layer) const {
  return layers_.empty() || std::find(layers_.begin(), layers_.end(), layer) != layers_.end();
}

void BudgetedCache::before_attention(AttentionCall& call, KVCache& cache) {
  PolicyView view;
  view.layer = call.layer;
  view.call = &call;
  view.cache = &cache;  // the older entries only: the chunk is appended after this hook
  if (policy_.pre_evicts() && policy_.bounded() && cache.size(call.layer) > 0) {
    without_grad([&] { policy_.observe_before(view); });
    if (holds_to_budget(call.layer) && cache.size(call.layer) > policy_.tolerated_entries(budget_of(call.layer), buffer_))
      cut(view, cache);
  }
  call.key_log_decay = without_grad([&] { return policy_.read_log_decay(view); });
}

void BudgetedCache::after_attention(AttentionCall& call, KVCache& cache) {
  const std::int64_t layer = call.layer;
  PolicyView view;
  view.layer = layer;
  view.call = &call;
  view.cache = &cache;
  without_grad([&] {
    if (policy_.needs_attention()) view.probs = chunk_attention_probs(call, cache);
    policy_.observe(view);
  });

  const std::int64_t entries = cache.size(layer);
  peak_entries_ = std::max(peak_entries_, entries);
  if (static_cast<std::size_t>(layer) >= layer_peak_bytes_.size()) layer_peak_bytes_.resize(static_cast<std::size_t>(layer) + 1, 0);
  const at::Tensor k = cache.keys(layer);
  const std::int64_t bytes = 2 * k.numel() * static_cast<std::int64_t>(k.element_size());
  auto& peak = layer_peak_bytes_[static_cast<std::size_t>(layer)];
  peak = std::max(peak, bytes);

  const std::int64_t tolerated = policy_.tolerated_entries(budget_of(layer), buffer_);
  if (!policy_.bounded() || !holds_to_budget(layer) || entries <= tolerated) return;
  // A hook wrapping this cache must forward before_attention too, or a pre-evicting policy would never cut.
  if (policy_.pre_evicts()) {
    TORCH_CHECK(entries - call.q.size(2) <= tolerated,
                "pre-evicting policy: the cache was not cut before attention (a wrapping hook must forward before_attention)");
    return;
  }
  cut(view, cache);
}

void BudgetedCache::cut(const PolicyView& view, KVCache& cache) {
  const std::int64_t layer = view.layer, budget = budget_of(layer);
  if (cache.size(layer) <= budget) return;  // a policy tolerating fewer than M entries: nothing to evict yet
  const at::Tensor keep = without_grad([&] {
    const at::Tensor scores = policy_.score(view);
    TORCH_CHECK(scores.sizes() == cache.positions(layer).sizes(), "eviction policy returned scores of the wrong shape");
    // Top-`budget` per (batch, KV head), kept in position order. Ties go to the later entry (entries are in
    // position order): at::topk breaks ties differently on CPU and CUDA (and snapkv scores its whole window
    // +inf, so with M below the window every choice is a tie); a stable ascending sort's tail is one rule
    // on every device, and the recent entry is the one a heuristic's tie says least about.
    const at::Tensor ascending = std::get<1>(at::sort(scores, /*stable=*/true, -1, /*descending=*/false));
    return std::get<0>(at::sort(ascending.narrow(-1, scores.size(-1) - budget, budget), -1));
  });
  // The entries themselves keep their gradient: the memory write and the cut are differentiable in the values.
  if (on_evict_) on_evict_(layer, keep, cache);
  cache.retain(layer, keep);
  without_grad([&] { policy_.retained(layer, keep); });
  ++evictions_;
}

void check_layer_budget_shares(const std::vector<double>& shares, std::int64_t num_layers) {
  if (static_cast<std::int64_t>(shares.size()) != num_layers)
    fail("config", "eval.layer_budget_shares", "has " + std::to_string(shares.size()) + " shares but the model has " +
                                                   std::to_string(num_layers) + " layers");
  for (const double s : shares)
    if (!(s > 0) || !std::isfinite(s))
      fail("config", "eval.layer_budget_shares", "every share must be finite and > 0, got " + std::to_string(s));
}

std::vector<std::int64_t> apportion_budget(std::int64_t budget, const std::vector<double>& shares) {
  const auto L = static_cast<std::int64_t>(shares.size());
  if (budget < 1) fail("eval", "budget", "must be >= 1, got " + std::to_string(budget));
  check_layer_budget_shares(shares, L);
  const double total_share = std::accumulate(shares.begin(), shares.end(), 0.0);
  // Every layer first gets 1 entry; the remaining L·(M − 1) go by largest remainder of the proportional split.
  const std::int64_t spare = L * (budget - 1);
  std::vector<std::int64_t> out(shares.size(), 1);
  std::vector<std::pair<double, std::size_t>> remainders;
  std::int64_t given = 0;
  for (std::size_t l = 0; l < shares.size(); ++l) {
    const double exact = static_cast<double>(spare) * shares[l] / total_share;
    const auto whole = static_cast<std::int64_t>(std::floor(exact));
    out[l] += whole;
    given += whole;
    remainders.emplace_back(exact - static_cast<double>(whole), l);
  }
  std::stable_sort(remainders.begin(), remainders.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::size_t i = 0; given < spare; ++i, ++given) ++out[remainders[i].second];  // fewer than L are left
  return out;
}

std::int64_t BudgetedCache::peak_kv_bytes() const {
  return std::accumulate(layer_peak_bytes_.begin(), layer_peak_bytes_.end(), std::int64_t{0});
}

}  // namespace kvbound
