// Exported by the CUDA module for programs that link only the CPU LibTorch (bench/bench_cuda_ops.cpp, the device
// tests): a device barrier, so that a host clock read after it has timed the device's work, the caching
// allocator's peak, and c10's sync debug mode.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

extern "C" void kvbound_cuda_synchronize() { C10_CUDA_CHECK(cudaDeviceSynchronize()); }

// Bytes allocated now, and the most allocated at once since the last reset (which this call performs).
extern "C" void kvbound_cuda_memory(long* allocated, long* peak_since_reset) {
  namespace allocator = c10::cuda::CUDACachingAllocator;
  const auto device = c10::cuda::current_device();
  const auto stats = allocator::getDeviceStats(device);
  const auto all = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  *allocated = static_cast<long>(stats.allocated_bytes[all].current);
  *peak_since_reset = static_cast<long>(stats.allocated_bytes[all].peak);
  allocator::resetPeakStats(device);
}

// c10's sync debug mode: 0 off, 1 warn, 2 error. At 2 every operation that makes the host wait for the device (a
// device-to-host copy, .item(), a host-to-device copy from pageable memory, a synchronisation) throws c10::Error.
extern "C" void kvbound_cuda_sync_debug(int mode) {
  c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(mode));
}
