// full: the unbounded cache every budgeted policy is measured against; nothing is ever evicted.
#include "modules/policies/policy_factories.h"

namespace kvbound::policies {
namespace {

class Full final : public EvictionPolicy {
 public:
  bool bounded() const override { return false; }
  at::Tensor score(const PolicyView& view) override { return view.cache->positions(view.layer).to(at::kFloat); }
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_full(const PolicyOptions&) { return std::make_unique<Full>(); }

}  // namespace kvbound::policies
