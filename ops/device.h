// The compute device of a run, resolved once from its text ("cpu", "cuda", "cuda:N"): the backbone, the
// trained modules, caches, policy state, losses and optimizer state all live there; tensors cross to the
// CPU only at file I/O. CUDA is usable only where the CUDA kernels module loads (ops/cuda_module.h: an
// NVIDIA driver, libtorch_cuda) and the device index exists.
#pragma once
#include <c10/core/Device.h>

#include <string>

namespace kvbound {

// kvbound::Error "WHERE: ..." (one line; `where` names the option or config key, e.g. "config: model.device")
// for an unknown spelling, or a CUDA device this machine does not have (saying why: no driver, no CUDA
// build, index out of range).
c10::Device resolve_device(const std::string& spec, const std::string& where);

}  // namespace kvbound
