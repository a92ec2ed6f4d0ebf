// `kvbound export --format trimkv`: a TRIM-KV run as the folder the official TRIM-KV release (PyPI `trimkv`,
// 0.1.5) loads with `TrimKV<Arch>ForCausalLM.from_pretrained(FOLDER, load_trimkv_weights=True,
// download_from="local")`:
//   trimkv_weights.pth  the gate tensors under their official names, written by LibTorch's pickler (torch.load
//                       reads it, weights_only included)
//   config.json         the backbone's Hugging Face config plus the official fields: base_model (the
//                       backbone's name: a hub id or folder there, else override it with base_model=...),
//                       trainable_params "retention_gate", retention_gate "rg", retention_gate_intermediate_size,
//                       retention_gate_bias_init, memory_size (M_train), buffer_size, compress_memory; and
//                       "kvbound" (method, step, config hash, the backbone's content hash) for provenance.
#pragma once
#include <map>
#include <string>

#include <ATen/core/Tensor.h>

namespace kvbound {

// Writes the folder `out` (replaced as a whole: a half-written folder never stays) from an export's or
// checkpoint's gate tensors and metadata. kvbound::Error naming `source` when the metadata lacks what the
// official config needs (a run from before backbone_config was recorded, or not a trimkv run).
void write_trimkv_official_folder(const std::map<std::string, at::Tensor>& gates,
                                  const std::map<std::string, std::string>& metadata, const std::string& source,
                                  const std::string& out);

}  // namespace kvbound
