// The CUDA kernels beside the naive ATen formula, same GPU, same run: retention_attention forward and
// forward + backward in bf16 with Llama-3-8B-like heads (B 1, Hq 32, Hkv 8, D 128, causal; the shapes of
// bench/peers/flex_retention_attention.py, which times FlexAttention on them), retention_sum at [4, 8, T], and
// IndexMem's pooled ops (teacher forward, student forward + backward) at T = 4K, 8K, 16K.
// Each timing is the median of 10 runs after 2 warm-ups, read from the host clock after a device barrier; the
// peak is the caching allocator's most bytes allocated at once above those allocated before. At the smallest
// T (if at most 4096: beyond, the float64 formula's T×T tensors take tens of GB) every line also carries its
// relative error ‖out − ref‖ / ‖ref‖ against the formula in float64, so a fast wrong kernel cannot pass unseen
// (a bf16 kernel should sit near the bf16 formula's own error, ~1e-3..1e-2).
// Prints JSON lines; scripts/gpu_check.sh turns them and the peer's into ratios.
// Usage: bench_cuda_ops [--only retention_attention|retention_sum|pooled] [T ...]   (T default: 1024 4096 8192;
// the lengths are retention_attention's; --only runs one group, e.g. under a profiler)
#include <ATen/Context.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/where.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "base/process_heap.h"
#include "ops/cuda_module.h"
#include "ops/pooled_attention_importance.h"
#include "ops/pooled_index_score.h"
#include "ops/retention_attention.h"
#include "ops/retention_sum.h"

namespace {

constexpr int64_t kBatch = 1, kQueryHeads = 32, kKvHeads = 8, kHeadDim = 128;

void (*device_synchronize)() = nullptr;
void (*device_memory)(long*, long*) = nullptr;

struct Timing {
  double ms = 0;
  long peak_extra_bytes = 0;
};

Timing measure(const std::function<void()>& run) {
  for (int i = 0; i < 2; ++i) run();
  device_synchronize();
  long before = 0, peak = 0;
  device_memory(&before, &peak);  // resets the peak
  std::vector<double> ms;
  for (int i = 0; i < 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    device_synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  long now = 0;
  device_memory(&now, &peak);
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], peak - before};
}

double relative_error(const at::Tensor& out, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kDouble);
  return ((out.to(at::kDouble) - r).norm() / r.norm()).item<double>();
}

void print_line(const char* op, const char* impl, const char* pass, const std::string& shape, double flops,
                const Timing& t, double error) {
  std::printf("{\"op\": \"%s\", \"impl\": \"%s\", \"pass\": \"%s\", %s, \"ms\": %.4f, \"tflops\": %.2f, "
              "\"peak_extra_mib\": %.1f",
              op, impl, pass, shape.c_str(), t.ms, flops > 0 ? flops / (t.ms * 1e-3) / 1e12 : 0.0,
              static_cast<double>(t.peak_extra_bytes) / (1 << 20));
  if (error >= 0) std::printf(", \"rel_error_vs_float64\": %.3g", error);
  std::printf("}\n");
  std::fflush(stdout);
}

using AttentionOp = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>;

