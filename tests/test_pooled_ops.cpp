// IndexMem ops (ops/pooled_attention_importance.h, ops/pooled_index_score.h): the blocked CPU kernels against
// the naive ATen references for every pool mode, window and gap, GQA and a shared index key, T not a multiple
// of the blocks, relu on/off (values and gradients, fp32 and fp64); invalid keys; central differences in
// fp64; the memory bound measured with the counting CPU allocator; the tiled path (the ops' CUDA kernels) on the
// CPU against the same references, and on a GPU against the CPU kernels.
#include <ATen/Context.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda_available.h"
#include "ops/gathered_row_dot.h"
#include "ops/pooled_attention_importance.h"
#include "ops/pooled_index_score.h"
#include "ops/pooled_ops_tiled.h"
#include "tests/counting_allocator.h"

using namespace kvbound;
using ops::PoolMode;

namespace {

const PoolMode kPools[] = {PoolMode::Mean, PoolMode::Max, PoolMode::LogSumExp};
const char* name_of(PoolMode pool) {
  return pool == PoolMode::Mean ? "mean" : pool == PoolMode::Max ? "max" : "logsumexp";
}

// The sweep every reference comparison runs: all later queries, a window shorter and one longer than some
// T, with and without a gap; T = 1, T < block and T not a multiple of either block.
const int64_t kWindows[] = {0, 5, 32};
const int64_t kGaps[] = {0, 3};
const int64_t kLengths[] = {1, 7, 63, 130};

// Double tolerances for values that pass through ATen's exp_: on one CI machine it differed from std::exp by
// 7.7e-12 on probabilities <= 1 (by 1e-16 on ours), so 1e-12 was a coin toss there. Any real indexing, masking or
// pooling bug errs by far more than these.
constexpr double kTol64 = 1e-9, kGradTol64 = 1e-8;

double max_abs(const at::Tensor& x) { return x.numel() == 0 ? 0.0 : x.abs().max().item<double>(); }

// |a − b| ≤ tol·max(1, |b|∞) over the entries where `mask` is true (all if undefined).
void expect_close(const at::Tensor& actual, const at::Tensor& expected, double tol, const std::string& what,
                  const at::Tensor& mask = {}) {
  at::Tensor a = actual.detach().to(at::kDouble), b = expected.detach().to(at::kDouble);
  if (mask.defined()) a = a.masked_select(mask), b = b.masked_select(mask);
  EXPECT_LE(max_abs(a - b), tol * std::max(1.0, max_abs(b))) << what;
}

std::string describe(PoolMode pool, int64_t window, int64_t min_gap, int64_t T, at::ScalarType dtype) {
  return std::string(name_of(pool)) + " window=" + std::to_string(window) + " min_gap=" + std::to_string(min_gap) +
         " T=" + std::to_string(T) + " " + c10::toString(dtype);
}

at::Tensor randn(at::IntArrayRef sizes, at::ScalarType dtype) { return at::randn(sizes, at::kDouble).to(dtype); }

struct IndexInputs {
  at::Tensor qI, kI, w;
  std::vector<at::Tensor> all() const { return {qI, kI, w}; }
};

// w = sigmoid(N(0, 1)), like the indexer's head weights.
IndexInputs random_index_inputs(int64_t B, int64_t Hq, int64_t Hk, int64_t T, int64_t d, at::ScalarType dtype) {
  IndexInputs in{randn({B, Hq, T, d}, dtype), randn({B, Hk, T, d}, dtype),
                 at::sigmoid(at::randn({B, Hq, T}, at::kDouble)).to(dtype)};
  for (const at::Tensor& x : in.all()) x.requires_grad_(true);
  return in;
}

const char* const kGradNames[] = {"grad qI", "grad kI", "grad w"};

// The loss Σ z·weight over the valid keys (z is −inf elsewhere) and its gradients.
struct ValueAndGrads {
  at::Tensor z;
  std::vector<at::Tensor> grads;
};

template <typename Op>
ValueAndGrads value_and_grads(const IndexInputs& in, const at::Tensor& weight, const at::Tensor& valid, Op op) {
  const at::Tensor z = op(in);
  const at::Tensor loss = (at::where(valid, z, 0.0) * weight).sum();
  return {z.detach(), torch::autograd::grad({loss}, in.all())};
}

// The call throws a c10::Error whose message contains `text`.
template <typename Call>
void expect_error_containing(Call call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing: " << text;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(PooledWindow, ValidKeysAndPoolNames) {
  // Ω(t) = [max(t + min_gap, T − window), T): only min_gap can empty it.
  const at::Tensor valid = ops::pooled_valid_keys(10, 3, 2);
  EXPECT_EQ(valid.scalar_type(), at::kBool);
  EXPECT_TRUE(at::equal(valid, at::arange(10) < 8));
  EXPECT_TRUE(ops::pooled_valid_keys(10, 0, 0).all().item<bool>());
  EXPECT_FALSE(ops::pooled_valid_keys(10, 4, 10).any().item<bool>());
  const ops::PoolWindow omega{10, 3, 2};
  EXPECT_EQ(omega.start(0), 7);
  EXPECT_EQ(omega.start(6), 8);
  EXPECT_EQ(omega.size(8), 0);
  EXPECT_EQ(omega.keys_seen_by(6, 0, 10), 0);  // before the window
  EXPECT_EQ(omega.keys_seen_by(9, 0, 10), 8);  // keys 0..7

  EXPECT_EQ(ops::parse_pool_mode("logsumexp"), PoolMode::LogSumExp);
  expect_error_containing([] { ops::parse_pool_mode("median"); }, "'median'; expected one of: mean, max, logsumexp");
}

TEST(PooledAttentionImportance, BlockedMatchesReference) {
  at::manual_seed(1);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : kTol64;
    for (const auto& [Hq, Hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {3, 1}}) {
      for (const int64_t T : kLengths) {
        const at::Tensor q = randn({2, Hq, T, 16}, dtype), k = randn({2, Hkv, T, 16}, dtype);
        for (const PoolMode pool : kPools) {
          for (const int64_t window : kWindows) {
            for (const int64_t min_gap : kGaps) {
              const std::string what = describe(pool, window, min_gap, T, dtype) + " Hq=" + std::to_string(Hq);
              const at::Tensor expected = ops::pooled_attention_importance_reference(q, k, pool, window, min_gap);
              const at::Tensor invalid = ops::pooled_valid_keys(T, window, min_gap).logical_not();
              // Windows within one query block take the one-block path (window 5; 32 at qb 32; every T at qb
              // 1024), the others the tiled passes.
              for (const auto& [qb, kb] : std::vector<std::pair<int64_t, int64_t>>{{16, 32}, {32, 16}, {1024, 16}}) {
                const at::Tensor a = ops::pooled_attention_importance(q, k, pool, window, min_gap, qb, kb);
                EXPECT_EQ(a.scalar_type(), dtype) << what;
                EXPECT_EQ(a.sizes(), k.sizes().slice(0, 3)) << what;
                expect_close(a, expected, tol, what);
                EXPECT_TRUE(a.masked_select(invalid).eq(0).all().item<bool>()) << what << ": invalid keys not 0";
              }
            }
          }
        }
      }
    }
  }
}

