// Moving a module's tensors to the run's device while keeping trainable ones leaves: `.to()` of a tensor
// that requires grad would return a non-leaf whose gradient never reaches the optimizer.
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound {

// `t` on `device`, a leaf that requires grad exactly when `t` did (`t` itself when already there).
inline at::Tensor to_device_as_leaf(const at::Tensor& t, c10::Device device) {
  if (!t.defined() || t.device() == device) return t;
  at::Tensor moved = t.detach().to(device);
  moved.set_requires_grad(t.requires_grad());
  return moved;
}

}  // namespace kvbound
