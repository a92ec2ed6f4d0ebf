// Every eviction policy, one line each: KVBOUND_POLICY(NAME) names the registration `policies::NAME`
// that modules/policies/NAME.cpp defines. Adding a policy: that file and one line here.
// (No include guard: modules/policies/registry.cpp includes this list twice.)
KVBOUND_POLICY(full)
KVBOUND_POLICY(random)
KVBOUND_POLICY(streaming_llm)
KVBOUND_POLICY(h2o)
KVBOUND_POLICY(snapkv)
KVBOUND_POLICY(tova)
KVBOUND_POLICY(knorm)
KVBOUND_POLICY(keydiff)
KVBOUND_POLICY(trimkv)
KVBOUND_POLICY(indexmem)
KVBOUND_POLICY(oracle)
