// IndexMem ops on CPU: the blocked, memory-bounded kernels (ops/pooled_attention_importance.h,
// ops/pooled_index_score.h; for the index score with mean pooling and identity, its suffix-sum form) against the
// naive ATen references. SmolLM2-like heads: B=1, Hq=9, Hkv=3, D=64,
// index dim 32 with one index key per KV head (Hk=3), fp32. Prints two tables:
//   time:   teacher forward; index score forward + backward of Σ z·weight over valid keys; best of `repeats`
//           at T=2048, for every pool, window all (the most work: every later query) and 32 (the default);
//   memory: peak bytes alive through the CPU allocator above those alive before (a counting wrapper
//           installed with c10::SetCPUAllocator; deterministic, unlike RSS), default config (mean, window 32,
//           identity; the blocked paths' memory does not depend on the window), T = 4096, 16384, 32768. The naive
//           path runs at 4096, and at 16384 only if its T²-scaled estimate fits in half the machine's memory;
//           otherwise the row is that estimate, marked "est.".
// Usage: bench_pooled_ops [threads=all] [repeats=3]
#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/where.h>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "base/process_heap.h"
#include "bench/best_time.h"
#include "ops/pooled_attention_importance.h"
#include "ops/pooled_index_score.h"
#include "tests/counting_allocator.h"

namespace {

using kvbound::bench::best_seconds;

using kvbound::ops::PoolMode;
constexpr int64_t kBatch = 1, kQueryHeads = 9, kKvHeads = 3, kHeadDim = 64, kIndexDim = 32;

struct Inputs {
  at::Tensor q, k;                // teacher: backbone queries and keys
  std::vector<at::Tensor> index;  // student: qI, kI, w (require grad)
  at::Tensor weight;              // the student's loss is Σ_valid z·weight
};

Inputs make_inputs(int64_t T) {
  std::vector<at::Tensor> index = {at::randn({kBatch, kQueryHeads, T, kIndexDim}),
                                   at::randn({kBatch, kKvHeads, T, kIndexDim}),
                                   at::sigmoid(at::randn({kBatch, kQueryHeads, T}))};
  for (const at::Tensor& x : index) x.requires_grad_(true);
  return {at::randn({kBatch, kQueryHeads, T, kHeadDim}), at::randn({kBatch, kKvHeads, T, kHeadDim}), index,
          at::randn({kBatch, kKvHeads, T})};
}

struct Config {
  PoolMode pool;
  int64_t window;
  bool relu;
};

void teacher(const Inputs& in, const Config& c, bool blocked) {
  if (blocked) {
    kvbound::ops::pooled_attention_importance(in.q, in.k, c.pool, c.window, 0);
  } else {
    kvbound::ops::pooled_attention_importance_reference(in.q, in.k, c.pool, c.window, 0);
  }
}

void student(const Inputs& in, const Config& c, bool blocked) {
  const std::vector<at::Tensor>& x = in.index;
  const at::Tensor z = blocked
                           ? kvbound::ops::pooled_index_score(x[0], x[1], x[2], c.pool, c.window, 0, c.relu)
                           : kvbound::ops::pooled_index_score_reference(x[0], x[1], x[2], c.pool, c.window, 0, c.relu);
  const at::Tensor valid = kvbound::ops::pooled_valid_keys(z.size(-1), c.window, 0);
  torch::autograd::grad({(at::where(valid, z, 0.0) * in.weight).sum()}, x);
}

int64_t peak_extra_bytes(const std::function<void()>& run) {
  const kvbound::test::CountCpuAllocations count;
  run();
  return count.peak_bytes();
}

const char* name_of(PoolMode pool) {
  return pool == PoolMode::Mean ? "mean" : pool == PoolMode::Max ? "max" : "logsumexp";
}
std::string window_name(int64_t window) { return window > 0 ? std::to_string(window) : "all"; }
double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

}  // namespace

int main(int argc, char** argv) {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  const int threads = argc > 1 ? std::stoi(argv[1]) : at::get_num_threads();
  const int repeats = argc > 2 ? std::stoi(argv[2]) : 3;
  at::set_num_threads(threads);
  at::manual_seed(0);
  std::printf("B=%ld Hq=%ld Hkv=Hk=%ld D=%ld dI=%ld fp32, min_gap 0, %d threads\n\n", static_cast<long>(kBatch),
              static_cast<long>(kQueryHeads), static_cast<long>(kKvHeads), static_cast<long>(kHeadDim),
              static_cast<long>(kIndexDim), threads);

  {
    const int64_t T = 2048;
    const Inputs in = make_inputs(T);
    std::printf("time at T=%ld, best of %d (teacher: forward; index score: forward + backward)\n", static_cast<long>(T),
                repeats);
    std::printf("%-28s %-9s %-6s %-8s %10s %10s %14s\n", "op", "pool", "window", "act", "blocked_s", "naive_s",
                "blocked/naive");
    for (const bool is_teacher : {true, false}) {
      std::vector<Config> configs;
      for (const int64_t window : {0, 32})
        for (const PoolMode pool : {PoolMode::Mean, PoolMode::Max, PoolMode::LogSumExp})
          configs.push_back({pool, window, false});
      if (!is_teacher) configs.push_back({PoolMode::Mean, 0, true});
      for (const Config& c : configs) {
        auto run = [&](bool blocked) { return [&, blocked] { (is_teacher ? teacher : student)(in, c, blocked); }; };
        const double blocked = best_seconds(run(true), repeats), naive = best_seconds(run(false), repeats);
        std::printf("%-28s %-9s %-6s %-8s %10.4f %10.4f %14.3f\n",
                    is_teacher ? "pooled_attention_importance" : "pooled_index_score", name_of(c.pool),
                    window_name(c.window).c_str(),
                    is_teacher ? "-"
                    : c.relu   ? "relu"
                               : "identity",
                    blocked, naive, blocked / naive);
        std::fflush(stdout);
      }
    }
  }

  const double half_memory = 0.5 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
  const Config default_config{PoolMode::Mean, 32, false};
  std::printf("\npeak extra memory (mean, window 32, identity)\n");
  std::printf("%-28s %6s %12s %12s %14s  %s\n", "op", "T", "blocked_MiB", "naive_MiB", "blocked/naive", "naive");
  for (const bool is_teacher : {true, false}) {
    const auto op = is_teacher ? teacher : student;
    double naive_4096 = 0;
    for (const int64_t T : {4096, 16384, 32768}) {
      const Inputs in = make_inputs(T);
      const double blocked = static_cast<double>(peak_extra_bytes([&] { op(in, default_config, true); }));
      double naive = naive_4096 * (T / 4096.0) * (T / 4096.0);
      const bool measure = T == 4096 || (T == 16384 && naive < half_memory);
      if (measure) naive = static_cast<double>(peak_extra_bytes([&] { op(in, default_config, false); }));
      if (T == 4096) naive_4096 = naive;
      std::printf("%-28s %6ld %12.2f %12.1f %14.2e  %s\n",
                  is_teacher ? "pooled_attention_importance" : "pooled_index_score", static_cast<long>(T), mib(blocked),
                  mib(naive), blocked / naive, measure ? "measured" : "est. (T=4096 x (T/4096)^2)");
      std::fflush(stdout);
    }
  }
  return 0;
}
