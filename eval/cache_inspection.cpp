#include "eval/cache_inspection.h"

#include <ATen/core/grad_mode.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/topk.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "modules/budgeted_cache.h"
#include "modules/memory_cache.h"

namespace kvbound {

CacheTimeline record_cache_timeline(const Backbone& model, EvictionPolicy& policy, std::int64_t budget,
                                    const at::Tensor& tokens) {
  const at::NoGradGuard no_grad;
  const ModelConfig& c = model.config();
  CacheTimeline tl;
  tl.layers = c.num_layers;
  tl.heads = c.num_kv_heads;
  tl.tokens = tokens.size(0);
  const auto T = static_cast<std::size_t>(tl.tokens);
  tl.held.assign(static_cast<std::size_t>(tl.layers),
                 std::vector<std::vector<std::vector<bool>>>(static_cast<std::size_t>(tl.heads),
                                                             std::vector<std::vector<bool>>(T, std::vector<bool>(T, false))));
  BudgetedHook hook(policy, budget);
  KVCache cache = model.make_cache();
  for (std::size_t t = 0; t < T; ++t) {
    model.forward_hidden(tokens.narrow(0, static_cast<std::int64_t>(t), 1).view({1, 1}), cache, hook.get());
    for (std::int64_t l = 0; l < tl.layers; ++l) {
      const at::Tensor pos = cache.positions(l)[0].to(at::kCPU).contiguous();  // [Hkv, N]
      const auto p = pos.accessor<std::int64_t, 2>();
      for (std::int64_t h = 0; h < tl.heads; ++h)
        for (std::int64_t i = 0; i < pos.size(1); ++i)
          tl.held[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)][t][static_cast<std::size_t>(p[h][i])] = true;
    }
  }
  return tl;
}

at::Tensor token_log_beta(const Backbone& model, const RetentionGates& gates, const at::Tensor& tokens) {
  struct NormedInputs : AttentionHook {
    std::vector<at::Tensor> x;
    void before_attention(AttentionCall& call, KVCache&) override { x.push_back(call.normed_input); }
  };
  const at::NoGradGuard no_grad;
  NormedInputs hook;
  KVCache cache = model.make_cache();
  model.forward_hidden(tokens.view({1, -1}), cache, &hook);
  std::vector<at::Tensor> per_layer;
  for (std::size_t l = 0; l < hook.x.size(); ++l) per_layer.push_back(gates.log_beta(static_cast<std::int64_t>(l), hook.x[l])[0]);
  return at::stack(per_layer).to(at::kCPU);
}

std::vector<double> gate_layer_shares(const std::vector<at::Tensor>& log_betas, std::int64_t budget) {
  TORCH_CHECK(!log_betas.empty(), "gate_layer_shares: no windows");
  const std::int64_t L = log_betas.front().size(0), H = log_betas.front().size(1);
  std::vector<double> counts(static_cast<std::size_t>(L), 1.0);
  for (const at::Tensor& window : log_betas) {
    TORCH_CHECK(window.dim() == 3 && window.size(0) == L && window.size(1) == H, "gate_layer_shares: windows of other shapes");
    const std::int64_t T = window.size(2);
    for (const std::int64_t seen : {T / 4, T / 2, 3 * T / 4, T}) {
      if (seen <= budget) continue;  // nothing is evicted yet
      const at::Tensor age = at::arange(seen - 1, -1, -1, window.options());  // seen − 1 − pos
      const at::Tensor scores = (window.narrow(2, 0, seen) * age).reshape({-1});
      const at::Tensor kept = std::get<1>(at::topk(scores, L * H * budget)).div(H * seen, "floor");
      const at::Tensor per_layer = at::bincount(kept, {}, L).to(at::kDouble).contiguous();
      for (std::int64_t l = 0; l < L; ++l) counts[static_cast<std::size_t>(l)] += per_layer.data_ptr<double>()[l];
    }
  }
  const double mean = std::accumulate(counts.begin(), counts.end(), 0.0) / static_cast<double>(L);
  for (double& c : counts) c /= mean;
  return counts;
}

std::vector<HeadPattern> head_patterns(const CacheTimeline& tl, std::int64_t budget, const at::Tensor& log_beta) {
  std::vector<HeadPattern> out;
  const auto T = static_cast<std::size_t>(tl.tokens), M = static_cast<std::size_t>(budget);
  for (std::int64_t l = 0; l < tl.layers; ++l)
    for (std::int64_t h = 0; h < tl.heads; ++h) {
      const auto& held = tl.held[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)];
      HeadPattern p{l, h, 0, 0, std::numeric_limits<double>::quiet_NaN()};
      std::size_t steps = 0;
      for (std::size_t t = M; t < T; ++t) {  // from the first step with more tokens than the budget
        ++steps;
        p.sink_held += held[t][0] ? 1.0 : 0.0;
        std::size_t recent = 0;
        for (std::size_t i = t + 1 - M; i <= t; ++i) recent += held[t][i] ? 1 : 0;
        p.recent_share += static_cast<double>(recent) / static_cast<double>(M);
      }
      if (steps > 0) {
        p.sink_held /= static_cast<double>(steps);
        p.recent_share /= static_cast<double>(steps);
      }
      if (log_beta.defined()) p.mean_beta = log_beta[l][h].exp().mean().item<double>();
      out.push_back(p);
    }
  return out;
}

std::vector<double> token_lifetimes(const CacheTimeline& tl) {
  const auto T = static_cast<std::size_t>(tl.tokens);
  std::vector<double> life(T, 0.0);
  for (const auto& layer : tl.held)
    for (const auto& head : layer)
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t i = 0; i <= t; ++i) life[i] += head[t][i] ? 1.0 : 0.0;
  for (double& v : life) v /= static_cast<double>(tl.layers * tl.heads);
  return life;
}

}  // namespace kvbound