TEST(PooledAttentionImportance, OneQueryWindowIsLastRowAttention) {
  // window = 1: every pool of one probability is that probability, A_h[T−1, t] averaged over the group.
  at::manual_seed(2);
  const int64_t T = 37;
  const at::Tensor q = at::randn({1, 4, T, 8}, at::kDouble), k = at::randn({1, 2, T, 8}, at::kDouble);
  const at::Tensor last =
      at::softmax(at::matmul(q.narrow(2, T - 1, 1), k.repeat_interleave(2, 1).transpose(-2, -1)) / std::sqrt(8.0), -1);
  const at::Tensor expected = last.squeeze(2).view({1, 2, 2, T}).mean(2);
  for (const PoolMode pool : {PoolMode::Mean, PoolMode::Max}) {
    expect_close(ops::pooled_attention_importance(q, k, pool, 1, 0, 8, 8), expected, kTol64, name_of(pool));
    expect_close(ops::pooled_attention_importance_reference(q, k, pool, 1, 0), expected, kTol64, name_of(pool));
  }
  // logsumexp of one probability: log exp(A) = A.
  expect_close(ops::pooled_attention_importance(q, k, PoolMode::LogSumExp, 1, 0), expected, kTol64, "logsumexp");
  // A gap at least T empties every window: all zero.
  EXPECT_TRUE(ops::pooled_attention_importance(q, k, PoolMode::Mean, 0, T).eq(0).all().item<bool>());
}

TEST(PooledAttentionImportance, NoGradientAndFloatTargetsForHalfInputs) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 4, 50, 16}).requires_grad_(true), k = at::randn({1, 2, 50, 16});
  const at::Tensor a = ops::pooled_attention_importance(q, k, PoolMode::Mean, 32, 0);
  EXPECT_FALSE(a.requires_grad());
  // bf16 inputs are computed in float32 and the targets stay float32.
  const at::Tensor half =
      ops::pooled_attention_importance(q.detach().to(at::kBFloat16), k.to(at::kBFloat16), PoolMode::Mean, 32, 0);
  EXPECT_EQ(half.scalar_type(), at::kFloat);
  expect_close(half,
               ops::pooled_attention_importance(q.detach().to(at::kBFloat16).to(at::kFloat),
                                                k.to(at::kBFloat16).to(at::kFloat), PoolMode::Mean, 32, 0),
               1e-6, "bf16");
}

// bfloat16 q and K take VDPBF16PS for the one-block path's logits where the CPU has AVX512-BF16 (and no AMX), the
// widened float32 matmul elsewhere: either way the targets of the same values' float32 computation, on the
// backbone's layout (q and K transposed views of [B, T, H, D]) at SmolLM2's heads, every pool, with a min_gap.
TEST(PooledAttentionImportance, BFloat16OneBlockPathMatchesFloat32OfTheSameValues) {
  at::manual_seed(8);
  const int64_t B = 2, Hq = 9, Hkv = 3, T = 511, D = 64;
  const at::Tensor q = at::randn({B, T, Hq, D}).to(at::kBFloat16).transpose(1, 2);
  const at::Tensor k = at::randn({B, T, Hkv, D}).to(at::kBFloat16).transpose(1, 2);
  for (const PoolMode pool : kPools) {
    for (const int64_t min_gap : {int64_t{0}, int64_t{3}}) {
      const std::string what = describe(pool, 32, min_gap, T, at::kBFloat16);
      const at::Tensor a = ops::pooled_attention_importance(q, k, pool, 32, min_gap);
      EXPECT_EQ(a.scalar_type(), at::kFloat) << what;
      expect_close(a, ops::pooled_attention_importance(q.to(at::kFloat), k.to(at::kFloat), pool, 32, min_gap), 1e-5, what);
      expect_close(a, ops::pooled_attention_importance_reference(q.to(at::kDouble), k.to(at::kDouble), pool, 32, min_gap),
                   1e-5, what);
    }
  }
}

