// Forward throughput of the C++ backbone: one prompt of T tokens through the full model (prefill),
// repeated; prints tokens/s and the peak RSS right after loading, as one JSON line. Beside it, the time of the
// model's matrix products alone (bench/matrix_products.h: every projection and the LM head): the floor no
// forward on this GEMM can go under.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/randint.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "base/process_heap.h"
#include "bench/best_time.h"
#include "bench/matrix_products.h"
#include "cli/model_setup.h"
#include "modules/backbone.h"
#include "ops/cuda_module.h"

namespace {

// Peak resident set size so far (VmHWM), in bytes.
long peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6)) * 1024;
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  if (argc < 2) {
    std::cerr << "usage: bench_forward MODEL [T=512] [threads=2] [repeats=5] [dtype=float32|bfloat16]\n";
    return 2;
  }
  const std::string model_path = argv[1];
  const long T = argc > 2 ? std::stol(argv[2]) : 512;
  const int threads = argc > 3 ? std::stoi(argv[3]) : 2;
  const int repeats = argc > 4 ? std::stoi(argv[4]) : 5;
  const std::string dtype_name = argc > 5 ? argv[5] : "float32";  // printed as given: the peers' spelling
  const at::ScalarType dtype = kvbound::parse_dtype(dtype_name, "bench_forward dtype");
  kvbound::load_cuda_kernels();
  at::set_num_threads(threads);
  const c10::InferenceMode no_autograd;
  const auto model = kvbound::Backbone::load(model_path, dtype);
  const long rss_after_load = peak_rss_bytes();
  at::manual_seed(0);
  const at::Tensor tokens = at::randint(3, model->config().vocab_size, {1, T}, at::TensorOptions().dtype(at::kLong));
  const double best = kvbound::bench::best_seconds(
      [&] {
        kvbound::KVCache cache = model->make_cache();
        model->forward(tokens, cache);
      },
      repeats);
  // A lower-precision dtype is only worth its speed with its error beside it: the same tokens through the
  // float32 model, mean KL(fp32 || dtype) of the next-token distributions and the top-1 agreement.
  double kl = 0.0, top1 = 1.0;
  const bool compared_to_float32 = dtype != at::kFloat;
  if (compared_to_float32) {
    const auto reference = kvbound::Backbone::load(model_path, at::kFloat);
    kvbound::KVCache low_cache = model->make_cache(), ref_cache = reference->make_cache();
    const at::Tensor low = at::log_softmax(model->forward(tokens, low_cache).to(at::kFloat), -1);
    const at::Tensor ref = at::log_softmax(reference->forward(tokens, ref_cache).to(at::kFloat), -1);
    kl = (ref.exp() * (ref - low)).sum(-1).mean().item<double>();
    top1 = ref.argmax(-1).eq(low.argmax(-1)).to(at::kDouble).mean().item<double>();
  }
  const kvbound::bench::MatrixProducts products(model->config(), T, dtype);
  const double products_s = products.layers_forward(repeats) + products.head_logits(repeats);
  std::printf(
      "{\"impl\": \"kvbound\", \"dtype\": \"%s\", \"compared_to_float32\": %s, \"kl_to_float32\": %.3g, "
      "\"top1_vs_float32\": %.4f, "
      "\"T\": %ld, \"threads\": %d, \"best_s\": %.4f, \"tok_s\": %.1f, \"matrix_products_alone_s\": %.4f, "
      "\"peak_rss_after_load_bytes\": %ld, \"fp32_weight_bytes\": %ld}\n",
      dtype_name.c_str(), compared_to_float32 ? "true" : "false", kl, top1, T, threads, best, T / best, products_s,
      rss_after_load, static_cast<long>(model->num_parameters() * 4));
  return 0;
}
