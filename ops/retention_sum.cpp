#include "ops/retention_sum.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace kvbound::ops {
namespace {

constexpr const char* kOpName = "kvbound::retention_sum";

void check_input(const at::Tensor& log_beta) {
  TORCH_CHECK(log_beta.dim() >= 1 && at::isFloatingType(log_beta.scalar_type()), kOpName,
              ": log_beta must be a floating tensor [..., T]; got ", log_beta.scalar_type(), " ", log_beta.sizes());
}

// [..., T] as [rows, T] in the CPU kernel's arithmetic type (float64 stays, everything else float32).
at::Tensor flat_rows(const at::Tensor& x) {
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  return x.to(compute).contiguous().view({rows, x.size(-1)});
}

// Writes the terms (t−i)·log_beta_i of one tile (queries t0.., sources s0..; −inf where i > t) and
// exponentiates them with ATen's vectorised exp: tile[r][c] = β_{s0+c}^(t0+r−s0−c) or 0.
template <typename scalar_t>
void fill_powers(at::Tensor tile, const scalar_t* log_beta, int64_t t0, int64_t nt, int64_t s0, int64_t ni) {
  scalar_t* x = tile.mutable_data_ptr<scalar_t>();
  for (int64_t r = 0; r < nt; ++r) {
    const int64_t t = t0 + r, visible = std::clamp<int64_t>(t - s0 + 1, 0, ni);
    scalar_t* xr = x + r * ni;
    for (int64_t c = 0; c < visible; ++c) xr[c] = static_cast<scalar_t>(t - s0 - c) * log_beta[s0 + c];
    std::fill(xr + visible, xr + ni, -std::numeric_limits<scalar_t>::infinity());
  }
  tile.exp_();
}

// S_t = Σ_{i≤t} β_i^(t−i): parallel over (row, query tile); source tiles past the query tile are all masked.
template <typename scalar_t>
void forward_blocked(const at::Tensor& log_beta, const at::Tensor& sums, int64_t block) {
  const int64_t rows = log_beta.size(0), T = log_beta.size(1);
  const int64_t blocks = (T + block - 1) / block;
  const scalar_t* log_beta_data = log_beta.const_data_ptr<scalar_t>();
  scalar_t* sums_data = sums.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor tile = at::empty({block * block}, log_beta.options());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / blocks, t0 = (task % blocks) * block, nt = std::min(block, T - t0);
      scalar_t* out = sums_data + row * T + t0;
      std::fill_n(out, nt, scalar_t(0));
      for (int64_t s0 = 0; s0 < t0 + nt; s0 += block) {
        const int64_t ni = std::min(block, T - s0);
        fill_powers<scalar_t>(tile.narrow(0, 0, nt * ni), log_beta_data + row * T, t0, nt, s0, ni);
        const scalar_t* x = tile.const_data_ptr<scalar_t>();
        for (int64_t r = 0; r < nt; ++r) {
          scalar_t sum = 0;
          for (int64_t c = 0; c < ni; ++c) sum += x[r * ni + c];
          out[r] += sum;
        }
      }
    }
  });
}