TEST(PooledIndexScore, BlockedMatchesReference) {
  // Values and the gradients of Σ z·weight over valid keys, against autograd through the reference.
  at::manual_seed(4);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double value_tol = dtype == at::kFloat ? 1e-5 : kTol64, grad_tol = dtype == at::kFloat ? 1e-4 : kGradTol64;
    // fp32 uses 16×32 tiles, fp64 32×16: both straddle each other and T.
    const int64_t qb = dtype == at::kFloat ? 16 : 32, kb = dtype == at::kFloat ? 32 : 16;
    for (const int64_t Hk : {2, 1}) {  // per-KV-head keys (GQA, 2 heads per key) and one shared key
      for (const int64_t T : kLengths) {
        const IndexInputs in = random_index_inputs(2, 4, Hk, T, 16, dtype);
        const at::Tensor weight = randn({2, Hk, T}, dtype);
        for (const bool relu : {false, true}) {
          for (const PoolMode pool : kPools) {
            for (const int64_t window : kWindows) {
              for (const int64_t min_gap : kGaps) {
                const std::string what = describe(pool, window, min_gap, T, dtype) + " Hk=" + std::to_string(Hk) +
                                         (relu ? " relu" : " identity");
                const at::Tensor valid = ops::pooled_valid_keys(T, window, min_gap);
                const auto blocked = value_and_grads(in, weight, valid, [&](const IndexInputs& x) {
                  return ops::pooled_index_score(x.qI, x.kI, x.w, pool, window, min_gap, relu, qb, kb);
                });
                const auto reference = value_and_grads(in, weight, valid, [&](const IndexInputs& x) {
                  return ops::pooled_index_score_reference(x.qI, x.kI, x.w, pool, window, min_gap, relu);
                });
                EXPECT_EQ(blocked.z.scalar_type(), dtype) << what;
                EXPECT_EQ(blocked.z.sizes(), in.kI.sizes().slice(0, 3)) << what;
                expect_close(blocked.z, reference.z, value_tol, what + ": z", valid.expand_as(blocked.z));
                EXPECT_TRUE(blocked.z.masked_select(valid.logical_not()).eq(-INFINITY).all().item<bool>())
                    << what << ": invalid keys not −inf";
                for (int g = 0; g < 3; ++g) {
                  EXPECT_TRUE(at::isfinite(blocked.grads[g]).all().item<bool>()) << what << ": " << kGradNames[g];
                  expect_close(blocked.grads[g], reference.grads[g], grad_tol, what + ": " + kGradNames[g]);
                }
              }
            }
          }
        }
      }
    }
  }
}

// qI and w holding only the queries some Ω holds (IndexMem's training: a window's last W) give the score and the
// gradients of the full rows with zeros before them, on every path (the linear mean, the kernels); one row too
// few is refused.
TEST(PooledIndexScore, LastQueriesAloneMatchTheZeroPaddedRows) {
  at::manual_seed(9);
  const int64_t T = 70, window = 24;
  for (const int64_t min_gap : {int64_t{0}, int64_t{2}}) {
    for (const PoolMode pool : kPools) {
      for (const bool relu : {false, true}) {
        const std::string what = describe(pool, window, min_gap, T, at::kDouble) + (relu ? " relu" : "");
        const IndexInputs in = random_index_inputs(2, 4, 2, T, 8, at::kDouble);
        const at::Tensor q_last = in.qI.narrow(2, T - window, window), w_last = in.w.narrow(2, T - window, window);
        const at::Tensor q_padded = at::constant_pad_nd(q_last, {0, 0, T - window, 0});
        const at::Tensor w_padded = at::constant_pad_nd(w_last, {T - window, 0});
        const at::Tensor z = ops::pooled_index_score(q_last, in.kI, w_last, pool, window, min_gap, relu);
        const at::Tensor z_padded = ops::pooled_index_score(q_padded, in.kI, w_padded, pool, window, min_gap, relu);
        const at::Tensor valid = ops::pooled_valid_keys(T, window, min_gap);
        expect_close(z.masked_select(valid), z_padded.masked_select(valid), kTol64, what);
        const at::Tensor dz = at::randn({2, 2, T}, at::kDouble).masked_fill(valid.logical_not(), 0);
        const auto g = torch::autograd::grad({z.masked_fill(valid.logical_not(), 0)}, {in.qI, in.kI, in.w}, {dz});
        const auto g_padded =
            torch::autograd::grad({z_padded.masked_fill(valid.logical_not(), 0)}, {in.qI, in.kI, in.w}, {dz});
        for (int i = 0; i < 3; ++i) expect_close(g[i], g_padded[i], kGradTol64, what + " " + kGradNames[i]);
      }
    }
    const IndexInputs in = random_index_inputs(1, 4, 2, T, 8, at::kDouble);
    expect_error_containing(
        [&] {
          ops::pooled_index_score(in.qI.narrow(2, T - window + 1, window - 1), in.kI, in.w.narrow(2, T - window + 1, window - 1),
                                  PoolMode::Mean, window, min_gap, false);
        },
        "hold the last 23 of 70 queries, but the windows start at query 46");
  }
}

TEST(PooledIndexScore, OddBlocksMatchReference) {
  // 1×1 tiles make every key its own accumulator chain; tiles larger than T a single tile.
  at::manual_seed(5);
  const IndexInputs in = random_index_inputs(1, 4, 2, 19, 8, at::kDouble);
  const at::Tensor weight = randn({1, 2, 19}, at::kDouble);
  const at::Tensor valid = ops::pooled_valid_keys(19, 6, 2);
  for (const auto& [qb, kb] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 7}, {128, 128}}) {
    for (const PoolMode pool : kPools) {
      for (const bool relu : {false, true}) {
        const std::string what = std::string(name_of(pool)) + " blocks " + std::to_string(qb) + "/" +
                                 std::to_string(kb) + (relu ? " relu" : "");
        const auto blocked = value_and_grads(in, weight, valid, [&](const IndexInputs& x) {
          return ops::pooled_index_score(x.qI, x.kI, x.w, pool, 6, 2, relu, qb, kb);
        });
        const auto reference = value_and_grads(in, weight, valid, [&](const IndexInputs& x) {
          return ops::pooled_index_score_reference(x.qI, x.kI, x.w, pool, 6, 2, relu);
        });
        expect_close(blocked.z, reference.z, kTol64, what, valid.expand_as(blocked.z));
        for (int g = 0; g < 3; ++g)
          expect_close(blocked.grads[g], reference.grads[g], kGradTol64, what + kGradNames[g]);
      }
    }
  }
}