void bench_attention(int64_t T, bool check) {
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor q = at::randn({kBatch, kQueryHeads, T, kHeadDim}, opts);
  const at::Tensor k = at::randn({kBatch, kKvHeads, T, kHeadDim}, opts);
  const at::Tensor v = at::randn({kBatch, kKvHeads, T, kHeadDim}, opts);
  const at::Tensor log_beta = at::log_sigmoid(at::randn({kBatch, kKvHeads, T}, opts.dtype(at::kFloat)) * 2 + 6).to(at::kBFloat16);
  const at::Tensor w = at::randn({kBatch, kQueryHeads, T, kHeadDim}, opts);
  const std::string shape = "\"B\": " + std::to_string(kBatch) + ", \"Hq\": " + std::to_string(kQueryHeads) +
                            ", \"Hkv\": " + std::to_string(kKvHeads) + ", \"D\": " + std::to_string(kHeadDim) +
                            ", \"T\": " + std::to_string(T) + ", \"dtype\": \"bfloat16\"";
  const double fwd_flops = 2.0 * kBatch * kQueryHeads * double(T) * T * kHeadDim;  // causal: half of 4·T²·D
  const AttentionOp kernel = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, const at::Tensor& d) {
    return kvbound::ops::retention_attention(a, b, c, d);
  };
  const AttentionOp naive = kvbound::ops::retention_attention_reference;

  at::Tensor ref_out;
  std::vector<at::Tensor> ref_grads;
  if (check) {  // the formula in float64: what both bf16 implementations are measured against
    std::vector<at::Tensor> x;
    for (const at::Tensor& t : {q, k, v, log_beta}) x.push_back(t.to(at::kDouble).requires_grad_(true));
    ref_out = naive(x[0], x[1], x[2], x[3]);
    ref_grads = torch::autograd::grad({(ref_out * w.to(at::kDouble)).sum()}, x);
    ref_out = ref_out.detach();
  }
  for (const auto& [impl, op] : {std::pair<const char*, AttentionOp>{"kernel", kernel}, {"naive", naive}}) {
    at::Tensor out;
    const Timing fwd = measure([&] {
      c10::NoGradGuard no_grad;
      out = op(q, k, v, log_beta);
    });
    print_line("retention_attention", impl, "fwd", shape, fwd_flops, fwd, check ? relative_error(out, ref_out) : -1);
    std::vector<at::Tensor> x, grads;
    for (const at::Tensor& t : {q, k, v, log_beta}) x.push_back(t.detach().requires_grad_(true));
    const Timing fwd_bwd = measure([&] { grads = torch::autograd::grad({(op(x[0], x[1], x[2], x[3]) * w).sum()}, x); });
    double worst = -1;
    if (check)
      for (std::size_t i = 0; i < grads.size(); ++i) worst = std::max(worst, relative_error(grads[i], ref_grads[i]));
    print_line("retention_attention", impl, "fwd+bwd", shape, 3.5 * fwd_flops, fwd_bwd, worst);
  }
}

void bench_retention_sum(int64_t T, bool check) {
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const at::Tensor log_beta = at::log_sigmoid(at::randn({4, 8, T}, opts) * 2 + 6);
  const std::string shape = "\"shape\": [4, 8, " + std::to_string(T) + "], \"dtype\": \"float32\"";
  const at::Tensor ref = check ? kvbound::ops::retention_sum_reference(log_beta.to(at::kDouble)) : at::Tensor();
  at::Tensor out;
  const Timing kernel = measure([&] {
    c10::NoGradGuard no_grad;
    out = kvbound::ops::retention_sum(log_beta);
  });
  print_line("retention_sum", "kernel", "fwd", shape, 0, kernel, check ? relative_error(out, ref) : -1);
  if (T > 8192) return;  // the naive [4, 8, T, T] float32 needs 137 GB at T = 32768
  const Timing naive = measure([&] {
    c10::NoGradGuard no_grad;
    out = kvbound::ops::retention_sum_reference(log_beta);
  });
  print_line("retention_sum", "naive", "fwd", shape, 0, naive, check ? relative_error(out, ref) : -1);
}

