// full: the unbounded cache every budgeted policy is measured against; nothing is ever evicted.
#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class Full final : public EvictionPolicy {
 public:
  bool bounded() const override { return false; }
  at::Tensor score(const PolicyView& view) override { return view.cache->positions(view.layer).to(at::kFloat); }
};

}  // namespace

extern const PolicyRegistration full{
    "full", PolicyKind::Reference, "every token (the unbounded reference)", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules&) -> PolicyMaker {
      return [](std::uint64_t) { return std::make_unique<Full>(); };
    }};

}  // namespace kvbound::policies
