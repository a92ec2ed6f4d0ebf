// Counting CPU allocator for tests and benchmarks that bound how much memory an op allocates
// (shared by tests/test_retention_ops.cpp and bench/bench_retention_ops.cpp).
#pragma once
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace kvbound::test {

// Wraps the CPU allocator and tracks the bytes alive through it and their peak, from every thread. Each block's
// context is its data pointer, as raw_allocate requires (oneDNN's scratch memory comes that way), so the sizes are
// looked up by pointer. One instance at a time (CountCpuAllocations keeps a static one).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  explicit CountingCpuAllocator(c10::Allocator* inner) : inner_(inner) { instance_ = this; }

  c10::DataPtr allocate(size_t bytes) override {
    c10::DataPtr block = inner_->allocate(bytes);
    void* data = block.get();
    const c10::Device device = block.device();
    if (data == nullptr) return block;  // an empty block: nothing to count
    const int64_t live = live_ += static_cast<int64_t>(bytes);
    for (int64_t peak = peak_; live > peak && !peak_.compare_exchange_weak(peak, live);) {
    }
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      blocks_.emplace(data, Block{std::move(block), bytes});
    }
    return {data, data, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  // Peak bytes alive since the last reset, above what was alive at the reset.
  int64_t peak_since_reset() const { return peak_ - baseline_; }
  void reset_peak() { peak_ = baseline_ = live_.load(); }

 private:
  struct Block {
    c10::DataPtr inner;
    size_t bytes;
  };
  static void release(void* data) {
    CountingCpuAllocator* self = instance_;
    Block block;
    {
      const std::lock_guard<std::mutex> lock(self->mutex_);
      auto it = self->blocks_.find(data);
      if (it == self->blocks_.end()) return;
      block = std::move(it->second);
      self->blocks_.erase(it);
    }
    self->live_ -= static_cast<int64_t>(block.bytes);
  }  // block.inner frees through the wrapped allocator here

  static inline CountingCpuAllocator* instance_ = nullptr;
  c10::Allocator* inner_;
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
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
