// Compiled with the ops layer's include root (tests/CMakeLists.txt): a modules/ header is above ops, so this
// include must not resolve. build.layering_blocks_upward_includes checks the compiler says so.
#include "modules/kv_cache.h"
