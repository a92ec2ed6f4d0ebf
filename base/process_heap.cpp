#include "base/process_heap.h"

#include <malloc.h>

#include <cstdlib>

namespace kvbound {

bool sets_malloc_tunable(const std::string& glibc_tunables) {
  return glibc_tunables.find("glibc.malloc.") != std::string::npos;
}

bool keep_freed_memory_in_process() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && sets_malloc_tunable(tunables)) return false;
  constexpr int kOneGiB = 1 << 30;
  // Both calls only fail on values glibc rejects; 1 GiB is within what glibc 2.36 accepts for either.
  return mallopt(M_MMAP_THRESHOLD, kOneGiB) == 1 && mallopt(M_TRIM_THRESHOLD, kOneGiB) == 1;
}

}  // namespace kvbound
