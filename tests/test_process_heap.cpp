// base/process_heap.h: after keep_freed_memory_in_process a large block comes from the heap (not a fresh mmap)
// and freeing it does not hand the pages back; a user's glibc.malloc tunable is left alone.
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "base/process_heap.h"

namespace kvbound {
namespace {

constexpr std::size_t kBlock = std::size_t{64} << 20;  // above glibc's largest dynamic mmap threshold (32 MiB)

// Allocates a block the compiler may not elide (a malloc/free pair with nothing between may be removed).
void* allocate_and_touch() {
  void* p = std::malloc(kBlock);
  std::memset(p, 1, kBlock);
  asm volatile("" : : "r"(p) : "memory");
  return p;
}

void release(void* p) {
  asm volatile("" : : "r"(p) : "memory");
  std::free(p);
}

// Runs in a forked child (the heap settings are process-wide): exit code 0 when every expectation held.
[[noreturn]] void check_heap_reuse() {
  unsetenv("GLIBC_TUNABLES");
  const auto mmapped_blocks = [] { return mallinfo2().hblks; };
  std::size_t before = mmapped_blocks();
  void* p = allocate_and_touch();
  const bool default_mmaps = mmapped_blocks() == before + 1;
  release(p);
  const bool changed = keep_freed_memory_in_process();
  before = mmapped_blocks();
  p = allocate_and_touch();
  const bool from_heap = mmapped_blocks() == before;
  release(p);
  const bool kept = mallinfo2().arena >= kBlock;  // the heap was not trimmed back below the freed block
  std::exit((default_mmaps ? 0 : 1) | (changed ? 0 : 2) | (from_heap ? 0 : 4) | (kept ? 0 : 8));
}

TEST(ProcessHeap, LargeBlocksComeFromTheHeapAndStayThereAfterFree) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(check_heap_reuse(), ::testing::ExitedWithCode(0), "");
}

TEST(ProcessHeap, AUsersMallocTunableWins) {
  EXPECT_TRUE(sets_malloc_tunable("glibc.malloc.trim_threshold=1"));
  EXPECT_TRUE(sets_malloc_tunable("glibc.cpu.hwcaps=-AVX2:glibc.malloc.mmap_max=0"));
  EXPECT_FALSE(sets_malloc_tunable("glibc.cpu.hwcaps=-AVX2"));
  EXPECT_FALSE(sets_malloc_tunable(""));
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072", 1);
        std::exit(keep_freed_memory_in_process() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace kvbound
