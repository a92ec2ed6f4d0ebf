// tova (Oren et al., 2024, "Transformers are Multi-State RNNs"): keep the tokens the newest query
// attends to most; score = attention of the chunk's last query, averaged over the query heads of the
// KV group.
#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class Tova final : public EvictionPolicy {
 public:
  bool needs_attention() const override { return true; }
  at::Tensor score(const PolicyView& v) override {
    return v.probs.select(3, v.probs.size(3) - 1).mean(2);  // [B, Hkv, G, T, N] -> [B, Hkv, N]
  }
};

}  // namespace

extern const PolicyRegistration tova{
    "tova", PolicyKind::Heuristic, "the tokens the newest query attends to most", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules&) -> PolicyMaker {
      return [](std::uint64_t) { return std::make_unique<Tova>(); };
    }};

}  // namespace kvbound::policies