// grad_log_beta_i = Σ_{t≥i} grad_S[t]·(t−i)·β_i^(t−i): parallel over (row, source tile); query tiles before
// the source tile are all masked.
template <typename scalar_t>
void backward_blocked(const at::Tensor& grad_sums, const at::Tensor& log_beta, const at::Tensor& grad_log_beta,
                      int64_t block) {
  const int64_t rows = log_beta.size(0), T = log_beta.size(1);
  const int64_t blocks = (T + block - 1) / block;
  const scalar_t* log_beta_data = log_beta.const_data_ptr<scalar_t>();
  const scalar_t* grad_data = grad_sums.const_data_ptr<scalar_t>();
  scalar_t* grad_log_beta_data = grad_log_beta.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor tile = at::empty({block * block}, log_beta.options());
    std::vector<scalar_t> acc(block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / blocks, s0 = (task % blocks) * block, ni = std::min(block, T - s0);
      const scalar_t* grad = grad_data + row * T;
      std::fill_n(acc.begin(), ni, scalar_t(0));
      for (int64_t t0 = s0; t0 < T; t0 += block) {
        const int64_t nt = std::min(block, T - t0);
        fill_powers<scalar_t>(tile.narrow(0, 0, nt * ni), log_beta_data + row * T, t0, nt, s0, ni);
        const scalar_t* x = tile.const_data_ptr<scalar_t>();
        // Masked entries are 0, so their negative ages add nothing.
        for (int64_t r = 0; r < nt; ++r) {
          const int64_t t = t0 + r;
          for (int64_t c = 0; c < ni; ++c) acc[c] += grad[t] * static_cast<scalar_t>(t - s0 - c) * x[r * ni + c];
        }
      }
      std::copy_n(acc.begin(), ni, grad_log_beta_data + row * T + s0);
    }
  });
}

at::Tensor retention_sum_fwd_cpu(const at::Tensor& log_beta, int64_t block) {
  TORCH_CHECK(block > 0, kOpName, ": block must be positive; got ", block);
  const at::Tensor flat = flat_rows(log_beta);
  const at::Tensor sums = at::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "retention_sum_fwd_cpu",
                             [&] { forward_blocked<scalar_t>(flat, sums, block); });
  return sums.view(log_beta.sizes()).to(log_beta.scalar_type());
}

at::Tensor retention_sum_bwd_cpu(const at::Tensor& grad_sums, const at::Tensor& log_beta, int64_t block) {
  TORCH_CHECK(block > 0, kOpName, ": block must be positive; got ", block);
  const at::Tensor flat = flat_rows(log_beta);
  const at::Tensor grad_log_beta = at::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES(flat.scalar_type(), "retention_sum_bwd_cpu", [&] {
    backward_blocked<scalar_t>(flat_rows(grad_sums.to(log_beta.scalar_type())), flat, grad_log_beta, block);
  });
  return grad_log_beta.view(log_beta.sizes()).to(log_beta.scalar_type());
}

class RetentionSumFunction : public torch::autograd::Function<RetentionSumFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& log_beta, int64_t block) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("kvbound::retention_sum_fwd", "")
                               .typed<at::Tensor(const at::Tensor&, int64_t)>();
    ctx->save_for_backward({log_beta});
    ctx->saved_data["block"] = block;
    return op.call(log_beta, block);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("kvbound::retention_sum_bwd", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
    const auto saved = ctx->get_saved_variables();
    return {op.call(grad_outputs[0], saved[0], ctx->saved_data["block"].toInt()), at::Tensor()};
  }
};

}  // namespace

at::Tensor retention_sum(const at::Tensor& log_beta, int64_t block) {
  check_input(log_beta);
  return RetentionSumFunction::apply(log_beta, block);
}

at::Tensor retention_sum_reference(const at::Tensor& log_beta) {
  check_input(log_beta);
  // Integer ages t − i (rows t, columns i); masked terms use age 0, so exp stays finite and the
  // masked_fill's zero gradient never meets an infinity.
  const at::Tensor positions = at::arange(log_beta.size(-1), log_beta.options().dtype(at::kLong));
  const at::Tensor age = positions.unsqueeze(1) - positions.unsqueeze(0);
  return at::exp(age.clamp_min(0) * log_beta.unsqueeze(-2)).masked_fill(age.lt(0), 0).sum(-1);
}

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) {
  m.def("retention_sum_fwd(Tensor log_beta, int block) -> Tensor");
  m.def("retention_sum_bwd(Tensor grad_sum, Tensor log_beta, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvbound, CPU, m) {
  m.impl("retention_sum_fwd", &kvbound::ops::retention_sum_fwd_cpu);
  m.impl("retention_sum_bwd", &kvbound::ops::retention_sum_bwd_cpu);
}
