// Counting CPU allocator for tests and benchmarks that bound how much memory an op allocates
// (shared by tests/test_retention_ops.cpp and bench/bench_retention_ops.cpp).
#pragma once
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>

namespace kvbound::test {

// Wraps the CPU allocator and tracks the bytes alive through it and their peak, from every thread.
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr block = inner_->allocate(bytes);
    void* data = block.get();
    const c10::Device device = block.device();
    const int64_t live = live_ += static_cast<int64_t>(bytes);
    for (int64_t peak = peak_; live > peak && !peak_.compare_exchange_weak(peak, live);) {
    }
    return {data, new Allocation{std::move(block), bytes, this}, &release, device};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Peak bytes alive since the last reset, above what was alive at the reset.
  int64_t peak_since_reset() const { return peak_ - baseline_; }
  void reset_peak() { peak_ = baseline_ = live_.load(); }

 private:
  struct Allocation {
    c10::DataPtr block;
    size_t bytes;
    CountingCpuAllocator* owner;
  };
  static void release(void* ctx) {
    auto* allocation = static_cast<Allocation*>(ctx);
    allocation->owner->live_ -= static_cast<int64_t>(allocation->bytes);
    delete allocation;
  }

  c10::Allocator* inner_;
  std::atomic<int64_t> live_{0}, peak_{0};
  int64_t baseline_ = 0;
};

// Installs a CountingCpuAllocator as the CPU allocator for the scope. It stays alive afterwards (static):
// tensors allocated through it may outlive the scope and free through it.
class CountCpuAllocations {
 public:
  CountCpuAllocations() : previous_(c10::GetCPUAllocator()) {
    static CountingCpuAllocator counter(c10::GetDefaultCPUAllocator());
    counter_ = &counter;
    counter_->reset_peak();
    c10::SetCPUAllocator(counter_, kPriority);
  }
  ~CountCpuAllocations() { c10::SetCPUAllocator(previous_, kPriority); }
  int64_t peak_bytes() const { return counter_->peak_since_reset(); }

 private:
  static constexpr uint8_t kPriority = 100;  // above the default allocator's registration
  c10::Allocator* previous_;
  CountingCpuAllocator* counter_;
};

}  // namespace kvbound::test
