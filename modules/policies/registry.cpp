#include "modules/policies/registry.h"

#include "base/errors.h"
#include "modules/latent_memory.h"

namespace kvbound {
namespace policies {
#define KVBOUND_POLICY(NAME) extern const PolicyRegistration NAME;
#include "modules/policies/policy_list.h"
#undef KVBOUND_POLICY
}  // namespace policies

namespace {

constexpr const char* kMemorySuffix = "+mem";

const PolicyRegistration* find_registration(const std::string& name) {
  for (const PolicyRegistration* r : policy_registry())
    if (name == r->name) return r;
  std::string known;
  for (const auto& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
  fail("policy", name, "unknown policy (known: " + known + "; any of them +mem)");
}

}  // namespace

const std::vector<const PolicyRegistration*>& policy_registry() {
  static const std::vector<const PolicyRegistration*> all = {
#define KVBOUND_POLICY(NAME) &policies::NAME,
#include "modules/policies/policy_list.h"
#undef KVBOUND_POLICY
  };
  return all;
}

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const PolicyRegistration* r : policy_registry()) names.emplace_back(r->name);
  return names;
}

std::vector<std::string> heuristic_policy_names() {
  std::vector<std::string> names;
  for (const PolicyRegistration* r : policy_registry())
    if (r->kind == PolicyKind::Heuristic) names.emplace_back(r->name);
  return names;
}

void declare_policy_keys(ConfigSchema& schema) {
  for (const PolicyRegistration* r : policy_registry()) r->declare_keys(schema);
}

Config policy_config(const std::vector<std::string>& overrides) {
  ConfigSchema schema;
  declare_policy_keys(schema);
  return Config::load(schema, "", overrides);
}

ConfiguredPolicy::ConfiguredPolicy(const std::string& name, const Config& config, const TrainedModules& modules)
    : name_(name) {
  const std::string suffix = kMemorySuffix;
  const bool with_memory =
      name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  const std::string base = with_memory ? name.substr(0, name.size() - suffix.size()) : name;
  maker_ = find_registration(base)->configure(config, modules);
  if (!with_memory) return;
  memory_ = modules.find<LatentMemory>(base);
  if (!memory_)
    fail("config", "memory.weights",
         "policy " + name + " needs trained latent memory weights (set memory.weights or memory.weights_for)");
  if (!maker_(0)->bounded()) fail("policy", name, "never evicts: nothing would reach the memory");
}

std::unique_ptr<EvictionPolicy> ConfiguredPolicy::make(std::uint64_t seed) const {
  std::unique_ptr<EvictionPolicy> policy = maker_(seed);
  if (memory_) policy->attach_memory(memory_);
  return policy;
}

std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, const Config& config, const TrainedModules& modules,
                                            std::uint64_t seed) {
  return ConfiguredPolicy(name, config, modules).make(seed);
}

}  // namespace kvbound
