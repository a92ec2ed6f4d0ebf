#include "ops/onednn_linear.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace kvbound::ops::onednn {
namespace {

using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   std::string_view, c10::List<std::optional<c10::Scalar>>,
                                   std::optional<std::string_view>);

// The op's handle, or nullopt where this LibTorch has no oneDNN linear.
const std::optional<c10::TypedOperatorHandle<LinearPointwise>>& linear_pointwise() {
  static const std::optional<c10::TypedOperatorHandle<LinearPointwise>> handle =
      []() -> std::optional<c10::TypedOperatorHandle<LinearPointwise>> {
    if (!at::hasMKLDNN()) return std::nullopt;
    const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!op) return std::nullopt;
    return op->typed<LinearPointwise>();
  }();
  return handle;
}

bool intel_cpu() {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  return ebx == 0x756e6547 && edx == 0x49656e69 && ecx == 0x6c65746e;  // "Genu" "ineI" "ntel"
#else
  return false;
#endif
}

at::Tensor product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const std::optional<at::Tensor> b = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  return linear_pointwise()->call(x, weight, b, "none", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
}

// The forward and every gradient on oneDNN: dX = dY·W, dW = dYᵀ·X (as a product whose "weight" is Xᵀ, a strided
// view oneDNN reads as is), db = Σ dY over rows. Saves W when x needs a gradient, x when W does.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  // The bias as an optional: apply takes an undefined one as "no input" (an undefined Tensor it rejects).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    ctx->saved_data["bias_grad"] = bias.has_value() && bias->requires_grad();
    ctx->save_for_backward({x.requires_grad() ? weight : at::Tensor(), weight.requires_grad() ? x : at::Tensor()});
    return product(x, weight, bias.value_or(at::Tensor()));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[0];
    const at::Tensor& x = saved[1];
    const at::Tensor& dy = grad_outputs[0];
    const int64_t N = dy.size(-1);
    const at::Tensor dy_rows = dy.reshape({-1, N});
    at::Tensor dx, dw, db;
    if (weight.defined()) dx = product(dy, weight.t(), {});
    if (x.defined()) dw = product(dy_rows.t(), x.reshape({-1, x.size(-1)}).t(), {});
    if (ctx->saved_data["bias_grad"].toBool()) db = dy_rows.sum(0);
    return {dx, dw, db};
  }
};

void check_operands(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(linear_pointwise().has_value(), "onednn::", what, ": this LibTorch has no oneDNN linear");
  TORCH_CHECK(x.is_cpu() && weight.is_cpu() && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1),
              "onednn::", what, ": expected float32 CPU x [..., K] and W [N, K]; got ", x.sizes(), " ",
              x.scalar_type(), " and ", weight.sizes(), " ", weight.scalar_type());
}

}  // namespace

bool available() { return linear_pointwise().has_value(); }

bool float32_preferred() {
  static const bool preferred = !intel_cpu() && __builtin_cpu_supports("avx512f") && linear_pointwise().has_value();
  return preferred;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check_operands(x, weight, "linear");
  TORCH_CHECK(!bias.defined() || (bias.is_cpu() && bias.scalar_type() == at::kFloat && bias.dim() == 1 &&
                                   bias.size(0) == weight.size(0)),
              "onednn::linear: expected a float32 CPU bias [", weight.size(0), "]; got ", bias.sizes());
  const bool needs_grad =
      x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad());
  if (!(at::GradMode::is_enabled() && needs_grad)) return product(x, weight, bias);
  return LinearFunction::apply(x, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt);
}

at::Tensor preferred_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const auto float32_cpu = [](const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; };
  if (float32_cpu(x) && float32_cpu(weight) && (!bias.defined() || float32_cpu(bias)) && float32_preferred())
    return linear(x, weight, bias);
  return at::linear(x, weight, bias);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "onednn::mm: expected [M, K] and [K, N]; got ", a.sizes(), " and ",
              b.sizes());
  check_operands(a, b.t(), "mm");
  return product(a, b.t(), {});
}

}  // namespace kvbound::ops::onednn
