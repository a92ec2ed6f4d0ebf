// Atomic file replacement: the "nothing written half-way" convention (DESIGN.md, "Conventions") for every
// output kvbound writes (eval results and plots, checkpoints, gate exports). Torch-free.
#pragma once
#include <string>

namespace kvbound {

// Replaces `path` with `bytes` so that readers see the old file or the whole new one, never a part:
// writes a temporary file in the same directory, fsyncs it, renames it over `path`, fsyncs the directory.
// Creates missing parent directories. Throws kvbound::Error naming `path` on failure; no temp file stays.
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace kvbound
