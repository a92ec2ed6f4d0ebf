// knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"):
// keys with a low L2 norm draw more attention, so keep the lowest norms; score = -||k||. RoPE is a
// rotation, so the norm of the cached (rotated) key equals the pre-RoPE one.
#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class Knorm final : public EvictionPolicy {
 public:
  at::Tensor score(const PolicyView& v) override {
    return -v.cache->keys(v.layer).to(at::kFloat).norm(2, {-1});
  }
};

}  // namespace

extern const PolicyRegistration knorm{
    "knorm", PolicyKind::Heuristic, "the keys with the lowest L2 norm", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules&) -> PolicyMaker {
      return [](std::uint64_t) { return std::make_unique<Knorm>(); };
    }};

}  // namespace kvbound::policies