TEST(PooledIndexScore, OneQueryWindowIsTheLastQuerysScore) {
  // window = 1: z[g, t] = I_g[T−1, t] = Σ_{h∈g} w[h, T−1]·act(qI[h, T−1]·kI[g, t])/√dI, for every pool.
  at::manual_seed(6);
  const int64_t T = 23, d = 8;
  const IndexInputs in = random_index_inputs(1, 4, 2, T, d, at::kDouble);
  for (const bool relu : {false, true}) {
    at::Tensor products = at::matmul(in.qI.narrow(2, T - 1, 1), in.kI.repeat_interleave(2, 1).transpose(-2, -1));
    if (relu) products = products.clamp_min(0);
    const at::Tensor expected =
        (products.squeeze(2) * in.w.narrow(2, T - 1, 1)).view({1, 2, 2, T}).sum(2).detach() / std::sqrt(double(d));
    for (const PoolMode pool : kPools) {
      expect_close(ops::pooled_index_score(in.qI, in.kI, in.w, pool, 1, 0, relu, 8, 8), expected, kTol64,
                   name_of(pool));
      expect_close(ops::pooled_index_score_reference(in.qI, in.kI, in.w, pool, 1, 0, relu), expected, kTol64,
                   name_of(pool));
    }
  }
}

TEST(PooledIndexScore, InvalidKeysGetNoGradient) {
  // z is constant (−inf) where Ω(t) is empty: whatever gradient arrives there, even NaN, changes nothing.
  at::manual_seed(7);
  const int64_t T = 20;
  const IndexInputs in = random_index_inputs(1, 4, 2, T, 8, at::kDouble);
  for (const int64_t min_gap : {5, 25}) {  // 5 invalid keys; every key invalid
    const at::Tensor valid = ops::pooled_valid_keys(T, 8, min_gap);
    const at::Tensor grad = at::where(valid, at::randn({1, 2, T}, at::kDouble), NAN);
    for (const PoolMode pool : kPools) {
      for (const bool relu : {false, true}) {
        const std::string what = std::string(name_of(pool)) + " min_gap=" + std::to_string(min_gap);
        const at::Tensor z = ops::pooled_index_score(in.qI, in.kI, in.w, pool, 8, min_gap, relu, 4, 4);
        EXPECT_TRUE(z.masked_select(valid.logical_not()).eq(-INFINITY).all().item<bool>()) << what;
        EXPECT_TRUE(at::isfinite(z.masked_select(valid)).all().item<bool>()) << what;
        const auto grads = torch::autograd::grad({z}, in.all(), {grad});
        const auto clean =
            torch::autograd::grad({ops::pooled_index_score(in.qI, in.kI, in.w, pool, 8, min_gap, relu, 4, 4)}, in.all(),
                                  {at::where(valid, grad, 0.0)});
        for (int g = 0; g < 3; ++g) {
          EXPECT_TRUE(at::equal(grads[g], clean[g])) << what << ": " << kGradNames[g];
          if (min_gap >= T) {
            EXPECT_TRUE(grads[g].eq(0).all().item<bool>()) << what << ": " << kGradNames[g];
          }
        }
      }
    }
  }
}

TEST(PooledIndexScore, CentralDifferencesInDouble) {
  // Every element of qI, kI, w: (L(x + ε) − L(x − ε)) / 2ε against the analytic gradient, L = Σ_valid z·weight.
  at::manual_seed(8);
  const int64_t T = 9, window = 6, min_gap = 1;
  const IndexInputs in = random_index_inputs(1, 4, 2, T, 4, at::kDouble);
  const at::Tensor weight = at::randn({1, 2, T}, at::kDouble), valid = ops::pooled_valid_keys(T, window, min_gap);
  const double eps = 1e-6;
  for (const PoolMode pool : kPools) {
    for (const bool relu : {false, true}) {
      auto loss = [&](const IndexInputs& x) {
        const at::Tensor z = ops::pooled_index_score(x.qI, x.kI, x.w, pool, window, min_gap, relu, 4, 3);
        return (at::where(valid, z, 0.0) * weight).sum();
      };
      const auto analytic = torch::autograd::grad({loss(in)}, in.all());
      for (int g = 0; g < 3; ++g) {
        double worst = 0;
        for (int64_t e = 0; e < in.all()[g].numel(); ++e) {
          auto shifted = [&](double delta) {
            IndexInputs x{in.qI.detach().clone(), in.kI.detach().clone(), in.w.detach().clone()};
            x.all()[g].view({-1})[e] += delta;
            return loss(x).item<double>();
          };
          const double numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
          const double exact = analytic[g].view({-1})[e].item<double>();
          worst = std::max(worst, std::abs(numeric - exact) / std::max(1.0, std::abs(exact)));
        }
        EXPECT_LT(worst, 1e-6) << name_of(pool) << (relu ? " relu " : " identity ") << kGradNames[g];
      }
    }
  }
}

