// Decoding on CUDA makes no host synchronisation per token: with c10's sync debug mode at "error" (any
// device-to-host copy, .item(), pageable host-to-device copy or synchronisation throws), every policy's budgeted
// decode of greedy tokens fed back on the device (through BudgetedHook, as the evaluation runs it: "+mem" writes
// and reads its latent memory) goes 12 steps past its budget. Runs where the CUDA module loads and a CUDA device exists (scripts/gpu_check.sh on the
// GPU machine); skipped elsewhere.
#include <ATen/Context.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randint.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda_available.h"
#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/memory_cache.h"
#include "modules/indexer.h"
#include "modules/latent_memory.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "modules/trained_modules.h"
#include "ops/cuda_module.h"
#include "test_env.h"

namespace kvbound {
namespace {

TEST(DecodeOnCuda, NoHostSyncPerTokenUnderAnyPolicy) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  const auto sync_debug = reinterpret_cast<void (*)(int)>(cuda_module_symbol("kvbound_cuda_sync_debug"));
  ASSERT_NE(sync_debug, nullptr) << "the CUDA module lacks kvbound_cuda_sync_debug";
  struct SyncDebugOff {
    void (*set)(int);
    ~SyncDebugOff() { set(0); }
  } restore{sync_debug};

  const c10::InferenceMode no_autograd;
  const c10::Device cuda(c10::kCUDA, 0);
  // The mode is on where ATen looks for it: a deliberate synchronisation throws.
  const at::Tensor one = at::ones({1}, at::TensorOptions().device(cuda));
  sync_debug(2);
  EXPECT_ANY_THROW(one.item<float>());
  sync_debug(0);

  const auto model = Backbone::load(test::asset("stories260K"), at::kFloat, cuda);
  const ModelConfig& c = model->config();
  auto gates = std::make_shared<RetentionGates>(RetentionGates::init(c, {16, 2.0, 0.5}, 9));
  auto indexer = std::make_shared<Indexer>(Indexer::init(c, {8, "kv", true, false, 0.5}, 9));
  auto memory = std::make_shared<LatentMemory>(LatentMemory::init(c, {}, 9));
  gates->to(cuda);
  indexer->to(cuda);
  memory->to(cuda);
  TrainedModules modules;
  modules.add<RetentionGates>(gates);
  modules.add<Indexer>(indexer);
  modules.add<LatentMemory>(memory);

  const int64_t batch = 2, context = 40, chunk = 16, budget = 24, steps = 12;
  at::manual_seed(0);
  const at::Tensor prompt = at::randint(3, c.vocab_size, {batch, context}, at::TensorOptions().dtype(at::kLong)).to(cuda);
  std::vector<std::string> names;
  for (const std::string& name : policy_names()) {
    names.push_back(name);
    if (name != "full") names.push_back(name + "+mem");
  }
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    auto policy = make_policy(name, policy_config(), modules);
    if (policy->needs_hindsight()) continue;  // the oracle is given every later query's attention beforehand
    BudgetedHook hook(*policy, budget);  // with the policy's latent memory for "+mem", as the evaluation runs it
    KVCache cache = model->make_cache();
    at::Tensor hidden;
    for (int64_t s = 0; s < context; s += chunk)
      hidden = model->forward_hidden(prompt.narrow(1, s, std::min(chunk, context - s)), cache, hook.get());
    at::Tensor next = at::argmax(model->logits(hidden.select(1, -1)), -1).view({batch, 1});
    sync_debug(2);
    try {
      for (int64_t i = 0; i < steps; ++i)
        next = at::argmax(model->forward(next, cache, hook.get()).select(1, -1), -1).view({batch, 1});
    } catch (const std::exception& e) {
      ADD_FAILURE() << "a host synchronisation while decoding: " << e.what();
    }
    sync_debug(0);
    if (policy->bounded()) EXPECT_LE(cache.size(0), budget + 1);
    if (policy->memory()) EXPECT_GT(hook.peak_kv_bytes(), hook.budgeted().peak_kv_bytes());  // the memory was written
  }
}

}  // namespace
}  // namespace kvbound
