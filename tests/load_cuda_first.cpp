// Loads the CUDA module (and with it libtorch_cuda) before any test runs. ATen looks its CUDA hooks up once
// per process and keeps what it found: a test that seeds or asks at::hasCUDA() before the module is loaded
// would leave the CPU stub in place for every later test, and each CUDA test would skip on a GPU machine.
#include "ops/cuda_module.h"

namespace {

const bool cuda_module_loaded_at_start = kvbound::load_cuda_kernels();

}  // namespace
