// Helpers shared by the policies that keep per-entry state aligned with the cache.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/log.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/errors.h"
#include "modules/eviction_policy.h"

namespace kvbound::policies {

// One [B, Hkv, N] tensor per layer that follows the cache: grows (zero-filled) as chunks are appended
// at the end, and is gathered with the cache's retain index.
class PerEntryState {
 public:
  // The state of `layer` extended with zeros to `n` entries (created as zeros like `like` when new).
  at::Tensor& extend(std::int64_t layer, std::int64_t n, const at::Tensor& like) {
    if (static_cast<std::size_t>(layer) >= per_layer_.size()) per_layer_.resize(static_cast<std::size_t>(layer) + 1);
    at::Tensor& s = per_layer_[static_cast<std::size_t>(layer)];
    if (!s.defined()) s = at::zeros_like(like).narrow(-1, 0, 0);
    if (s.size(-1) < n) s = at::constant_pad_nd(s, {0, n - s.size(-1)}, 0);
    return s;
  }
  const at::Tensor& get(std::int64_t layer) const { return per_layer_.at(static_cast<std::size_t>(layer)); }
  void gather(std::int64_t layer, const at::Tensor& index) {
    at::Tensor& s = per_layer_.at(static_cast<std::size_t>(layer));
    s = at::gather(s, -1, index);
  }

 private:
  std::vector<at::Tensor> per_layer_;
};

// H2O's statistic, per layer [B, Hkv, N]: the attention each cached entry has received, summed over every query
// that saw it and over the query heads of its KV group, divided by the number of (query, head) pairs that saw
// it — its mean received attention. Fed after every chunk (PolicyView::probs), gathered with the cache.
class MeanReceivedAttention {
 public:
  void observe(const PolicyView& v) {
    const at::Tensor kpos = v.cache->positions(v.layer);  // [B, Hkv, N]
    const at::Tensor qpos = v.call->positions;            // [T]
    const std::int64_t n = kpos.size(-1), group = v.probs.size(2);
    at::Tensor& received = received_.extend(v.layer, n, kpos.to(at::kFloat));
    at::Tensor& seen = seen_.extend(v.layer, n, kpos.to(at::kFloat));
    received = received + v.probs.sum({2, 3});
    seen = seen + (kpos.unsqueeze(-1) <= qpos.view({1, 1, 1, -1})).sum(-1).to(at::kFloat) * group;
  }
  at::Tensor mean(std::int64_t layer) const { return received_.get(layer) / seen_.get(layer).clamp_min(1); }
  void gather(std::int64_t layer, const at::Tensor& index) {
    received_.gather(layer, index);
    seen_.gather(layer, index);
  }

 private:
  PerEntryState received_, seen_;
};

// score + α·log(mean received attention): a learned keep-score weighed with h2o's evidence of what the queries
// so far attended (ranking by exp(score)·attention^α). The smallest normal float keeps log finite for an entry
// no query attended (its mean is 0 only then).
inline at::Tensor add_attention_evidence(const at::Tensor& score, const MeanReceivedAttention& attention,
                                         std::int64_t layer, double alpha) {
  return score + alpha * at::log(attention.mean(layer).clamp_min(std::numeric_limits<float>::min()));
}

// The α of add_attention_evidence from its config key (trimkv.attention_weight, indexmem.attention_weight).
inline double read_attention_weight(const Config& c, const std::string& key) {
  const double alpha = c.get_float(key);
  if (!(alpha >= 0) || !std::isfinite(alpha)) fail("config", key, "must be finite and >= 0");
  return alpha;
}

// +inf for the `recent` newest positions (they are always kept), `score` elsewhere.
inline at::Tensor protect_recent(const at::Tensor& score, const at::Tensor& positions, std::int64_t newest,
                                 std::int64_t recent) {
  if (recent <= 0) return score;
  return at::where(positions > newest - recent, at::full_like(score, std::numeric_limits<double>::infinity()), score);
}

}  // namespace kvbound::policies
