// Forward throughput of the C++ backbone: one prompt of T tokens through the full model (prefill),
// repeated; prints tokens/s and the peak RSS right after loading, as one JSON line. Beside it, the time of the
// model's matrix products alone (every projection and the LM head through at::linear, same shapes, dtype and
// threads): the floor no forward built on this GEMM can go under, so a speed ratio against a peer on the same
// GEMM is bounded by the peer's time over that floor.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "base/process_heap.h"
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

// Best of `repeats` timings of the forward's matrix products alone on T rows: per layer q, k, v, o, gate, up and
// down (separate weights, as the backbone holds them), then the LM head; every layer its own random weights, so
// the weights stream from memory as in the forward. Attention, norms, RoPE and activations are left out.
double matrix_products_alone_seconds(const kvbound::ModelConfig& c, long T, at::ScalarType dtype, int repeats) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const long d = c.hidden_size, q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;
  const long inter = c.intermediate_size;
  struct LayerWeights { at::Tensor q, k, v, o, gate, up, down; };
  std::vector<LayerWeights> layers;
  for (long l = 0; l < c.num_layers; ++l)
    layers.push_back({at::randn({q_out, d}, opts), at::randn({kv_out, d}, opts), at::randn({kv_out, d}, opts),
                      at::randn({d, q_out}, opts), at::randn({inter, d}, opts), at::randn({inter, d}, opts),
                      at::randn({d, inter}, opts)});
  const at::Tensor lm_head = at::randn({c.vocab_size, d}, opts);
  const at::Tensor x = at::randn({1, T, d}, opts), attended = at::randn({1, T, q_out}, opts);
  const at::Tensor mlp_hidden = at::randn({1, T, inter}, opts);
  const auto run_once = [&] {
    for (const auto& w : layers) {
      for (const at::Tensor* weight : {&w.q, &w.k, &w.v, &w.gate, &w.up}) at::linear(x, *weight);
      at::linear(attended, w.o);
      at::linear(mlp_hidden, w.down);
    }
    at::linear(x, lm_head);
  };
  run_once();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run_once();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
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
  {
    kvbound::KVCache warm = model->make_cache();
    model->forward(tokens, warm);
  }
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    kvbound::KVCache cache = model->make_cache();
    const auto t0 = std::chrono::steady_clock::now();
    model->forward(tokens, cache);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
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
  const double products_s = matrix_products_alone_seconds(model->config(), T, dtype, repeats);
  std::printf(
      "{\"impl\": \"kvbound\", \"dtype\": \"%s\", \"compared_to_float32\": %s, \"kl_to_float32\": %.3g, "
      "\"top1_vs_float32\": %.4f, "
      "\"T\": %ld, \"threads\": %d, \"best_s\": %.4f, \"tok_s\": %.1f, \"matrix_products_alone_s\": %.4f, "
      "\"peak_rss_after_load_bytes\": %ld, \"fp32_weight_bytes\": %ld}\n",
      dtype_name.c_str(), compared_to_float32 ? "true" : "false", kl, top1, T, threads, best, T / best, products_s,
      rss_after_load, static_cast<long>(model->num_parameters() * 4));
  return 0;
}
