// A loaded checkpoint: the architecture plus every backbone tensor under its Hugging Face name
// (model.layers.N.self_attn.q_proj.weight, ...), in [out_features, in_features] layout, with
// q/k rows in rotate-half order. Tensors may view a memory-mapped file (kept alive by them).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoints/model_config.h"

namespace kvbound {

struct LoadedCheckpoint {
  ModelConfig config;
  std::map<std::string, at::Tensor> tensors;
  std::string source;  // path it came from, for error messages
  std::string format;  // "safetensors" or "gguf"
  std::string name;    // the model's own name (config.json _name_or_path, GGUF general.name), else the path's stem
  std::vector<std::string> weight_files;  // the files the tensors came from, in load order (content identity)
  std::map<std::string, std::int64_t> stored_types;  // on-disk dtype/quant type -> tensor count (for `info`)
};

}  // namespace kvbound
