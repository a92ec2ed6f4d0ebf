// h2o (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs"):
// a token's score is the attention it has received, summed over every query that saw it and over the
// query heads of its KV group, divided by the number of (query, head) pairs that saw it — the mean
// received attention, so old tokens are not favoured just for having been seen more often. The
// `recent` newest tokens are always kept (H2O's local window).

#include "modules/policies/policy_factories.h"
#include "modules/policies/policy_state.h"

namespace kvbound::policies {
namespace {

class H2O final : public EvictionPolicy {
 public:
  explicit H2O(std::int64_t recent) : recent_(recent) {}
  bool needs_attention() const override { return true; }

  void observe(const PolicyView& v) override {
    const at::Tensor kpos = v.cache->positions(v.layer);  // [B, Hkv, N]
    const at::Tensor qpos = v.call->positions;            // [T]
    const std::int64_t n = kpos.size(-1), group = v.probs.size(2);
    at::Tensor& received = received_.extend(v.layer, n, kpos.to(at::kDouble));
    at::Tensor& seen = seen_.extend(v.layer, n, kpos.to(at::kDouble));
    received = received + v.probs.sum({2, 3}).to(at::kDouble);
    seen = seen + (kpos.unsqueeze(-1) <= qpos.view({1, 1, 1, -1})).sum(-1).to(at::kDouble) * group;
  }

  at::Tensor score(const PolicyView& v) override {
    const at::Tensor mean = received_.get(v.layer) / seen_.get(v.layer).clamp_min(1);
    return protect_recent(mean, v.cache->positions(v.layer), v.call->positions[-1].item<std::int64_t>(), recent_);
  }

  void retained(std::int64_t layer, const at::Tensor& index) override {
    received_.gather(layer, index);
    seen_.gather(layer, index);
  }

 private:
  std::int64_t recent_;
  PerEntryState received_, seen_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_h2o(const PolicyOptions& o) { return std::make_unique<H2O>(o.recent); }

}  // namespace kvbound::policies
