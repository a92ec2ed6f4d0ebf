#include "ops/rms_norm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/rsqrt.h>
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

// Autograd kernel: when a gradient is needed (a student forward while training) the ATen composition
// runs, so ATen's autograd differentiates it; otherwise the device kernel (fused on CUDA) runs.
at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) return rms_norm_reference(x, weight, eps);
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return rms_norm_op().call(x, weight, eps);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return rms_norm_op().call(x, weight, eps); }

}  // namespace kvbound::ops

TORCH_LIBRARY_FRAGMENT(kvbound, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvbound, Autograd, m) { m.impl("rms_norm", &kvbound::ops::rms_norm_autograd); }