TEST(PooledIndexScore, BFloat16ComputesInFloat) {
  at::manual_seed(9);
  const IndexInputs in = random_index_inputs(1, 4, 2, 70, 16, at::kBFloat16);
  const at::Tensor z = ops::pooled_index_score(in.qI, in.kI, in.w, PoolMode::LogSumExp, 32, 0, false);
  EXPECT_EQ(z.scalar_type(), at::kBFloat16);
  const at::Tensor f = ops::pooled_index_score(in.qI.detach().to(at::kFloat), in.kI.detach().to(at::kFloat),
                                               in.w.detach().to(at::kFloat), PoolMode::LogSumExp, 32, 0, false);
  // The float kernel rounded once to bf16: within half a bf16 ulp (2^-8 relative).
  expect_close(z, f, 1.0 / 256, "bf16 z");
  const auto grads = torch::autograd::grad({z.sum()}, in.all());
  for (int g = 0; g < 3; ++g) EXPECT_EQ(grads[g].scalar_type(), at::kBFloat16) << kGradNames[g];
}

TEST(PooledOpsValidation, RejectsBadArguments) {
  const at::Tensor q = at::randn({1, 4, 5, 8}), k = at::randn({1, 2, 5, 8}), w = at::rand({1, 4, 5});
  expect_error_containing(
      [&] {
        ops::pooled_attention_importance(at::randn({1, 3, 5, 8}), k, PoolMode::Mean, 0, 0);
      },
      "kvbound::pooled_attention_importance: query heads (3) must be a positive multiple of KV heads (2)");
  expect_error_containing(
      [&] {
        ops::pooled_attention_importance(q, at::randn({1, 2, 6, 8}), PoolMode::Mean, 0, 0);
      },
      "matching q [1, 4, 5, 8]; got k [1, 2, 6, 8]");
  expect_error_containing([&] { ops::pooled_attention_importance(q, k, PoolMode::Mean, 0, -1); }, "min_gap");
  expect_error_containing([&] { ops::pooled_attention_importance(q, k, PoolMode::Mean, 0, 0, 0, 64); },
                          "block sizes must be positive");

  expect_error_containing(
      [&] {
        ops::pooled_index_score(q, k, at::rand({1, 4, 6}), PoolMode::Max, 0, 0, false);
      },
      "kvbound::pooled_index_score: w must be [B, Hq, T] = [1, 4, 5]; got [1, 4, 6]");
  expect_error_containing(
      [&] {
        ops::pooled_index_score(q, at::randn({1, 3, 5, 8}), w, PoolMode::Max, 0, 0, false);
      },
      "query heads (4) must be a positive multiple of key heads (3)");
  expect_error_containing([&] { ops::pooled_index_score(q, k.to(at::kDouble), w, PoolMode::Max, 0, 0, false); },
                          "share one floating dtype");
  expect_error_containing([&] { ops::pooled_index_score(q, k, w, PoolMode::Max, 0, -2, false); }, "min_gap");
  expect_error_containing([&] { ops::pooled_index_score(q, k, w, static_cast<PoolMode>(7), 0, 0, false); },
                          "pool must be 0 (mean), 1 (max) or 2 (logsumexp); got 7");
}

// The linear mean score's last step (ops/gathered_row_dot.h): the fused CPU pass against the ATen formula, values
// and both gradients, on keys in the indexer's head-transposed layout and an index that repeats and skips rows
// (float64 to 1e-12, float32 to float32 rounding); b's gradient in b's layout; the no-gradient path; bad arguments.
TEST(GatheredRowDot, FusedPassMatchesTheFormula) {
  at::manual_seed(12);
  const at::Tensor index = at::tensor(std::vector<int64_t>{3, 3, 3, 0, 1, 3, 4}, at::kLong);
  for (const at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    const double tol = dtype == at::kDouble ? 1e-12 : 2e-5;
    const at::Tensor a0 = at::randn({2, 3, 5, 16}, dtype), b0 = at::randn({2, 7, 3, 16}, dtype).transpose(1, 2);
    const at::Tensor a = a0.detach().requires_grad_(true), b = b0.detach().requires_grad_(true);
    const at::Tensor a_ref = a0.detach().requires_grad_(true), b_ref = b0.detach().requires_grad_(true);
    const at::Tensor out = ops::gathered_row_dot(a, index, b);
    const at::Tensor expected = ops::gathered_row_dot_reference(a_ref, index, b_ref);
    ASSERT_EQ(out.sizes(), expected.sizes());
    EXPECT_TRUE(at::allclose(out, expected, tol, tol)) << dtype;
    const at::Tensor grad = at::randn(out.sizes(), dtype);
    const auto grads = torch::autograd::grad({out}, {a, b}, {grad});
    const auto grads_ref = torch::autograd::grad({expected}, {a_ref, b_ref}, {grad});
    EXPECT_TRUE(at::allclose(grads[0], grads_ref[0], tol, tol)) << dtype;
    EXPECT_TRUE(at::allclose(grads[1], grads_ref[1], tol, tol)) << dtype;
    EXPECT_EQ(grads[1].strides(), b.strides()) << dtype;
    EXPECT_TRUE(at::equal(ops::gathered_row_dot(a0, index, b0), out.detach())) << dtype;  // no gradient wanted
  }
  const at::Tensor a = at::randn({1, 2, 4, 8}), b = at::randn({1, 2, 3, 8});
  expect_error_containing(
      [&] { ops::gathered_row_dot(a, at::tensor(std::vector<int64_t>{0, 4, 1}, at::kLong), b); },
      "kvbound::gathered_row_dot: index values must lie in [0, 4)");
  expect_error_containing([&] { ops::gathered_row_dot(a, at::zeros({2}, at::kLong), b); }, "do not match");
  expect_error_containing([&] { ops::gathered_row_dot(a.to(at::kDouble), at::zeros({3}, at::kLong), b); },
                          "share one dtype");
}

namespace {

// Peak bytes alive through the CPU allocator while `run` executes.
template <typename Run>
int64_t peak_bytes_of(Run run) {
  const test::CountCpuAllocations count;
  run();
  return count.peak_bytes();
}

}  // namespace

