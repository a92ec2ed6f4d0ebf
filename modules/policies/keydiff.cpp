// keydiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"): keep the keys most
// different from the rest; score = -cos(k_i, mean of the cached keys of that head).
#include <ATen/ops/cosine_similarity.h>

#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class KeyDiff final : public EvictionPolicy {
 public:
  at::Tensor score(const PolicyView& v) override {
    const at::Tensor keys = v.cache->keys(v.layer).to(at::kFloat);  // [B, Hkv, N, D]
    const at::Tensor anchor = keys.mean({2}, true);
    return -at::cosine_similarity(keys, anchor, -1, 1e-8);
  }
};

}  // namespace

extern const PolicyRegistration keydiff{
    "keydiff", PolicyKind::Heuristic, "the keys least similar to the mean key", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules&) -> PolicyMaker {
      return [](std::uint64_t) { return std::make_unique<KeyDiff>(); };
    }};

}  // namespace kvbound::policies
