// Loads a llama.cpp GGUF checkpoint of a Llama-family decoder (general.architecture llama,
// mistral, qwen2 or qwen3) as Hugging Face-named tensors: dequantized, q/k rows back in HF's
// rotate-half order, every tensor's presence and shape checked against the metadata.
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

#include "checkpoints/gguf.h"
#include "checkpoints/weights.h"
#include "checkpoints/model_config.h"

namespace kvbound {

// The architecture described by `file`'s metadata (<arch>.embedding_length, ...), validated. What
// metadata lacks comes from the tensors: a tied head (no output.weight), q/k/v biases
// (blk.0.attn_q.bias) and Llama-3.1 RoPE scaling (the rope_freqs.weight divisors).
ModelConfig gguf_model_config(const GgufFile& file);

// Every backbone tensor of the GGUF at `path` in `dtype` (float32/float16/bfloat16). Tensors
// stored in that dtype and not permuted view the read-only memory map (never write to them in
// place); others are decoded into new memory.
// Throws kvbound::Error("path: tensor: ...") for a missing, extra, misshapen or unsupported tensor.
LoadedCheckpoint load_gguf_checkpoint(const std::string& path, at::ScalarType dtype);

}  // namespace kvbound
