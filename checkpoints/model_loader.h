// Loads a backbone checkpoint from a Hugging Face folder (config.json + single or sharded safetensors)
// or a GGUF file, into Hugging Face tensor names and the requested compute dtype.
#pragma once
#include <c10/core/ScalarType.h>

#include <string>

#include "checkpoints/weights.h"

namespace kvbound {

// `path` is a folder holding config.json, or a .gguf file. dtype: kFloat or kBFloat16.
LoadedCheckpoint load_checkpoint(const std::string& path, at::ScalarType dtype);

// config.json of a Llama/Mistral/Qwen2/Qwen3 model (transformers 4.x and 5.x spellings).
ModelConfig read_hf_config(const std::string& config_path);

}  // namespace kvbound
