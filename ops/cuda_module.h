// The CUDA kernels live in a separate module (libkvbound_cuda.so) linked against libtorch_cuda. Loading
// libtorch_cuda costs ~350 MB of resident memory even on a machine without a GPU, so CPU runs never
// load it: programs call load_cuda_kernels() at start-up, which loads the module only when an NVIDIA
// driver (libcuda.so.1) is present. It must run before the process's first autograd or device query:
// ATen picks its CUDA hooks once, and a process that did so without libtorch_cuda never sees a GPU.
#pragma once
#include <string>

namespace kvbound {

// True when the CUDA kernels are registered (loaded now or before). False, with the reason in
// `*why` when given, when this build has no CUDA module, no driver is present, or loading failed.
bool load_cuda_kernels(std::string* why = nullptr);

// A C symbol the loaded CUDA module exports (e.g. "kvbound_make_nccl_backend", the ProcessGroupNCCL factory of
// data-parallel training on CUDA devices); null when the module is not loaded or lacks it.
void* cuda_module_symbol(const char* name);

}  // namespace kvbound
