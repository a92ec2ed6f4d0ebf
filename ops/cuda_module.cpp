#include "ops/cuda_module.h"

#include <dlfcn.h>

namespace kvbound {

namespace {

void* module_handle = nullptr;  // set once, by load_cuda_kernels

}  // namespace

bool load_cuda_kernels(std::string* why) {
#ifdef KVBOUND_CUDA_MODULE
  static std::string failure;
  static const bool loaded = [] {
    // The driver library exists only where a GPU can run; without it libtorch_cuda is dead weight.
    if (::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_GLOBAL) == nullptr) {
      failure = "no NVIDIA driver (libcuda.so.1) on this machine";
      return false;
    }
    module_handle = ::dlopen(KVBOUND_CUDA_MODULE, RTLD_NOW | RTLD_GLOBAL);
    if (module_handle == nullptr) {
      const char* err = ::dlerror();
      failure = std::string("cannot load ") + KVBOUND_CUDA_MODULE + ": " + (err ? err : "unknown error");
      return false;
    }
    return true;
  }();
  if (!loaded && why) *why = failure;
  return loaded;
#else
  if (why) *why = "this build has no CUDA kernels (KVBOUND_CUDA=OFF or no nvcc)";
  return false;
#endif
}

void* cuda_module_symbol(const char* name) {
  return module_handle == nullptr ? nullptr : ::dlsym(module_handle, name);
}

}  // namespace kvbound