TEST(PooledMemory, BlockedPathsNeverAllocateTimesSquared) {
  at::manual_seed(10);
  const int64_t B = 1, Hq = 4, Hk = 2, D = 16;
  {
    // The instrument sees the references' [B, Hq, T, T] scores.
    const int64_t T = 256;
    const at::Tensor q = at::randn({B, Hq, T, D}), k = at::randn({B, Hk, T, D});
    EXPECT_GE(peak_bytes_of([&] { ops::pooled_attention_importance_reference(q, k, PoolMode::Mean, 0, 0); }),
              B * Hq * T * T * 4);
    const IndexInputs in = random_index_inputs(B, Hq, Hk, T, D, at::kFloat);
    EXPECT_GE(peak_bytes_of([&] {
                torch::autograd::grad(
                    {ops::pooled_index_score_reference(in.qI, in.kI, in.w, PoolMode::Mean, 0, 0, true).sum()},
                    in.all());
              }),
              B * Hq * T * T * 4);
  }
  // window = 0 (every later query) is the most work; the blocked paths' memory does not depend on it.
  const int64_t T = 2048, scores_bytes = B * Hq * T * T * 4;
  const at::Tensor q = at::randn({B, Hq, T, D}), k = at::randn({B, Hk, T, D});
  for (const PoolMode pool : kPools) {
    const int64_t teacher = peak_bytes_of([&] { ops::pooled_attention_importance(q, k, pool, 0, 0); });
    EXPECT_LT(teacher, scores_bytes / 20) << name_of(pool) << " teacher peak " << teacher << " bytes";
    for (const bool relu : {false, true}) {
      const IndexInputs in = random_index_inputs(B, Hq, Hk, T, D, at::kFloat);
      const at::Tensor weight = at::randn({B, Hk, T});
      const int64_t student = peak_bytes_of([&] {
        const at::Tensor z = ops::pooled_index_score(in.qI, in.kI, in.w, pool, 0, 0, relu);
        torch::autograd::grad({(z * weight).sum()}, in.all());
      });
      EXPECT_LT(student, scores_bytes / 20)
          << name_of(pool) << (relu ? " relu" : "") << " student peak " << student << " bytes";
    }
  }
}

// The tiled ATen path (ops/pooled_ops_tiled.h, the ops' CUDA kernels) run on the CPU against the same references:
// one-row tiles and tiles that straddle T, values and the gradients of Σ z·weight.
TEST(PooledOpsTiled, ImportanceMatchesReference) {
  at::manual_seed(11);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double tol = dtype == at::kFloat ? 1e-5 : kTol64;
    for (const int64_t T : kLengths) {
      const at::Tensor q = randn({2, 4, T, 16}, dtype), k = randn({2, 2, T, 16}, dtype);
      for (const PoolMode pool : kPools)
        for (const int64_t window : kWindows)
          for (const int64_t min_gap : kGaps)
            for (const int64_t rows : {1, 3, 64}) {
              const std::string what = describe(pool, window, min_gap, T, dtype) + " rows=" + std::to_string(rows);
              const at::Tensor a = ops::pooled_attention_importance_tiled(q, k, static_cast<int64_t>(pool), window,
                                                                          min_gap, rows, 64);
              EXPECT_EQ(a.scalar_type(), dtype) << what;
              expect_close(a, ops::pooled_attention_importance_reference(q, k, pool, window, min_gap), tol, what);
            }
    }
  }
}

TEST(PooledOpsTiled, IndexScoreMatchesReference) {
  at::manual_seed(12);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const double value_tol = dtype == at::kFloat ? 1e-5 : kTol64, grad_tol = dtype == at::kFloat ? 1e-4 : kGradTol64;
    for (const int64_t Hk : {2, 1}) {
      for (const int64_t T : kLengths) {
        const IndexInputs in = random_index_inputs(2, 4, Hk, T, 16, dtype);
        // Gradient arrives for every key, invalid ones too: they must pass none of it on.
        const at::Tensor weight = randn({2, Hk, T}, dtype);
        for (const bool relu : {false, true})
          for (const PoolMode pool : kPools)
            for (const int64_t window : kWindows)
              for (const int64_t min_gap : kGaps)
                for (const int64_t rows : {1, 5}) {
                  const std::string what = describe(pool, window, min_gap, T, dtype) + " Hk=" + std::to_string(Hk) +
                                           (relu ? " relu" : " identity") + " rows=" + std::to_string(rows);
                  const at::Tensor valid = ops::pooled_valid_keys(T, window, min_gap);
                  const auto reference = value_and_grads(in, weight, valid, [&](const IndexInputs& x) {
                    return ops::pooled_index_score_reference(x.qI, x.kI, x.w, pool, window, min_gap, relu);
                  });
                  const auto p = static_cast<int64_t>(pool);
                  auto [z, argmax] = ops::pooled_index_score_tiled_fwd(in.qI, in.kI, in.w, p, window, min_gap, relu,
                                                                       rows, 64);
                  EXPECT_EQ(z.scalar_type(), dtype) << what;
                  expect_close(z, reference.z, value_tol, what + ": z", valid.expand_as(z));
                  EXPECT_TRUE(z.masked_select(valid.logical_not()).eq(-INFINITY).all().item<bool>()) << what;
                  EXPECT_EQ(argmax.size(0), pool == PoolMode::Max ? 2 : 0) << what;
                  if (pool == PoolMode::Max)  // −1 exactly where no query sees the key, as the kernels write it
                    EXPECT_TRUE(argmax.lt(0).equal(valid.logical_not().expand_as(argmax))) << what;
                  auto [gq, gk, gw] = ops::pooled_index_score_tiled_bwd(weight, in.qI, in.kI, in.w, z, argmax, p,
                                                                        window, min_gap, relu, rows, 64);
                  const at::Tensor grads[] = {gq, gk, gw};
                  for (int g = 0; g < 3; ++g) {
                    EXPECT_EQ(grads[g].sizes(), in.all()[static_cast<std::size_t>(g)].sizes()) << what;
                    expect_close(grads[g], reference.grads[g], grad_tol, what + ": " + kGradNames[g]);
                  }
                }
      }
    }
  }
}

