// Forward throughput of the C++ backbone: one prompt of T tokens through the full model (prefill),
// repeated; prints tokens/s and the peak RSS right after loading, as one JSON line. Beside it, the time of the
// model's matrix products alone (bench/matrix_products.h: every projection and the LM head) on kvbound's GEMM, the
// floor no forward on that GEMM can go under, and on ATen's (a PyTorch peer's), where the two differ.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/randint.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>

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
    std::cerr << "usage: bench_forward MODEL [T=512] [threads=2] [repeats=5] [dtype=float32|bfloat16] "
                 "[products=float32|bf16x3]\n";
    return 2;
  }
  const std::string model_path = argv[1];
  const long T = argc > 2 ? std::stol(argv[2]) : 512;
  const int threads = argc > 3 ? std::stoi(argv[3]) : 2;
  const int repeats = argc > 4 ? std::stoi(argv[4]) : 5;
  const std::string dtype_name = argc > 5 ? argv[5] : "float32";  // printed as given: the peers' spelling
  const at::ScalarType dtype = kvbound::parse_dtype(dtype_name, "bench_forward dtype");
  const std::string products_name = argc > 6 ? argv[6] : "float32";
  if (products_name != "float32" && products_name != "bf16x3") {
    std::cerr << "bench_forward: products must be float32 or bf16x3\n";
    return 2;
  }
  kvbound::load_cuda_kernels();
  at::set_num_threads(threads);
  const c10::InferenceMode no_autograd;
  const auto model = kvbound::Backbone::load(model_path, dtype);
  const bool bf16x3 = products_name == "bf16x3" &&
                      model->set_float32_products(kvbound::Backbone::Float32Products::kBf16x3);
  const long rss_after_load = peak_rss_bytes();
  at::manual_seed(0);
  const at::Tensor tokens = at::randint(3, model->config().vocab_size, {1, T}, at::TensorOptions().dtype(at::kLong));
  const double best = kvbound::bench::best_seconds(
      [&] {
        kvbound::KVCache cache = model->make_cache();
        model->forward(tokens, cache);
      },
      repeats);
  // A lower-precision dtype or product is only worth its speed with its error beside it: the same tokens through
  // the float32 model with float32 products, mean KL(fp32 || this) of the next-token distributions, the top-1
  // agreement and the largest logit difference (what the golden tests bound).
  double kl = 0.0, top1 = 1.0, max_logit_diff = 0.0;
  const bool compared_to_float32 = dtype != at::kFloat || bf16x3;
  if (compared_to_float32) {
    const auto reference = kvbound::Backbone::load(model_path, at::kFloat);
    kvbound::KVCache low_cache = model->make_cache(), ref_cache = reference->make_cache();
    const at::Tensor low_logits = model->forward(tokens, low_cache).to(at::kFloat);
    const at::Tensor ref_logits = reference->forward(tokens, ref_cache);
    const at::Tensor low = at::log_softmax(low_logits, -1), ref = at::log_softmax(ref_logits, -1);
    kl = (ref.exp() * (ref - low)).sum(-1).mean().item<double>();
    top1 = ref.argmax(-1).eq(low.argmax(-1)).to(at::kDouble).mean().item<double>();
    max_logit_diff = (low_logits - ref_logits).abs().max().item<double>();
  }
  using kvbound::bench::MatrixProducts;
  const auto products_seconds = [&](MatrixProducts::Gemm gemm) {
    const MatrixProducts products(model->config(), T, dtype, gemm);
    return std::make_pair(std::string(products.gemm_name()), products.layers_forward(repeats) + products.head_logits(repeats));
  };
  const auto [gemm, products_s] = products_seconds(MatrixProducts::Gemm::kBackbone);
  const double aten_products_s = gemm == "aten" ? products_s : products_seconds(MatrixProducts::Gemm::kAten).second;
  std::printf(
      "{\"impl\": \"kvbound\", \"dtype\": \"%s\", \"products\": \"%s\", \"compared_to_float32\": %s, "
      "\"kl_to_float32\": %.3g, \"top1_vs_float32\": %.4f, \"max_logit_diff_to_float32\": %.3g, "
      "\"T\": %ld, \"threads\": %d, \"best_s\": %.4f, \"tok_s\": %.1f, \"gemm\": \"%s\", \"matrix_products_alone_s\": %.4f, "
      "\"aten_matrix_products_alone_s\": %.4f, "
      "\"peak_rss_after_load_bytes\": %ld, \"fp32_weight_bytes\": %ld}\n",
      dtype_name.c_str(), bf16x3 ? "bf16x3" : "float32", compared_to_float32 ? "true" : "false", kl, top1,
      max_logit_diff, T, threads, best, T / best, gemm.c_str(), products_s, aten_products_s,
      rss_after_load, static_cast<long>(model->num_parameters() * 4));
  return 0;
}
