// Whole-file safetensors I/O for tensors kvbound owns: gate exports (`gates.safetensors`) and run
// checkpoints. The backbone loader (checkpoints/model_loader.h) maps and views weights instead; this
// reader copies, so the file may be replaced (atomically) while its tensors are still in use.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>

#include "checkpoints/safetensors_format.h"

namespace kvbound {

// The tensor dtype of a safetensors dtype.
at::ScalarType st_torch_dtype(StDtype dtype);

// Writes CPU tensors (float32 / float16 / bfloat16; any strides) and a string→string metadata map
// (the header's "__metadata__", omitted when empty) as one safetensors file, atomically
// (checkpoints/atomic_file.h). The JSON header lists tensors by name; the data holds them by element
// size, then name, starting 8-byte aligned, so every tensor is aligned to its element size with no gaps.
// Throws kvbound::Error "path: tensor: what" for an undefined, non-CPU or unsupported-dtype tensor, or a
// tensor named "__metadata__", before anything is written; and "path: what" on an I/O failure.
void write_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

struct SafetensorsFile {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Reads a whole safetensors file into owned, contiguous CPU tensors in their stored dtype, validated by
// parse_safetensors. Throws kvbound::Error naming the file (and the tensor) when it is missing or malformed.
SafetensorsFile read_safetensors(const std::string& path);

}  // namespace kvbound
