// IndexMem's observation window and pooling (DESIGN.md, "IndexMem"), shared by
// ops/pooled_attention_importance.h (teacher) and ops/pooled_index_score.h (student).
//
// Ω(t), for key t of a training window of length T: the queries s with t ≤ s < T, s ≥ t + min_gap
// (min_gap ≥ 0) and, if window > 0, s ≥ T − window (the last `window` queries); window ≤ 0: every later
// query. So Ω(t) = [start(t), T) with start(t) = max(t + min_gap, window > 0 ? T − window : 0): a contiguous
// range whose start never decreases with t. A key with empty Ω(t) is "invalid": the teacher gives it 0, the student
// −inf. Pooling over Ω(t): mean, max or logsumexp.
#pragma once
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace kvbound::ops {

// The integers are the dispatcher schemas' `int pool`.
enum class PoolMode : int64_t { Mean = 0, Max = 1, LogSumExp = 2 };

inline PoolMode parse_pool_mode(const std::string& name) {
  if (name == "mean") return PoolMode::Mean;
  if (name == "max") return PoolMode::Max;
  if (name == "logsumexp") return PoolMode::LogSumExp;
  TORCH_CHECK(false, "unknown pool mode '", name, "'; expected one of: mean, max, logsumexp");
}

// The schema's int back to a PoolMode, rejecting anything else (the ops are callable from anywhere).
inline PoolMode pool_mode_from_int(int64_t pool, const char* op) {
  TORCH_CHECK(pool >= 0 && pool <= 2, op, ": pool must be 0 (mean), 1 (max) or 2 (logsumexp); got ", pool);
  return static_cast<PoolMode>(pool);
}

// Ω(t) for the kernels.
struct PoolWindow {
  int64_t T, window, min_gap;

  int64_t start(int64_t t) const { return std::max(t + min_gap, window > 0 ? T - window : int64_t{0}); }
  int64_t size(int64_t t) const { return std::max<int64_t>(T - start(t), 0); }
  // How many of the keys t0, t0 + 1, …, t0 + n − 1 have query s in their window. start(t) grows with t, so
  // they are a prefix: the kernels' tile rows are "the first `seen` columns count".
  int64_t keys_seen_by(int64_t s, int64_t t0, int64_t n) const {
    if (window > 0 && s < T - window) return 0;
    return std::clamp<int64_t>(s - min_gap - t0 + 1, 0, n);
  }
};

inline void check_window_args(const char* op, int64_t min_gap, int64_t query_block, int64_t key_block) {
  TORCH_CHECK(min_gap >= 0, op, ": min_gap must be ≥ 0; got ", min_gap);
  TORCH_CHECK(query_block > 0 && key_block > 0, op, ": block sizes must be positive; got ", query_block, " and ",
              key_block);
}

// start(t) for every key, int64 [T].
inline at::Tensor window_starts(int64_t T, int64_t window, int64_t min_gap, const at::TensorOptions& options = {}) {
  return (at::arange(T, options.dtype(at::kLong)) + min_gap).clamp_min(window > 0 ? T - window : 0);
}

// bool [T]: the keys whose Ω(t) is not empty. (With window > 0 the last query is always in the window,
// so only min_gap can empty it; the window argument is kept so callers need not know that.)
inline at::Tensor pooled_valid_keys(int64_t T, int64_t window, int64_t min_gap) {
  return window_starts(T, window, min_gap) < T;
}

// Reference pooling (plain ATen, autograd through it): x [..., T (query s), T (key t)] → [..., T], pooled over
// Ω(t) along s, `empty_value` for invalid keys. Columns of invalid keys are pooled unmasked (finite garbage
// that at::where then drops) so that no −inf − (−inf) reaches logsumexp's backward as NaN.
inline at::Tensor pool_window_reference(const at::Tensor& x, PoolMode pool, int64_t window, int64_t min_gap,
                                        double empty_value) {
  const int64_t T = x.size(-1);
  const at::Tensor start = window_starts(T, window, min_gap, x.options());
  const at::Tensor in_window = at::arange(T, x.options().dtype(at::kLong)).unsqueeze(1) >= start;  // [s, t]
  const at::Tensor valid = start < T;
  const at::Tensor excluded = in_window.logical_not() & valid;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  at::Tensor pooled;
  switch (pool) {
    case PoolMode::Mean:
      pooled = x.masked_fill(in_window.logical_not(), 0).sum(-2) / (T - start).clamp_min(1).to(x.scalar_type());
      break;
    case PoolMode::Max:
      pooled = x.masked_fill(excluded, minus_inf).amax(-2);
      break;
    case PoolMode::LogSumExp:
      pooled = x.masked_fill(excluded, minus_inf).logsumexp(-2);
      break;
  }
  return at::where(valid, pooled, empty_value);
}

// Task i of n equal-sized blocks → the block it works on: 0, n−1, 1, n−2, … . at::parallel_for hands each
// thread a contiguous range of tasks; when block cost rises or falls with its index (causal triangles), this
// order gives every range a similar mix of heavy and light blocks.
inline int64_t interleaved_block(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

}  // namespace kvbound::ops
