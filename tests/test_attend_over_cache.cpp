// attend_over_cache, the backbone's one attention path: the row logsumexp it hands a hook that asks for it.
// In kvbound_device_tests so the GPU machine runs the CUDA branch too (scripts/gpu_check.sh).
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "modules/backbone.h"
#include "modules/kv_cache.h"
#include "ops/cuda_module.h"

using namespace kvbound;

namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// A hook that asks for the logsumexp gets it from the attention pass (the CPU's flash kernel) or formed apart
// (other devices) — either way SDPA's output unchanged and the logsumexp of exactly the entries each query
// attended: a first chunk (causal), a chunk after cached entries (cache + causal) and a single token (all),
// GQA (6 query heads over 2 KV heads), float32 and bfloat16, checked against the float64 formula.
TEST(AttendOverCache, HandsOutTheLogsumexpOfWhatEachQueryAttended) {
  std::vector<c10::Device> devices{c10::kCPU};
  if (load_cuda_kernels() && at::hasCUDA()) devices.emplace_back(c10::kCUDA);  // loading brings libtorch_cuda
  for (const c10::Device device : devices) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const auto opts = at::TensorOptions().dtype(dtype).device(device);
      const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
      KVCache plain(1), asking(1);
      std::int64_t start = 0;
      for (const std::int64_t T : {5, 3, 1}) {
        AttentionCall call;
        call.q = at::randn({2, 6, T, 16}, opts);
        call.k = at::randn({2, 2, T, 16}, opts);
        call.v = at::randn({2, 2, T, 16}, opts);
        call.positions = at::arange(start, start + T, at::TensorOptions().dtype(at::kLong).device(device));
        AttentionCall with_lse = call;
        with_lse.wants_logsumexp = true;
        attend_over_cache(call, plain, nullptr);
        attend_over_cache(with_lse, asking, nullptr);
        const std::string where = std::string(device.str()) + " " + std::string(c10::toString(dtype)) + " T=" + std::to_string(T);
        EXPECT_FALSE(call.logsumexp.defined()) << where;  // nobody asked
        if (device.is_cpu())  // the very kernel SDPA runs: bit-identical, or SDPA picked another path
          EXPECT_TRUE(at::equal(with_lse.output, call.output)) << where;
        else
          EXPECT_LE(max_abs_diff(with_lse.output.to(at::kFloat), call.output.to(at::kFloat)), tol) << where;

        const std::int64_t N = start + T;
        const at::Tensor keys = asking.keys(0).to(at::kDouble).repeat_interleave(3, 1);  // [2, 6, N, 16]
        at::Tensor scores = at::matmul(call.q.to(at::kDouble), keys.transpose(-1, -2)) / 4.0;  // [2, 6, T, N]
        for (std::int64_t t = 0; t < T; ++t) scores.narrow(2, t, 1).narrow(3, start + t + 1, N - start - t - 1).fill_(-INFINITY);
        const at::Tensor want = at::logsumexp(scores, -1, true);
        ASSERT_TRUE(with_lse.logsumexp.defined()) << where;
        EXPECT_EQ(with_lse.logsumexp.scalar_type(), at::kFloat) << where;
        EXPECT_EQ(with_lse.logsumexp.sizes(), want.sizes()) << where;
        EXPECT_LE(max_abs_diff(with_lse.logsumexp.to(at::kDouble), want), 1e-5) << where;  // q, k are exact in the dtype
        plain.advance(T);
        asking.advance(T);
        start += T;
      }
    }
  }
}

}  // namespace
