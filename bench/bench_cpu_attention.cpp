// A CPU prefill attention kernel against its peer in the same run: `tiles` (ops/causal_attention_cpu.h; bfloat16,
// or float32 as bf16x3) or `sgemm` (ops/causal_attention_float32.h; float32 on the BLAS sgemm, bfloat16 inputs widened to it), each against
// SDPA's CPU flash kernel with GQA in the same dtype (what the backbone calls otherwise, and what transformers
// calls): one layer's causal attention of a chunk of T queries over `cached` + T keys, Hq query heads over Hkv KV
// heads, head dim D, the best of `repeats` timings of `layers` calls. Prints one JSON line with both times, their
// ratio and the largest difference between the two outputs.
#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/cat.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "bench/best_time.h"
#include "ops/causal_attention_cpu.h"
#include "ops/causal_attention_float32.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: bench_cpu_attention T [cached=0] [threads=2] [Hq=9] [Hkv=3] [D=64] [layers=30] [repeats=7] [dtype=bfloat16] [kernel=tiles|sgemm]\n"
                 "  (defaults: SmolLM2-135M's attention at the forward benchmark's T = 512)\n";
    return 2;
  }
  const long T = std::stol(argv[1]);
  const long cached = argc > 2 ? std::stol(argv[2]) : 0;
  const int threads = argc > 3 ? std::stoi(argv[3]) : 2;
  const long Hq = argc > 4 ? std::stol(argv[4]) : 9, Hkv = argc > 5 ? std::stol(argv[5]) : 3;
  const long D = argc > 6 ? std::stol(argv[6]) : 64;
  const int layers = argc > 7 ? std::stoi(argv[7]) : 30, repeats = argc > 8 ? std::stoi(argv[8]) : 7;
  const std::string dtype_name = argc > 9 ? argv[9] : "bfloat16";
  if (dtype_name != "bfloat16" && dtype_name != "float32") {
    std::cerr << "bench_cpu_attention: dtype '" << dtype_name << "' (bfloat16, float32)\n";
    return 2;
  }
  const at::ScalarType dtype = dtype_name == "float32" ? at::kFloat : at::kBFloat16;
  const std::string kernel = argc > 10 ? argv[10] : "tiles";
  if (kernel != "tiles" && kernel != "sgemm") {
    std::cerr << "bench_cpu_attention: kernel '" << kernel << "' (tiles, sgemm)\n";
    return 2;
  }
  at::set_num_threads(threads);
  const c10::InferenceMode no_autograd;
  at::manual_seed(0);
  const long N = cached + T;
  const at::Tensor q = at::randn({1, Hq, T, D}).to(dtype);
  const at::Tensor k = at::randn({1, Hkv, N, D}).to(dtype), v = at::randn({1, Hkv, N, D}).to(dtype);
  const bool sgemm = kernel == "sgemm";
  if (!(sgemm ? kvbound::ops::causal_attention_float32_supported(q, k, v) : kvbound::ops::causal_attention_cpu_supported(q, k, v))) {
    std::cerr << "bench_cpu_attention: the " << kernel << " kernel does not take these inputs on this CPU ("
              << (sgemm ? "ops/causal_attention_float32.h" : "ops/causal_attention_cpu.h") << ")\n";
    return 1;
  }
  const auto attend = [&] {
    return sgemm ? kvbound::ops::causal_attention_float32(q, k, v, nullptr) : kvbound::ops::causal_attention_cpu(q, k, v, nullptr);
  };
  // The backbone's SDPA call: plain causal for a first chunk, the cache + causal mask after cached keys.
  std::optional<at::Tensor> mask;
  if (cached > 0) mask = at::cat({at::ones({T, cached}, at::kBool), at::ones({T, T}, at::kBool).tril()}, 1);
  auto sdpa = [&] { return at::scaled_dot_product_attention(q, k, v, mask, 0.0, cached == 0, std::nullopt, Hq != Hkv); };
  const double ours = kvbound::bench::best_seconds([&] { for (int l = 0; l < layers; ++l) attend(); }, repeats);
  const double peer = kvbound::bench::best_seconds([&] { for (int l = 0; l < layers; ++l) sdpa(); }, repeats);
  const double diff = (attend().to(at::kFloat) - sdpa().to(at::kFloat)).abs().max().item<double>();
  std::printf("{\"bench\": \"cpu_attention\", \"kernel\": \"%s\", \"dtype\": \"%s\", \"T\": %ld, \"cached\": %ld, \"Hq\": %ld, \"Hkv\": %ld, \"D\": %ld, "
              "\"layers\": %d, \"threads\": %d, \"kvbound_s\": %.5f, \"sdpa_s\": %.5f, \"ratio\": %.3f, "
              "\"max_abs_diff\": %.3g}\n",
              kernel.c_str(), dtype_name.c_str(), T, cached, Hq, Hkv, D, layers, threads, ours, peer, peer / ours, diff);
}
