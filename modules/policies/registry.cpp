#include "modules/policies/registry.h"

#include <functional>
#include <map>

#include "checkpoints/errors.h"
#include "modules/policies/policy_factories.h"

namespace kvbound {
namespace {

using Factory = std::function<std::unique_ptr<EvictionPolicy>(const PolicyOptions&)>;

const std::map<std::string, Factory>& registry() {
  static const std::map<std::string, Factory> all = {
      {"full", policies::make_full},
      {"random", policies::make_random},
      {"streaming_llm", policies::make_streaming_llm},
      {"h2o", policies::make_h2o},
      {"snapkv", policies::make_snapkv},
      {"tova", policies::make_tova},
      {"knorm", policies::make_knorm},
      {"keydiff", policies::make_keydiff},
      {"trimkv", policies::make_trimkv},
      {"indexmem", policies::make_indexmem},
  };
  return all;
}

}  // namespace

std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, const PolicyOptions& options) {
  // "<policy>+mem" is the base policy carrying the latent memory: the engine's hook, not the scores, uses it.
  const std::string suffix = "+mem";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string base = name.substr(0, name.size() - suffix.size());
    const auto own = options.memory_for.find(base);
    const std::shared_ptr<const LatentMemory>& memory = own != options.memory_for.end() ? own->second : options.memory;
    if (!memory)
      fail("config", "memory.weights",
           "policy " + name + " needs trained latent memory weights (set memory.weights or memory.weights_for)");
    auto policy = make_policy(base, options);
    policy->attach_memory(memory);
    return policy;
  }
  const auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (const auto& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
    fail("policy", name, "unknown policy (known: " + known + ")");
  }
  return it->second(options);
}

std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : registry()) names.push_back(name);
  return names;
}

}  // namespace kvbound