// Inputs as the model hands them over: heads transposed out of [B, T, H, D] (not contiguous).
TEST(PooledOpsTiled, TakesStridedInputs) {
  at::manual_seed(15);
  const int64_t T = 40;
  const at::Tensor q = at::randn({2, T, 4, 16}).transpose(1, 2), k = at::randn({2, T, 2, 16}).transpose(1, 2);
  const at::Tensor w = at::sigmoid(at::randn({2, T, 4})).transpose(1, 2);
  ASSERT_FALSE(q.is_contiguous());
  for (const PoolMode pool : kPools) {
    const auto p = static_cast<int64_t>(pool);
    expect_close(ops::pooled_attention_importance_tiled(q, k, p, 0, 2, 7, 64),
                 ops::pooled_attention_importance_reference(q, k, pool, 0, 2), 1e-5, name_of(pool));
    auto [z, argmax] = ops::pooled_index_score_tiled_fwd(q, k, w, p, 0, 2, true, 7, 64);
    const at::Tensor valid = ops::pooled_valid_keys(T, 0, 2);
    expect_close(z, ops::pooled_index_score_reference(q, k, w, pool, 0, 2, true), 1e-5, name_of(pool),
                 valid.expand_as(z));
  }
}

// Memory in units of one tile, [B, Hq, rows, T] floats (1/32 of the T×T scores here, 1/256 from T = 16K on): the
// teacher holds one tile and its masks, the student's relu backward P, relu(P)·g and a transposed copy.
TEST(PooledOpsTiled, TileMemoryIsAFewTiles) {
  at::manual_seed(13);
  const int64_t B = 1, Hq = 4, Hk = 2, D = 16, T = 2048;
  EXPECT_EQ(ops::pooled_tile_rows(T, 64), 64);
  EXPECT_EQ(ops::pooled_tile_rows(65536, 64), 256);  // ≤ 256 tiles
  const double tile_bytes = B * Hq * 64 * T * 4;
  const at::Tensor q = at::randn({B, Hq, T, D}), k = at::randn({B, Hk, T, D});
  for (const PoolMode pool : kPools) {
    const auto p = static_cast<int64_t>(pool);
    const int64_t teacher = peak_bytes_of([&] { ops::pooled_attention_importance_tiled(q, k, p, 0, 0, 64, 64); });
    EXPECT_LT(teacher, 1.5 * tile_bytes) << name_of(pool);
    const IndexInputs in = random_index_inputs(B, Hq, Hk, T, D, at::kFloat);
    const at::Tensor weight = at::randn({B, Hk, T});
    const int64_t student = peak_bytes_of([&] {
      auto [z, argmax] = ops::pooled_index_score_tiled_fwd(in.qI, in.kI, in.w, p, 0, 0, true, 64, 64);
      ops::pooled_index_score_tiled_bwd(weight, in.qI, in.kI, in.w, z, argmax, p, 0, 0, true, 64, 64);
    });
    EXPECT_LT(student, 4 * tile_bytes) << name_of(pool);
  }
}

// bf16/fp16 importance with head dim 64 or 128 runs on tensor cores (ops/pooled_importance_mma.cu): the dtype's
// exact products summed in fp32, everything after them fp32. So it equals the CPU kernel in float32 on the same
// rounded inputs up to fp32 rounding, entry by entry (an invalid key's 0 exactly): a query window or gap off by
// one row, or a tile missed at a ragged T, moves an entry by far more.
TEST(PooledOpsCuda, ImportanceOnTensorCoresMatchesFloat32) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(15);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf})
    for (const int64_t D : {64, 128})
      for (const int64_t T : {1, 70, 333}) {
        const at::Tensor q = randn({2, 8, T, D}, dtype), k = randn({2, 2, T, D}, dtype);
        for (const auto [window, min_gap] : {std::pair<int64_t, int64_t>{0, 0}, {64, 2}, {0, 5}, {500, 0}})
          for (const PoolMode pool : kPools) {
            const std::string what = describe(pool, window, min_gap, T, dtype) + " D=" + std::to_string(D);
            const at::Tensor actual = ops::pooled_attention_importance(q.cuda(), k.cuda(), pool, window, min_gap).cpu();
            const at::Tensor expected =
                ops::pooled_attention_importance(q.to(at::kFloat), k.to(at::kFloat), pool, window, min_gap);
            ASSERT_EQ(actual.scalar_type(), at::kFloat) << what;
            ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
            const at::Tensor excess = (actual.to(at::kDouble) - expected.to(at::kDouble)).abs() -
                                      (1e-3 * expected.to(at::kDouble).abs() + 1e-7);
            EXPECT_LE(excess.max().item<double>(), 0.0) << what << ": worst entry off by "
                                                          << (actual - expected).abs().max().item<double>();
          }
      }
}

