// h2o (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs"):
// a token's score is the attention it has received, summed over every query that saw it and over the
// query heads of its KV group, divided by the number of (query, head) pairs that saw it — the mean
// received attention, so old tokens are not favoured just for having been seen more often. The
// `recent` newest tokens are always kept (H2O's local window).

#include "base/errors.h"
#include "modules/policies/registry.h"
#include "modules/policies/policy_state.h"

namespace kvbound::policies {
namespace {

class H2O final : public EvictionPolicy {
 public:
  explicit H2O(std::int64_t recent) : recent_(recent) {}
  bool needs_attention() const override { return true; }

  void observe(const PolicyView& v) override { attention_.observe(v); }

  at::Tensor score(const PolicyView& v) override {
    return protect_recent(attention_.mean(v.layer), v.cache->positions(v.layer), v.call->start + v.call->q.size(2) - 1,
                          recent_);
  }

  void retained(std::int64_t layer, const at::Tensor& index) override { attention_.gather(layer, index); }

 private:
  std::int64_t recent_;
  MeanReceivedAttention attention_;
};

}  // namespace

extern const PolicyRegistration h2o{
    "h2o", PolicyKind::Heuristic, "the tokens with the highest mean received attention, and the h2o.recent newest",
    [](ConfigSchema& s) { s.add("h2o.recent", ConfigType::Int, "8", "h2o: most recent tokens always kept"); },
    [](const Config& c, const TrainedModules&) -> PolicyMaker {
      const std::int64_t recent = c.get_int("h2o.recent");
      if (recent < 0) fail("config", "h2o.recent", "must be >= 0");
      return [recent](std::uint64_t) { return std::make_unique<H2O>(recent); };
    }};

}  // namespace kvbound::policies
