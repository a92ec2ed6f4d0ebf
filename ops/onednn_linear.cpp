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

// The forward and the input gradient on oneDNN; only W is saved (W is frozen, so x is not needed).
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor* bias) {
    ctx->save_for_backward({weight});
    return product(x, weight, *bias);  // the bias by pointer: it may be undefined, which apply rejects
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    return {product(grad_outputs[0], weight.t(), {}), {}, {}};
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
  TORCH_CHECK(!weight.requires_grad() && !(bias.defined() && bias.requires_grad()),
              "onednn::linear: the weight and bias must be frozen");
  if (!(at::GradMode::is_enabled() && x.requires_grad())) return product(x, weight, bias);
  return LinearFunction::apply(x, weight, &bias);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "onednn::mm: expected [M, K] and [K, N]; got ", a.sizes(), " and ",
              b.sizes());
  check_operands(a, b.t(), "mm");
  return product(a, b.t(), {});
}

}  // namespace kvbound::ops::onednn
