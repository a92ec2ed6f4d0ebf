// One factory per policy file (modules/policies/NAME.cpp); registry.cpp maps names to them.
#pragma once
#include <memory>

#include "modules/eviction_policy.h"

namespace kvbound::policies {

std::unique_ptr<EvictionPolicy> make_full(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_random(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_streaming_llm(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_h2o(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_snapkv(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_tova(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_knorm(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_keydiff(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_trimkv(const PolicyOptions&);
std::unique_ptr<EvictionPolicy> make_indexmem(const PolicyOptions&);

}  // namespace kvbound::policies
