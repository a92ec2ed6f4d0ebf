#include "ops/rms_norm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/rsqrt.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace kvbound::ops {

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
  return weight * normed.to(x.scalar_type());
}

namespace {

const auto& rms_norm_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvbound::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

// The device kernel forward and the fused input gradient backward; only x and the weight are saved.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    return rms_norm_op().call(x, weight, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    return {rms_norm_input_gradient(grad_outputs[0], saved[0], saved[1], ctx->saved_data["eps"].toDouble()), {}, {}};
  }
};

// Autograd kernel: when only the input needs a gradient (a student forward through the frozen backbone) and the
// CPU has a fused backward for it, RmsNormFunction; when a gradient is needed otherwise (a trained weight, or
// CUDA) the ATen composition runs, so ATen's autograd differentiates it; without a gradient the device kernel.
at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    if (!weight.requires_grad() && rms_norm_input_gradient_fused(x, weight)) return RmsNormFunction::apply(x, weight, eps);
    return rms_norm_reference(x, weight, eps);
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return rms_norm_op().call(x, weight, eps);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_op().call(x, weight, eps); }

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvbound, Autograd, m) { m.impl("rms_norm", &kvbound::ops::rms_norm_autograd); }
