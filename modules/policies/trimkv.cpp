// trimkv (Bui et al., 2025, "Cache What Lasts: Token Retention for Memory-Bounded KV Cache in LLMs"): each
// token gets a retention score log β_i per KV head from the layer's trained gate when it is written; at
// step t its keep-score is (t − pos_i)·log β_i = log β_i^(t−pos_i), its exponentially decayed importance.
// No attention is needed, and the newest tokens score 0 (the maximum), so they are always kept.
#include <ATen/ops/sub.h>

#include "base/errors.h"
#include "modules/policies/registry.h"
#include "modules/policies/policy_state.h"
#include "modules/retention_gate.h"

namespace kvbound::policies {
namespace {

class TrimKV final : public EvictionPolicy {
 public:
  explicit TrimKV(std::shared_ptr<const RetentionGates> gates) : gates_(std::move(gates)) {}

  void observe(const PolicyView& v) override {
    const std::int64_t n = v.cache->size(v.layer), t = v.call->positions.size(0);
    const at::Tensor kpos = v.cache->positions(v.layer);
    at::Tensor& log_beta = log_beta_.extend(v.layer, n, kpos.to(at::kFloat));
    log_beta.narrow(-1, n - t, t).copy_(gates_->log_beta(v.layer, v.call->normed_input));
  }

  at::Tensor score(const PolicyView& v) override {
    const auto newest = static_cast<double>(v.call->start + v.call->q.size(2) - 1);
    return (newest - v.cache->positions(v.layer).to(at::kFloat)) * log_beta_.get(v.layer);
  }

  void retained(std::int64_t layer, const at::Tensor& index) override { log_beta_.gather(layer, index); }

 private:
  std::shared_ptr<const RetentionGates> gates_;
  PerEntryState log_beta_;
};

}  // namespace

extern const PolicyRegistration trimkv{
    "trimkv", "the tokens with the highest decayed retention (t - pos)·log β from trained gates", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules& modules) -> PolicyMaker {
      std::shared_ptr<const RetentionGates> gates = modules.find<RetentionGates>();
      if (!gates) fail("config", "trimkv.gates", "policy trimkv needs a gates file (kvbound export RUN_DIR --out FILE)");
      return [gates](std::uint64_t) { return std::make_unique<TrimKV>(gates); };
    }};

}  // namespace kvbound::policies
