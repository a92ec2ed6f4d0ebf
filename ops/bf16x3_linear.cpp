#include "ops/bf16x3_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <functional>
#include <numeric>

#include "ops/amx_panels.h"
#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

namespace cpublas = at::native::cpublas;

// Rows of x per task: 128 rows of x_hi and x_lo at K = 1536 are 0.75 MiB, which stays in a core's L2 while the
// task's weight panel streams past.
constexpr int64_t kRowBlock = 128;

using amx::round_up;

const at::BFloat16* as_bf16(const uint16_t* p) { return reinterpret_cast<const at::BFloat16*>(p); }

// The tiles' forward; the input gradient dY·W in float32. Only W is saved (the input is not needed: W is frozen).
class Bf16x3LinearFunction : public torch::autograd::Function<Bf16x3LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const Bf16x3Rows* rows, const Bf16x3Weight* tiles, const at::Tensor* bias) {
    ctx->save_for_backward({weight});
    (void)x;  // an input of the function so that autograd links the output to it
    return bf16x3_linear(*rows, *tiles, *bias);  // the bias by pointer: it may be undefined, which apply rejects
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    return {at::matmul(grad_outputs[0], weight), {}, {}, {}, {}};
  }
};

}  // namespace

bool bf16x3_available() { return amx::bf16_available(); }

KVBOUND_VECTOR_CLONES void split_row(const float* x, int64_t K, int64_t padded, uint16_t* hi, uint16_t* lo) {
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t h = cpu::float_to_bf16(x[k]);
    hi[k] = h;
    lo[k] = cpu::float_to_bf16(x[k] - cpu::bf16_to_float(h));  // exact for finite x below bf16's largest
  }
  for (int64_t k = K; k < padded; ++k) hi[k] = lo[k] = 0;
}

Bf16x3Weight::Bf16x3Weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.numel() > 0,
              "Bf16x3Weight: expected a non-empty CPU float32 [out, in] weight; got ", weight.sizes(), " ",
              weight.scalar_type(), " on ", weight.device());
  out_ = weight.size(0);
  in_ = weight.size(1);
  padded_in_ = round_up(in_, 2);
  at::Tensor hi = at::zeros({out_, padded_in_}, weight.options().dtype(at::kBFloat16));
  at::Tensor lo = at::zeros_like(hi);
  hi.narrow(1, 0, in_).copy_(weight);
  lo.narrow(1, 0, in_).copy_(weight.sub(hi.narrow(1, 0, in_).to(at::kFloat)));
  hi_ = amx::pack_transposed_panels(hi);
  lo_ = amx::pack_transposed_panels(lo);
}

Bf16x3Rows split_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "bf16x3 split_rows: expected a CPU float32 input; got ", x.scalar_type(), " on ", x.device());
  const at::Tensor rows = x.contiguous();
  const int64_t K = x.size(-1), padded = round_up(K, 2), M = K == 0 ? 0 : x.numel() / K;
  Bf16x3Rows out;
  out.hi = at::empty({M, padded}, x.options().dtype(at::kBFloat16));
  out.lo = at::empty({M, padded}, x.options().dtype(at::kBFloat16));
  out.leading.assign(x.sizes().begin(), x.sizes().end() - 1);
  out.in_features = K;
  const float* in = rows.const_data_ptr<float>();
  auto* hi = static_cast<uint16_t*>(out.hi.mutable_data_ptr());
  auto* lo = static_cast<uint16_t*>(out.lo.mutable_data_ptr());
  at::parallel_for(0, M, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) split_row(in + r * K, K, padded, hi + r * padded, lo + r * padded);
  });
  return out;
}

at::Tensor bf16x3_linear(const Bf16x3Rows& x, const Bf16x3Weight& weight, const at::Tensor& bias) {
  TORCH_CHECK(weight.defined() && x.in_features == weight.in_features(),
              "bf16x3_linear: input has ", x.in_features, " features, the weight takes ", weight.in_features());
  const int64_t M = x.hi.size(0), N = weight.out_features(), K = weight.padded_in();
  const int64_t leading_rows = std::accumulate(x.leading.begin(), x.leading.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(x.hi.scalar_type() == at::kBFloat16 && x.hi.is_contiguous() && x.hi.dim() == 2 && x.hi.size(1) == K &&
                  x.lo.sizes() == x.hi.sizes() && x.lo.scalar_type() == at::kBFloat16 && x.lo.is_contiguous() &&
                  leading_rows == M,
              "bf16x3_linear: rows not as split_rows makes them");
  const int64_t columns = round_up(N, amx::kPanel), panels = columns / amx::kPanel;
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  at::Tensor out = at::empty({M, columns}, x.hi.options().dtype(at::kFloat));
  const auto* x_hi = static_cast<const uint16_t*>(x.hi.const_data_ptr());
  const auto* x_lo = static_cast<const uint16_t*>(x.lo.const_data_ptr());
  float* c = out.mutable_data_ptr<float>();
  // Panel-major tasks: a thread's range covers few panels, so each weight panel comes from memory about once.
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t panel = t / row_blocks, r0 = (t % row_blocks) * kRowBlock, m = std::min(kRowBlock, M - r0);
      const int64_t offset = panel * K * amx::kPanel;
      float* tile = c + r0 * columns + panel * amx::kPanel;
      // The large term first, then the two corrections into the same float32 accumulators.
      cpublas::brgemm(m, amx::kPanel, K, K, amx::kPanel, columns, false, as_bf16(x_hi + r0 * K),
                      as_bf16(weight.hi() + offset), tile);
      cpublas::brgemm(m, amx::kPanel, K, K, amx::kPanel, columns, true, as_bf16(x_lo + r0 * K),
                      as_bf16(weight.hi() + offset), tile);
      cpublas::brgemm(m, amx::kPanel, K, K, amx::kPanel, columns, true, as_bf16(x_hi + r0 * K),
                      as_bf16(weight.lo() + offset), tile);
    }
    amx::release();
  });
  if (columns != N) out = out.narrow(1, 0, N).contiguous();
  if (bias.defined()) out.add_(bias);
  std::vector<int64_t> sizes = x.leading;
  sizes.push_back(N);
  // Not a view for autograd: the differentiable form returns this from a custom function, whose view outputs
  // may not be modified in place (ATen's matmul returns its reshaped product the same way).
  return at::_unsafe_view(out, sizes);
}

at::Tensor bf16x3_linear(const at::Tensor& x, const Bf16x3Rows& rows, const Bf16x3Weight& tiles,
                         const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(!weight.requires_grad() && !(bias.defined() && bias.requires_grad()),
              "bf16x3_linear: the weight and bias must be frozen (no gradient through the tiles' packing)");
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return bf16x3_linear(rows, tiles, bias);
  return Bf16x3LinearFunction::apply(x, weight, &rows, &tiles, &bias);
}

}  // namespace kvbound::ops
