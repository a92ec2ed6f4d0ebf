// Decode throughput and peak KV memory of the budgeted engine: prefill CONTEXT tokens in chunks of
// CHUNK under POLICY with BUDGET entries per layer and KV head (ignored by `full`), then decode STEPS
// tokens one by one. Prints one JSON line.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/randint.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include "modules/backbone.h"
#include "ops/cuda_module.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: bench_decode MODEL CONTEXT POLICY BUDGET [threads=2] [steps=64] [chunk=256]\n";
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  const std::string model_path = argv[1], policy_name = argv[3];
  const long context = std::stol(argv[2]), budget = std::stol(argv[4]);
  const int threads = argc > 5 ? std::stoi(argv[5]) : 2;
  const long steps = argc > 6 ? std::stol(argv[6]) : 64;
  const long chunk = argc > 7 ? std::stol(argv[7]) : 256;
  kvbound::load_cuda_kernels();
  at::set_num_threads(threads);
  const c10::InferenceMode no_autograd;
  const auto model = kvbound::Backbone::load(model_path, at::kFloat);
  auto policy = kvbound::make_policy(policy_name, kvbound::policy_config(), {});
  kvbound::BudgetedCache budgeted(*policy, budget);
  kvbound::KVCache cache = model->make_cache();
  at::manual_seed(0);
  const at::Tensor prompt = at::randint(3, model->config().vocab_size, {1, context}, at::TensorOptions().dtype(at::kLong));
  auto t0 = Clock::now();
  at::Tensor hidden;
  for (long s = 0; s < context; s += chunk) hidden = model->forward_hidden(prompt.narrow(1, s, std::min(chunk, context - s)), cache, &budgeted);
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  at::Tensor next = at::argmax(model->logits(hidden[0][-1])).view({1, 1});
  t0 = Clock::now();
  for (long i = 0; i < steps; ++i) next = at::argmax(model->forward(next, cache, &budgeted)[0][-1]).view({1, 1});
  const double decode_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf(
      "{\"policy\": \"%s\", \"budget\": %ld, \"context\": %ld, \"threads\": %d, \"prefill_tok_s\": %.1f, "
      "\"decode_tok_s\": %.2f, \"peak_kv_bytes\": %ld, \"final_kv_bytes\": %ld}\n",
      policy_name.c_str(), policy->bounded() ? budget : 0L, context, threads, context / prefill_s, steps / decode_s,
      static_cast<long>(budgeted.peak_kv_bytes()), static_cast<long>(cache.live_bytes()));
  return 0;
}
