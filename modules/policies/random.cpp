// random: keeps a uniformly random subset, redrawn at every eviction (the floor any policy must beat).
// Seeded, so a run is reproducible.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/rand.h>

#include "modules/policies/policy_factories.h"

namespace kvbound::policies {
namespace {

class Random final : public EvictionPolicy {
 public:
  explicit Random(std::uint64_t seed) : generator_(at::detail::createCPUGenerator(seed)) {}
  at::Tensor score(const PolicyView& view) override {
    return at::rand(view.cache->positions(view.layer).sizes(), generator_, at::TensorOptions().dtype(at::kFloat));
  }

 private:
  at::Generator generator_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_random(const PolicyOptions& o) { return std::make_unique<Random>(o.seed); }

}  // namespace kvbound::policies
