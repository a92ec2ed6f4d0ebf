// The C library heap of a kvbound process. A forward over 512 tokens allocates and frees tensors of up to
// ~100 MiB per op; glibc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
// mmaps and trims the heap top on free, so each op gets pages back from the kernel that it must fault in and
// zero again (about 10% of a forward's time went to the kernel, mostly page faults). Keeping freed memory in
// the process instead made the SmolLM2 forward 13–16% faster at one thread (DESIGN.md, Conventions). The cost:
// the resident size stays at its high-water mark until exit. Torch-free.
#pragma once
#include <string>

namespace kvbound {

// Serve every block below 1 GiB from the heap and never trim it, unless the user set a glibc.malloc tunable
// (GLIBC_TUNABLES): theirs wins. Returns whether it changed the heap's settings. Call once, first thing in main.
bool keep_freed_memory_in_process();

// Whether a GLIBC_TUNABLES value sets any glibc.malloc.* tunable.
bool sets_malloc_tunable(const std::string& glibc_tunables);

}  // namespace kvbound
