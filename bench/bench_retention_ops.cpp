// TRIM-KV ops on CPU: the blocked, memory-bounded kernels (ops/retention_attention.h, ops/retention_sum.h)
// against the naive ATen references. SmolLM2-like heads (B=1, Hq=9, Hkv=3, D=64, fp32). Prints JSON lines:
//   time:   forward + backward of Σ op(inputs)·w, best of `repeats`, at T=2048;
//   memory: peak bytes alive through the CPU allocator during forward + backward, above those alive before
//           (a counting wrapper installed with c10::SetCPUAllocator; deterministic, unlike RSS, which
//           glibc's reuse of freed pages hides), at T=4096 and 16384. The naive path at 16384 needs ~10 GB
//           per [B, Hq, T, T] tensor: it is not run; its line scales the T=4096 measurement by T².
// Usage: bench_retention_ops [threads=all] [repeats=3]
#include <ATen/Parallel.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/randn.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "base/process_heap.h"
#include "bench/best_time.h"
#include "ops/retention_attention.h"
#include "tests/counting_allocator.h"
#include "ops/retention_sum.h"

namespace {

using kvbound::bench::best_seconds;

constexpr int64_t kBatch = 1, kQueryHeads = 9, kKvHeads = 3, kHeadDim = 64;

struct Inputs {
  std::vector<at::Tensor> tensors;  // q, k, v, log_beta
  at::Tensor weight;                // the loss is Σ out·weight
};

Inputs make_inputs(int64_t T) {
  std::vector<at::Tensor> tensors = {
      at::randn({kBatch, kQueryHeads, T, kHeadDim}), at::randn({kBatch, kKvHeads, T, kHeadDim}),
      at::randn({kBatch, kKvHeads, T, kHeadDim}), at::log_sigmoid(at::randn({kBatch, kKvHeads, T}) * 2 + 2)};
  for (const at::Tensor& x : tensors) x.requires_grad_(true);
  return {tensors, at::randn({kBatch, kQueryHeads, T, kHeadDim})};
}

using AttentionOp = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

void forward_backward(const AttentionOp& op, const Inputs& in) {
  torch::autograd::grad({(op(in.tensors) * in.weight).sum()}, in.tensors);
}

// Peak bytes alive while `run` executes, above the bytes alive before it.
int64_t peak_extra_bytes(const std::function<void()>& run) {
  const kvbound::test::CountCpuAllocations count;
  run();
  return count.peak_bytes();
}

const AttentionOp kBlocked64 = [](const std::vector<at::Tensor>& x) {
  return kvbound::ops::retention_attention(x[0], x[1], x[2], x[3], 64, 64);
};
const AttentionOp kBlocked128 = [](const std::vector<at::Tensor>& x) {
  return kvbound::ops::retention_attention(x[0], x[1], x[2], x[3], 128, 128);
};
const AttentionOp kNaive = [](const std::vector<at::Tensor>& x) {
  return kvbound::ops::retention_attention_reference(x[0], x[1], x[2], x[3]);
};

void print_line(const char* op, const char* impl, const char* metric, int64_t T, int threads, double value,
                const char* note = nullptr) {
  std::printf(
      "{\"op\": \"%s\", \"impl\": \"%s\", \"B\": %ld, \"Hq\": %ld, \"Hkv\": %ld, \"D\": %ld, \"T\": %ld, "
      "\"threads\": %d, \"%s\": %.6g%s%s%s}\n",
      op, impl, static_cast<long>(kBatch), static_cast<long>(kQueryHeads), static_cast<long>(kKvHeads),
      static_cast<long>(kHeadDim), static_cast<long>(T), threads, metric, value, note ? ", \"note\": \"" : "",
      note ? note : "", note ? "\"" : "");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  const int threads = argc > 1 ? std::stoi(argv[1]) : at::get_num_threads();
  const int repeats = argc > 2 ? std::stoi(argv[2]) : 3;
  at::set_num_threads(threads);
  at::manual_seed(0);

  {
    const int64_t T = 2048;
    const Inputs in = make_inputs(T);
    const double blocked64 = best_seconds([&] { forward_backward(kBlocked64, in); }, repeats);
    print_line("retention_attention", "blocked64", "fwd_bwd_s", T, threads, blocked64);
    const double blocked128 = best_seconds([&] { forward_backward(kBlocked128, in); }, repeats);
    print_line("retention_attention", "blocked128", "fwd_bwd_s", T, threads, blocked128);
    const double naive = best_seconds([&] { forward_backward(kNaive, in); }, repeats);
    print_line("retention_attention", "naive", "fwd_bwd_s", T, threads, naive);
    print_line("retention_attention", "blocked64/naive", "time_ratio", T, threads, blocked64 / naive);
    print_line("retention_attention", "blocked128/naive", "time_ratio", T, threads, blocked128 / naive);

    const at::Tensor log_beta = in.tensors[3].detach().requires_grad_(true);
    const at::Tensor sum_weight = at::randn(log_beta.sizes());
    auto sum_fwd_bwd = [&](bool blocked) {
      const at::Tensor sums =
          blocked ? kvbound::ops::retention_sum(log_beta) : kvbound::ops::retention_sum_reference(log_beta);
      torch::autograd::grad({(sums * sum_weight).sum()}, {log_beta});
    };
    print_line("retention_sum", "blocked256", "fwd_bwd_s", T, threads,
               best_seconds([&] { sum_fwd_bwd(true); }, repeats));
    print_line("retention_sum", "naive", "fwd_bwd_s", T, threads, best_seconds([&] { sum_fwd_bwd(false); }, repeats));
  }

  int64_t naive_4096 = 0;
  for (const int64_t T : {4096, 16384}) {
    const Inputs in = make_inputs(T);
    const int64_t blocked = peak_extra_bytes([&] { forward_backward(kBlocked64, in); });
    print_line("retention_attention", "blocked64", "peak_extra_bytes", T, threads, static_cast<double>(blocked));
    double naive = 0;
    if (T == 4096) {
      naive_4096 = peak_extra_bytes([&] { forward_backward(kNaive, in); });
      naive = static_cast<double>(naive_4096);
      print_line("retention_attention", "naive", "peak_extra_bytes", T, threads, naive);
    } else {
      naive = static_cast<double>(naive_4096) * (T / 4096.0) * (T / 4096.0);
      print_line("retention_attention", "naive", "peak_extra_bytes", T, threads, naive,
                 "estimated: the T=4096 measurement times (T/4096)^2, not run");
    }
    print_line("retention_attention", "blocked64/naive", "memory_ratio", T, threads, blocked / naive);
  }
  return 0;
}
