// Name -> eviction policy. Adding a policy: one file in modules/policies/ and one line in registry.cpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "modules/eviction_policy.h"

namespace kvbound {

// Throws kvbound::Error("policy: NAME: unknown policy (known: ...)") for an unknown name. "NAME+mem" is
// NAME with options.memory attached (an error without one): see modules/memory_cache.h.
std::unique_ptr<EvictionPolicy> make_policy(const std::string& name, const PolicyOptions& options);
std::vector<std::string> policy_names();

}  // namespace kvbound
