// random: keeps a uniformly random subset, redrawn at every eviction (the floor any policy must beat).
// Seeded, so a run is reproducible.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/rand.h>

#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class Random final : public EvictionPolicy {
 public:
  explicit Random(std::uint64_t seed) : generator_(at::detail::createCPUGenerator(seed)) {}
  at::Tensor score(const PolicyView& view) override {
    // Drawn on the CPU (one generator, the same draws on every device), then moved to the cache's device from
    // pinned memory without blocking: a copy from pageable memory would make the host wait at every eviction.
    const at::Tensor positions = view.cache->positions(view.layer);
    const at::Tensor draws = at::rand(positions.sizes(), generator_, at::TensorOptions().dtype(at::kFloat));
    if (positions.is_cpu()) return draws;
    return draws.pin_memory().to(positions.device(), /*non_blocking=*/true);
  }

 private:
  at::Generator generator_;
};

}  // namespace

extern const PolicyRegistration random{
    "random", PolicyKind::Heuristic, "a uniformly random subset, redrawn at every eviction", [](ConfigSchema&) {},
    [](const Config&, const TrainedModules&) -> PolicyMaker {
      return [](std::uint64_t seed) { return std::make_unique<Random>(seed); };
    }};

}  // namespace kvbound::policies
