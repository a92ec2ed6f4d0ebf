// Decode throughput and peak KV memory of the budgeted engine: prefill CONTEXT tokens in chunks of
// CHUNK under POLICY with BUDGET entries per layer and KV head (ignored by `full`), then decode STEPS
// tokens one by one, BATCH rows at once, on DEVICE in DTYPE. trimkv evicts with freshly initialised gates (a
// speed measurement: which tokens they keep does not change the work). Prints one JSON line; on CUDA the
// clock is read after a device barrier.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/randint.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "base/process_heap.h"
#include "cli/model_setup.h"
#include "modules/backbone.h"
#include "ops/cuda_module.h"
#include "ops/device.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "modules/trained_modules.h"

int main(int argc, char** argv) {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  if (argc < 5) {
    std::cerr << "usage: bench_decode MODEL CONTEXT POLICY BUDGET [threads=2] [steps=64] [chunk=256] [device=cpu] "
                 "[batch=1] [dtype=float32]\n";
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  const std::string model_path = argv[1], policy_name = argv[3];
  const long context = std::stol(argv[2]), budget = std::stol(argv[4]);
  const int threads = argc > 5 ? std::stoi(argv[5]) : 2;
  const long steps = argc > 6 ? std::stol(argv[6]) : 64;
  const long chunk = argc > 7 ? std::stol(argv[7]) : 256;
  const std::string device_name = argc > 8 ? argv[8] : "cpu";
  const long batch = argc > 9 ? std::stol(argv[9]) : 1;
  const std::string dtype_name = argc > 10 ? argv[10] : "float32";
  const c10::Device device = kvbound::resolve_device(device_name, "bench_decode device");
  const at::ScalarType dtype = kvbound::parse_dtype(dtype_name, "bench_decode dtype");
  at::set_num_threads(threads);
  void (*barrier)() = device.is_cuda() ? reinterpret_cast<void (*)()>(kvbound::cuda_module_symbol("kvbound_cuda_synchronize"))
                                       : nullptr;
  if (device.is_cuda() && !barrier) {
    std::cerr << "bench_decode: the CUDA module lacks kvbound_cuda_synchronize\n";
    return 2;
  }
  const auto now = [&] {
    if (barrier) barrier();
    return Clock::now();
  };
  const c10::InferenceMode no_autograd;
  const auto model = kvbound::Backbone::load(model_path, dtype, device);
  kvbound::TrainedModules modules;
  if (policy_name == "trimkv") {
    auto gates = std::make_shared<kvbound::RetentionGates>(
        kvbound::RetentionGates::init(model->config(), kvbound::RetentionGateSettings{}, 0));
    gates->to(device);
    modules.add<kvbound::RetentionGates>(gates);
  }
  auto policy = kvbound::make_policy(policy_name, kvbound::policy_config(), modules);
  kvbound::BudgetedCache budgeted(*policy, budget);
  kvbound::KVCache cache = model->make_cache();
  at::manual_seed(0);
  const at::Tensor prompt = at::randint(3, model->config().vocab_size, {batch, context}, at::TensorOptions().dtype(at::kLong));
  auto t0 = now();
  at::Tensor hidden;
  for (long s = 0; s < context; s += chunk) hidden = model->forward_hidden(prompt.narrow(1, s, std::min(chunk, context - s)), cache, &budgeted);
  const double prefill_s = std::chrono::duration<double>(now() - t0).count();
  at::Tensor next = at::argmax(model->logits(hidden.select(1, -1)), -1).view({batch, 1});  // greedy, on the device
  t0 = now();
  for (long i = 0; i < steps; ++i) next = at::argmax(model->forward(next, cache, &budgeted).select(1, -1), -1).view({batch, 1});
  const double decode_s = std::chrono::duration<double>(now() - t0).count();
  std::printf(
      "{\"policy\": \"%s\", \"budget\": %ld, \"context\": %ld, \"batch\": %ld, \"device\": \"%s\", "
      "\"dtype\": \"%s\", \"threads\": %d, \"prefill_tok_s\": %.1f, \"decode_tok_s\": %.2f, \"peak_kv_bytes\": %ld, "
      "\"final_kv_bytes\": %ld}\n",
      policy_name.c_str(), policy->bounded() ? budget : 0L, context, batch, device.str().c_str(), dtype_name.c_str(),
      threads, batch * context / prefill_s, batch * steps / decode_s, static_cast<long>(budgeted.peak_kv_bytes()),
      static_cast<long>(cache.live_bytes()));
  return 0;
}