// IndexMem's pooled ops over every later query (the most work) through the dispatcher against the naive formula:
// the teacher's forward with max pooling (bf16, head dim 128: ops/pooled_importance_mma.cu), and the student's
// forward + backward (index dim 64) with max pooling and relu (forward: ops/pooled_index_score_mma.cu; backward:
// the argmax gathers of ops/pooled_ops_tiled.h) and with the default, mean pooling and identity (the suffix-sum
// form of ops/pooled_index_score.h); the pass names which.
void bench_pooled(int64_t T, bool naive_fits) {
  using kvbound::ops::PoolMode;
  const auto opts = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const std::string shape = "\"B\": 1, \"Hq\": 32, \"Hkv\": 8, \"T\": " + std::to_string(T) + ", \"dtype\": \"bfloat16\"";
  const at::Tensor q = at::randn({1, kQueryHeads, T, kHeadDim}, opts), k = at::randn({1, kKvHeads, T, kHeadDim}, opts);
  for (const bool naive : {false, true}) {
    if (naive && !naive_fits) continue;
    const Timing t = measure([&] {
      c10::NoGradGuard no_grad;
      naive ? kvbound::ops::pooled_attention_importance_reference(q, k, PoolMode::Max, 0, 0)
            : kvbound::ops::pooled_attention_importance(q, k, PoolMode::Max, 0, 0);
    });
    print_line("pooled_attention_importance", naive ? "naive" : "kernel", "fwd", shape + ", \"D\": 128", 0, t, -1);
  }
  std::vector<at::Tensor> x = {at::randn({1, kQueryHeads, T, 64}, opts), at::randn({1, kKvHeads, T, 64}, opts),
                               at::sigmoid(at::randn({1, kQueryHeads, T}, opts))};
  for (at::Tensor& t : x) t.requires_grad_(true);
  const at::Tensor weight = at::randn({1, kKvHeads, T}, opts);
  for (const auto& [pool, relu, pass] : {std::tuple{PoolMode::Max, true, "fwd+bwd max relu"},
                                         std::tuple{PoolMode::Mean, false, "fwd+bwd mean identity"}})
    for (const bool naive : {false, true}) {
      if (naive && !naive_fits) continue;
      const Timing t = measure([&] {
        const at::Tensor z = naive ? kvbound::ops::pooled_index_score_reference(x[0], x[1], x[2], pool, 0, 0, relu)
                                   : kvbound::ops::pooled_index_score(x[0], x[1], x[2], pool, 0, 0, relu);
        torch::autograd::grad({(at::where(at::isfinite(z), z, 0) * weight).sum()}, x);
      });
      print_line("pooled_index_score", naive ? "naive" : "kernel", pass, shape + ", \"dI\": 64", 0, t, -1);
    }
}

}  // namespace

int main(int argc, char** argv) {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  std::string why;
  if (!kvbound::load_cuda_kernels(&why) || !at::hasCUDA()) {
    std::fprintf(stderr, "bench_cuda_ops: needs the CUDA kernels and a CUDA device: %s\n",
                 why.empty() ? "no CUDA device" : why.c_str());
    return 2;
  }
  device_synchronize = reinterpret_cast<void (*)()>(kvbound::cuda_module_symbol("kvbound_cuda_synchronize"));
  device_memory = reinterpret_cast<void (*)(long*, long*)>(kvbound::cuda_module_symbol("kvbound_cuda_memory"));
  if (!device_synchronize || !device_memory) {
    std::fprintf(stderr, "bench_cuda_ops: the CUDA module lacks kvbound_cuda_synchronize / kvbound_cuda_memory\n");
    return 2;
  }
  std::string only;
  int first = 1;
  if (argc > 2 && std::string(argv[1]) == "--only") {
    only = argv[2];
    first = 3;
    if (only != "retention_attention" && only != "retention_sum" && only != "pooled") {
      std::fprintf(stderr, "bench_cuda_ops: --only takes retention_attention, retention_sum or pooled; got '%s'\n",
                   only.c_str());
      return 2;
    }
  }
  std::vector<int64_t> lengths;
  for (int i = first; i < argc; ++i) {
    char* end = nullptr;
    lengths.push_back(std::strtoll(argv[i], &end, 10));
    if (*end != '\0' || lengths.back() <= 0) {
      std::fprintf(stderr, "bench_cuda_ops: '%s' is not a sequence length\n", argv[i]);
      return 2;
    }
  }
  if (lengths.empty()) lengths = {1024, 4096, 8192};
  const auto runs = [&](const char* group) { return only.empty() || only == group; };
  if (runs("retention_attention"))
    for (std::size_t i = 0; i < lengths.size(); ++i) bench_attention(lengths[i], i == 0 && lengths[i] <= 4096);
  if (runs("retention_sum"))
    for (const int64_t T : {4096, 32768}) bench_retention_sum(T, T == 4096);
  if (runs("pooled"))
    for (const int64_t T : {4096, 8192, 16384}) bench_pooled(T, T <= 8192);  // naive at 16K: ~34 GB per T×T tensor
  return 0;
}
