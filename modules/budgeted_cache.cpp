#include "modules/budgeted_cache.h"

#include <ATen/core/grad_mode.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

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

BudgetScope parse_budget_scope(const std::string& name, const std::string& field) {
  if (name == "head") return BudgetScope::Head;
  if (name == "layer") return BudgetScope::Layer;
  if (name == "model") return BudgetScope::Model;
  fail("config", field, "'" + name + "' (head, layer, model)");
}

BudgetedCache::BudgetedCache(EvictionPolicy& policy, std::int64_t budget, std::int64_t buffer,
                             std::vector<std::int64_t> layers, std::vector<std::int64_t> layer_budgets, BudgetScope scope)
    : policy_(policy), budget_(budget), buffer_(buffer), layers_(std::move(layers)), layer_budgets_(std::move(layer_budgets)),
      scope_(scope) {
  if (scope_ != BudgetScope::Head && (!layers_.empty() || !layer_budgets_.empty()))
    fail("config", "eval.budget_scope", "a pooled budget (layer, model) takes neither eval.budgeted_layers nor eval.layer_budget_shares");
  if (scope_ == BudgetScope::Model && policy_.pre_evicts())
    fail("config", "eval.budget_scope", "model: this policy cuts each layer before its attention; use head or layer");
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
    if (holds_to_budget(call.layer) && over_budget(call.layer, cache)) cut(view, cache);
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

  if (scope_ != BudgetScope::Head) {
    after_attention_pooled(view, cache);
    return;
  }
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

bool BudgetedCache::over_budget(std::int64_t layer, const KVCache& cache) const {
  const std::int64_t tolerated = policy_.tolerated_entries(budget_of(layer), buffer_);
  if (scope_ == BudgetScope::Head) return cache.size(layer) > tolerated;
  return cache.live_entries(layer).sum(-1).max().item<std::int64_t>() > cache.keys(layer).size(1) * tolerated;
}

void BudgetedCache::after_attention_pooled(const PolicyView& view, KVCache& cache) {
  const std::int64_t layer = view.layer;
  const at::Tensor live = cache.live_entries(layer);
  peak_entries_ = std::max(peak_entries_, live.max().item<std::int64_t>());
  if (scope_ == BudgetScope::Model) {
    // The whole cache is fullest after the last layer's attention, every layer then holding the chunk: counted
    // once per chunk there, not over every layer after each one.
    if (layer == cache.num_layers() - 1) peak_live_bytes_ = std::max(peak_live_bytes_, cache.live_bytes());
  } else {
    const at::Tensor k = cache.keys(layer);
    if (static_cast<std::size_t>(layer) >= layer_peak_bytes_.size()) layer_peak_bytes_.resize(static_cast<std::size_t>(layer) + 1, 0);
    auto& peak = layer_peak_bytes_[static_cast<std::size_t>(layer)];
    peak = std::max(peak, 2 * live.sum().item<std::int64_t>() * k.size(3) * static_cast<std::int64_t>(k.element_size()));
  }
  if (!policy_.bounded() || policy_.pre_evicts()) return;  // a pre-evicting policy was cut in before_attention
  if (scope_ == BudgetScope::Layer) {
    if (over_budget(layer, cache)) pooled_cut({layer}, {scores_of(view, cache)}, cache);
    return;
  }
  // Model: whether the chunk ends with a cut is known at layer 0, from what every layer will hold once it has
  // appended the chunk; each layer's scores are then taken after its own attention, and the cut after the last's.
  const std::int64_t L = cache.num_layers(), Hkv = cache.keys(layer).size(1);
  if (layer == 0) {
    at::Tensor held = cache.live_entries(0).sum(-1);  // [B]
    for (std::int64_t l = 1; l < L; ++l) {
      held = held + Hkv * view.call->q.size(2);
      if (cache.size(l) > 0) held = held + cache.live_entries(l).sum(-1);
    }
    model_cut_pending_ = held.max().item<std::int64_t>() > L * Hkv * policy_.tolerated_entries(budget_, buffer_);
    pending_scores_.assign(static_cast<std::size_t>(L), at::Tensor());
  }
  if (!model_cut_pending_) return;
  pending_scores_.at(static_cast<std::size_t>(layer)) = scores_of(view, cache);
  if (layer != L - 1) return;
  std::vector<std::int64_t> all(static_cast<std::size_t>(L));
  std::iota(all.begin(), all.end(), 0);
  pooled_cut(all, pending_scores_, cache);
  pending_scores_.clear();
  model_cut_pending_ = false;
}

at::Tensor BudgetedCache::scores_of(const PolicyView& view, const KVCache& cache) {
  const at::Tensor positions = cache.positions(view.layer);
  at::Tensor scores = without_grad([&] { return policy_.score(view); });
  TORCH_CHECK(scores.sizes() == positions.sizes(), "eviction policy returned scores of the wrong shape");
  if (cache.padded(view.layer)) scores = scores.masked_fill(positions >= kPaddingPosition, -std::numeric_limits<float>::infinity());
  return scores;
}

void BudgetedCache::pooled_cut(const std::vector<std::int64_t>& layers, const std::vector<at::Tensor>& scores, KVCache& cache) {
  TORCH_CHECK(!on_evict_, "a pooled budget does not feed a latent memory");
  const at::NoGradGuard no_grad;
  const std::int64_t B = scores.front().size(0), Hkv = scores.front().size(1);
  std::vector<at::Tensor> flat_scores, flat_live;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    flat_scores.push_back(scores[i].to(at::kFloat).reshape({B, -1}));
    flat_live.push_back((cache.positions(layers[i]) < kPaddingPosition).reshape({B, -1}));
  }
  const at::Tensor all = at::cat(flat_scores, 1), live = at::cat(flat_live, 1);  // [B, S]
  const std::int64_t S = all.size(1);
  const std::int64_t K = std::min<std::int64_t>(S, static_cast<std::int64_t>(layers.size()) * Hkv * budget_);
  // The top K of each row, ties to the later entry as in cut(); a padding slot is never kept.
  const at::Tensor ascending = std::get<1>(at::sort(all, /*stable=*/true, -1, /*descending=*/false));
  const at::Tensor keep = at::zeros({B, S}, live.options()).scatter_(1, ascending.narrow(1, S - K, K), true).logical_and_(live);
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::int64_t layer = layers[i], N = scores[i].size(2);
    const at::Tensor kept = keep.narrow(1, offset, Hkv * N).view({B, Hkv, N});
    offset += Hkv * N;
    const at::Tensor counts = kept.sum(-1);  // [B, Hkv]
    if (counts.eq(N).all().item<bool>()) continue;  // every entry of every head kept: nothing to cut here
    const std::int64_t width = std::max<std::int64_t>(1, counts.max().item<std::int64_t>());
    // Each head's kept entries first, in position (= index) order, then its others, which become padding.
    const at::Tensor index = at::arange(N, counts.options()).view({1, 1, N});
    const at::Tensor order = std::get<1>(at::sort(at::where(kept, index, index + N), -1)).narrow(-1, 0, width);
    const at::Tensor slot_live = at::arange(width, counts.options()).view({1, 1, width}) < counts.unsqueeze(-1);
    cache.retain(layer, order, slot_live);
    policy_.retained(layer, order);
  }
  ++evictions_;
}

void BudgetedCache::cut(const PolicyView& view, KVCache& cache) {
  if (scope_ == BudgetScope::Layer) {
    pooled_cut({view.layer}, {scores_of(view, cache)}, cache);
    return;
  }
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
  if (scope_ == BudgetScope::Model) return peak_live_bytes_;
  return std::accumulate(layer_peak_bytes_.begin(), layer_peak_bytes_.end(), std::int64_t{0});
}

}  // namespace kvbound
