// Name -> eviction policy. Each policy file (modules/policies/NAME.cpp) defines one PolicyRegistration:
// its name, what it keeps, the config keys it owns (declared with type, default and help, parsed and
// checked by the policy itself) and how to build it; modules/policies/policy_list.h lists them.
//
// "<name>+mem" is policy <name> with the latent memory that serves it attached (modules/memory_cache.h):
// TrainedModules' LatentMemory for <name>, else the one for any policy.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "modules/eviction_policy.h"
#include "modules/trained_modules.h"

namespace kvbound {

// Builds a fresh policy for one sequence (policies keep per-sequence state); `seed` drives random ones.
using PolicyMaker = std::function<std::unique_ptr<EvictionPolicy>(std::uint64_t seed)>;

// What a policy is, for the reports that set the learned policies against the heuristics they must beat.
enum class PolicyKind {
  Reference,  // keeps everything (full): what the others are measured against
  Heuristic,  // a rule from the literature, nothing trained
  Learned,    // ranks the cache with trained modules (TrainedModules)
  Hindsight,  // sees the future queries (oracle): a bound, not a deployable policy
};

struct PolicyRegistration {
  const char* name;
  PolicyKind kind;
  const char* summary;  // what it keeps, one line
  void (*declare_keys)(ConfigSchema& schema);  // the keys it owns (may declare none)
  // Reads and checks its keys (kvbound::Error naming the key) and finds the learned modules it needs
  // (kvbound::Error naming the config key that provides them); once per evaluation or training run.
  PolicyMaker (*configure)(const Config& config, const TrainedModules& modules);
};

// The registered policies, in policy_list.h's order.
const std::vector<const PolicyRegistration*>& policy_registry();
std::vector<std::string> policy_names();
// The registered policies of kind Heuristic, in registry order.
std::vector<std::string> heuristic_policy_names();
// Every policy's keys.
void declare_policy_keys(ConfigSchema& schema);
// The policy keys alone at their defaults, with "KEY=VALUE" overrides (tests and benches build policies so).
Config policy_config(const std::vector<std::string>& overrides = {});

// One policy of a run, configured once: `name` is a registered policy or "<registered>+mem".
class ConfiguredPolicy {
 public:
  // kvbound::Error "policy: NAME: unknown policy (known: ...)" for an unknown name; errors of the policy's
  // configure(); for "+mem", an error naming memory.weights when no memory serves the base policy.
  ConfiguredPolicy(const std::string& name, const Config& config, const TrainedModules& modules);

  const std::string& name() const { return name_; }
  std::unique_ptr<EvictionPolicy> make(std::uint64_t seed) const;

 private:
  std::string name_;
  PolicyMaker maker_;
  std::shared_ptr<const LatentMemory> memory_;  // "+mem" only
};

// A fresh `name` policy configured from `config` and `modules` (ConfiguredPolicy once, then make).
std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, const Config& config, const TrainedModules& modules,
                                            std::uint64_t seed = 0);

}  // namespace kvbound
