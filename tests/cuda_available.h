// Why the CUDA tests cannot run here, or "" when they can: the CUDA module did not load (no NVIDIA driver, or a
// build without CUDA) or LibTorch sees no device. They run in scripts/gpu_check.sh and skip elsewhere.
#pragma once
#include <ATen/Context.h>

#include <string>

#include "ops/cuda_module.h"

namespace kvbound::test {

inline std::string why_no_cuda() {
  std::string why;
  if (!load_cuda_kernels(&why)) return why;
  if (!at::hasCUDA()) return "no CUDA device on this machine";
  return "";
}

}  // namespace kvbound::test
