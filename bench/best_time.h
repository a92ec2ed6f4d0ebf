// The best of `repeats` wall-clock timings of `run`, after one untimed warm-up run (thread pool, allocator, BLAS
// buffers): the benches' one timing rule.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>

namespace kvbound::bench {

inline double best_seconds(const std::function<void()>& run, int repeats) {
  run();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace kvbound::bench