// The index score's forward on tensor cores (bf16/fp16, index dim 32, 64 or 128: ops/pooled_index_score_mma.cu):
// the rounded inputs' products summed in fp32, everything after them fp32, z rounded once to the dtype. So z is the
// float32 path's z on the same inputs within one unit in the dtype's last place, max pooling's argmax is a query of
// Ω(t) whose score is the maximum (checked in float64: two queries may tie to fp32 rounding), and a key with an
// empty Ω gets −inf.
TEST(PooledOpsCuda, IndexScoreForwardOnTensorCoresMatchesFloat32) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(16);
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const double ulp = dtype == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;  // relative spacing, an upper bound
    for (const int64_t d : {32, 64, 128})
      for (const int64_t T : {1, 70, 333}) {
        const IndexInputs drawn = random_index_inputs(2, 8, 2, T, d, dtype);
        const at::Tensor qI = drawn.qI.detach(), kI = drawn.kI.detach(), w = drawn.w.detach();
        for (const bool relu : {false, true}) {
          // I[b, g, s, t] in float64 from the same rounded inputs.
          at::Tensor products = at::matmul(qI.to(at::kDouble).view({2, 2, 4, T, d}),
                                           kI.to(at::kDouble).unsqueeze(2).transpose(-1, -2));
          if (relu) products = products.relu();
          const at::Tensor scores =
              (w.to(at::kDouble).view({2, 2, 4, T, 1}) * products).sum(2) / std::sqrt(static_cast<double>(d));
          for (const auto [window, min_gap] : {std::pair<int64_t, int64_t>{0, 0}, {64, 2}, {0, 5}, {500, 0}})
            for (const PoolMode pool : kPools) {
              const std::string what = describe(pool, window, min_gap, T, dtype) + " d=" + std::to_string(d) +
                                       (relu ? " relu" : " identity");
              const int64_t p = static_cast<int64_t>(pool);
              const auto [z, argmax] =
                  ops::pooled_index_score_tiled_fwd(qI.cuda(), kI.cuda(), w.cuda(), p, window, min_gap, relu, 64, 64);
              const at::Tensor z32 = std::get<0>(ops::pooled_index_score_tiled_fwd(
                  qI.to(at::kFloat), kI.to(at::kFloat), w.to(at::kFloat), p, window, min_gap, relu, 64, 64));
              ASSERT_EQ(z.scalar_type(), dtype) << what;
              const at::Tensor valid = ops::pooled_valid_keys(T, window, min_gap).expand_as(z32);
              const at::Tensor actual = z.cpu().to(at::kDouble), expected = z32.to(at::kDouble);
              EXPECT_TRUE(actual.masked_select(valid.logical_not()).eq(-INFINITY).all().item<bool>()) << what;
              const at::Tensor excess = ((actual - expected).abs() - (ulp * expected.abs() + 1e-6)).masked_select(valid);
              if (excess.numel() > 0) EXPECT_LE(excess.max().item<double>(), 0.0) << what;
              if (pool == PoolMode::Max && valid.any().item<bool>()) {
                const at::Tensor query = argmax.cpu().to(at::kLong).clamp_min(0);  // [2, 2, T]
                const at::Tensor reached = scores.gather(2, query.unsqueeze(2)).squeeze(2);
                const at::Tensor starts = ops::window_starts(T, window, min_gap).expand_as(query);
                EXPECT_TRUE((query >= starts).masked_select(valid).all().item<bool>()) << what << ": argmax outside Ω";
                EXPECT_LE(((reached - expected).abs() - 1e-5 * expected.abs()).masked_select(valid).max().item<double>(),
                          1e-6)
                    << what << ": the argmax query's score is not the maximum";
              }
            }
        }
      }
  }
}

// On a GPU the ops dispatch to the tiled path (bf16 forwards at index dim 32 to the tensor-core kernels): the same
// values and gradients as the CPU kernels, fp32 and bf16.
TEST(PooledOpsCuda, MatchCpuKernels) {
  if (const std::string why = test::why_no_cuda(); !why.empty()) GTEST_SKIP() << why;
  at::manual_seed(14);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const double tol = dtype == at::kFloat ? 1e-4 : 2e-2;
    const int64_t T = 300;
    const at::Tensor q = randn({2, 8, T, 32}, dtype), k = randn({2, 2, T, 32}, dtype);
    for (const PoolMode pool : kPools) {
      const std::string what = describe(pool, 64, 2, T, dtype);
      expect_close(ops::pooled_attention_importance(q.cuda(), k.cuda(), pool, 64, 2).cpu(),
                   ops::pooled_attention_importance(q.to(at::kFloat), k.to(at::kFloat), pool, 64, 2), tol, what);
      for (const bool relu : {false, true}) {
        // The CPU gets the GPU's inputs (rounded to dtype) in float32, so max pooling picks the same queries.
        const IndexInputs drawn = random_index_inputs(2, 8, 2, T, 32, dtype);
        IndexInputs cpu, gpu;
        for (auto [from, to_cpu, to_gpu] : {std::tuple{&drawn.qI, &cpu.qI, &gpu.qI}, std::tuple{&drawn.kI, &cpu.kI, &gpu.kI},
                                            std::tuple{&drawn.w, &cpu.w, &gpu.w}}) {
          *to_cpu = from->detach().to(at::kFloat).requires_grad_(true);
          *to_gpu = from->detach().to(at::kCUDA).requires_grad_(true);
        }
        const at::Tensor weight = at::randn({2, 2, T});
        const at::Tensor valid = ops::pooled_valid_keys(T, 64, 2);
        const auto expected = value_and_grads(cpu, weight, valid, [&](const IndexInputs& x) {
          return ops::pooled_index_score(x.qI, x.kI, x.w, pool, 64, 2, relu);
        });
        const auto actual = value_and_grads(gpu, weight.to(at::kCUDA, dtype), valid.cuda(), [&](const IndexInputs& x) {
          return ops::pooled_index_score(x.qI, x.kI, x.w, pool, 64, 2, relu);
        });
        expect_close(actual.z.cpu(), expected.z, tol, what + ": z", valid.expand_as(expected.z));
        for (int g = 0; g < 3; ++g)
          expect_close(actual.grads[g].cpu(), expected.grads[g], tol, what + (relu ? " relu " : " ") + kGradNames[g]);
      }
    }
  }
}
