// ProcessGroupNCCL for data-parallel training on CUDA devices (train/data_parallel.cpp), built into the CUDA
// module because libtorch_cuda provides it; the main program finds the factory with cuda_module_symbol().
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <chrono>

// A new NCCL group of `world` ranks over `store` (a c10::intrusive_ptr<c10d::Store>*), as an owning raw
// c10d::Backend pointer (the caller reclaims it into an intrusive_ptr).
extern "C" void* kvbound_make_nccl_backend(const void* store, int rank, int world, long timeout_ms) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = std::chrono::milliseconds(timeout_ms);
  const auto& shared_store = *static_cast<const c10::intrusive_ptr<c10d::Store>*>(store);
  c10::intrusive_ptr<c10d::Backend> group = c10::make_intrusive<c10d::ProcessGroupNCCL>(shared_store, rank, world, options);
  return group.release();
}
