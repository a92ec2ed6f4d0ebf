#include "ops/gathered_row_dot.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

namespace kvbound::ops {
namespace {

constexpr const char* kOpName = "kvbound::gathered_row_dot";

void check_inputs(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && index.dim() == 1, kOpName,
              ": expected a [B, H, N, d], index [T], b [B, H, T, d]; got a ", a.sizes(), ", index ", index.sizes(),
              ", b ", b.sizes());
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == b.size(1) && a.size(3) == b.size(3) && index.size(0) == b.size(2),
              kOpName, ": a ", a.sizes(), ", index ", index.sizes(), " and b ", b.sizes(), " do not match");
  TORCH_CHECK(index.scalar_type() == at::kLong, kOpName, ": index must be int64; got ", index.scalar_type());
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a.device() == b.device() && index.device() == b.device(), kOpName,
              ": a and b must share one dtype and device with index; got ", a.scalar_type(), " ", a.device(), ", ",
              b.scalar_type(), " ", b.device(), ", index on ", index.device());
  // The fused pass reads a's rows by index; elsewhere index_select checks them, without this host sync.
  if (index.is_cpu() && index.numel() > 0)
    TORCH_CHECK(index.min().item<int64_t>() >= 0 && index.max().item<int64_t>() < a.size(2), kOpName,
                ": index values must lie in [0, ", a.size(2), ")");
}

bool takes_fused(const at::Tensor& a, const at::Tensor& b) {
  return b.is_cpu() && (b.scalar_type() == at::kFloat || b.scalar_type() == at::kDouble) && b.stride(3) == 1 &&
         a.stride(3) == 1;
}

// The (batch, head) rows of [B, H, ...]: one task each, so every sum runs in one fixed order on one thread.
template <typename Body>
void for_each_head_row(const at::Tensor& b, Body body) {
  const int64_t H = b.size(1);
  at::parallel_for(0, b.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r / H, r % H);
  });
}

template <typename scalar_t>
void forward_rows(const at::Tensor& a, const int64_t* index, const at::Tensor& b, at::Tensor& out) {
  const int64_t T = b.size(2), d = b.size(3);
  const scalar_t* a_data = a.const_data_ptr<scalar_t>();
  const scalar_t* b_data = b.const_data_ptr<scalar_t>();
  scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
  for_each_head_row(b, [&](int64_t i, int64_t h) {
    const scalar_t* a_row = a_data + i * a.stride(0) + h * a.stride(1);
    const scalar_t* b_row = b_data + i * b.stride(0) + h * b.stride(1);
    scalar_t* o = out_data + (i * b.size(1) + h) * T;
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t* x = a_row + index[t] * a.stride(2);
      const scalar_t* y = b_row + t * b.stride(2);
      scalar_t acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t e = 0; e < d; ++e) acc += x[e] * y[e];
      o[t] = acc;
    }
  });
}

// grad_b[.., t, :] = g[.., t]·a[.., index[t], :]; grad_a[.., j, :] = Σ_{t: index[t] = j} g[.., t]·b[.., t, :], the
// sum over t in increasing order.
template <typename scalar_t>
void backward_rows(const at::Tensor& grad, const at::Tensor& a, const int64_t* index, const at::Tensor& b,
                   at::Tensor& grad_a, at::Tensor& grad_b) {
  const int64_t H = b.size(1), T = b.size(2), d = b.size(3), N = a.size(2);
  const scalar_t* g_data = grad.const_data_ptr<scalar_t>();
  const scalar_t* a_data = a.const_data_ptr<scalar_t>();
  const scalar_t* b_data = b.const_data_ptr<scalar_t>();
  scalar_t* ga_data = grad_a.defined() ? grad_a.mutable_data_ptr<scalar_t>() : nullptr;
  scalar_t* gb_data = grad_b.defined() ? grad_b.mutable_data_ptr<scalar_t>() : nullptr;
  for_each_head_row(b, [&](int64_t i, int64_t h) {
    const scalar_t* g = g_data + (i * H + h) * T;
    const scalar_t* a_row = a_data + i * a.stride(0) + h * a.stride(1);
    const scalar_t* b_row = b_data + i * b.stride(0) + h * b.stride(1);
    scalar_t* ga = ga_data ? ga_data + (i * H + h) * N * d : nullptr;
    for (int64_t t = 0; t < T; ++t) {
      const scalar_t gt = g[t];
      if (gb_data) {
        const scalar_t* x = a_row + index[t] * a.stride(2);
        scalar_t* y = gb_data + i * grad_b.stride(0) + h * grad_b.stride(1) + t * grad_b.stride(2);
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) y[e] = gt * x[e];
      }
      if (ga) {
        scalar_t* x = ga + index[t] * d;
        const scalar_t* y = b_row + t * b.stride(2);
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) x[e] += gt * y[e];
      }
    }
  });
}

at::Tensor fused_forward(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b) {
  at::Tensor out = at::empty({b.size(0), b.size(1), b.size(2)}, b.options());
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "gathered_row_dot",
                             [&] { forward_rows<scalar_t>(a, index.const_data_ptr<int64_t>(), b, out); });
  return out;
}

class GatheredRowDotFunction : public torch::autograd::Function<GatheredRowDotFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a, const at::Tensor& index,
                            const at::Tensor& b) {
    ctx->save_for_backward({a, index, b});
    return fused_forward(a, index, b);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &index = saved[1], &b = saved[2];
    const at::Tensor grad = grad_outputs[0].contiguous();
    // b's gradient in b's layout (a head-transposed view of the keys stays one); a's, the small one, dense.
    at::Tensor grad_a = ctx->needs_input_grad(0) ? at::zeros(a.sizes(), a.options())
                                                 : at::Tensor();
    at::Tensor grad_b = ctx->needs_input_grad(2) ? at::empty_like(b) : at::Tensor();
    AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "gathered_row_dot_backward", [&] {
      backward_rows<scalar_t>(grad, a, index.const_data_ptr<int64_t>(), b, grad_a, grad_b);
    });
    return {grad_a, {}, grad_b};
  }
};

}  // namespace

at::Tensor gathered_row_dot(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b) {
  check_inputs(a, index, b);
  if (!takes_fused(a, b)) return gathered_row_dot_reference(a, index, b);
  const at::Tensor index_here = index.contiguous();
  if (at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad()))
    return GatheredRowDotFunction::apply(a, index_here, b);
  return fused_forward(a, index_here, b);
}

at::Tensor gathered_row_dot_reference(const at::Tensor& a, const at::Tensor& index, const at::Tensor& b) {
  check_inputs(a, index, b);
  return (a.index_select(2, index) * b).sum(-1);
}

}  // namespace kvbound::ops
