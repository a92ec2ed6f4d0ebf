// snapkv (Li et al., 2024, "SnapKV: LLM Knows What You Are Looking for Before Generation"): the last
// `window` queries vote for the keys they attend to; votes are averaged over those queries and the
// query heads of the KV group, smoothed by a 1-D average pool of width `pool` over key positions
// (so neighbours of important tokens survive), and the window's own tokens are always kept.
// During token-by-token decode the chunk holds one query, so the policy keeps a rolling buffer of
// the last `window` queries per layer (their post-RoPE vectors and positions).
#include <ATen/ops/avg_pool1d.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>

#include <cmath>
#include <limits>
#include <vector>

#include "base/errors.h"
#include "modules/policies/registry.h"
#include "modules/policies/policy_state.h"

namespace kvbound::policies {
namespace {

class SnapKV final : public EvictionPolicy {
 public:
  SnapKV(std::int64_t window, std::int64_t pool) : window_(window), pool_(pool) {}

  void observe(const PolicyView& v) override {
    if (static_cast<std::size_t>(v.layer) >= queries_.size()) {
      queries_.resize(static_cast<std::size_t>(v.layer) + 1);
      positions_.resize(static_cast<std::size_t>(v.layer) + 1);
    }
    at::Tensor& q = queries_[static_cast<std::size_t>(v.layer)];
    at::Tensor& p = positions_[static_cast<std::size_t>(v.layer)];
    q = q.defined() ? at::cat({q, v.call->q}, 2) : v.call->q;
    p = p.defined() ? at::cat({p, v.call->positions}, 0) : v.call->positions;
    const std::int64_t keep = std::min<std::int64_t>(window_, p.size(0));
    q = q.narrow(2, q.size(2) - keep, keep);
    p = p.narrow(0, p.size(0) - keep, keep);
  }

  at::Tensor score(const PolicyView& v) override {
    const at::Tensor& q = queries_.at(static_cast<std::size_t>(v.layer));  // [B, Hq, W, D]
    const at::Tensor& qpos = positions_.at(static_cast<std::size_t>(v.layer));
    const at::Tensor keys = v.cache->keys(v.layer);                        // [B, Hkv, N, D]
    const at::Tensor kpos = v.cache->positions(v.layer);                   // [B, Hkv, N]
    const std::int64_t B = keys.size(0), Hkv = keys.size(1), N = keys.size(2), D = keys.size(3);
    const std::int64_t W = q.size(2), G = q.size(1) / Hkv;
    const at::Tensor qg = q.reshape({B, Hkv, G, W, D}).to(at::kFloat);
    at::Tensor logits = at::matmul(qg, keys.to(at::kFloat).unsqueeze(2).transpose(-1, -2)) / std::sqrt(double(D));
    const at::Tensor visible = kpos.view({B, Hkv, 1, 1, N}) <= qpos.view({1, 1, 1, W, 1});
    logits = logits.masked_fill(visible.logical_not(), -std::numeric_limits<float>::infinity());
    const at::Tensor votes = at::softmax(logits, -1).mean({2, 3});  // [B, Hkv, N]
    const at::Tensor pooled =
        at::avg_pool1d(votes.reshape({B * Hkv, 1, N}), {pool_}, {1}, {pool_ / 2}).reshape({B, Hkv, N});
    const at::Tensor in_window = kpos >= qpos[0];
    return at::where(in_window, at::full_like(pooled, std::numeric_limits<float>::infinity()), pooled);
  }

 private:
  std::int64_t window_, pool_;
  std::vector<at::Tensor> queries_, positions_;
};

}  // namespace

extern const PolicyRegistration snapkv{
    "snapkv", PolicyKind::Heuristic, "the tokens the last snapkv.window queries vote for (pooled), and the window itself",
    [](ConfigSchema& s) {
      s.add("snapkv.window", ConfigType::Int, "32", "snapkv: observation window (last queries)")
          .add("snapkv.pool", ConfigType::Int, "5", "snapkv: average-pool width over key positions (odd)");
    },
    [](const Config& c, const TrainedModules&) -> PolicyMaker {
      const std::int64_t window = c.get_int("snapkv.window"), pool = c.get_int("snapkv.pool");
      if (window < 1) fail("config", "snapkv.window", "must be >= 1");
      if (pool < 1 || pool % 2 == 0) fail("config", "snapkv.pool", "must be odd and >= 1");
      return [window, pool](std::uint64_t) { return std::make_unique<SnapKV>(window, pool); };
    }};

}  // namespace kvbound::policies
