#include "checkpoints/model_loader.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "checkpoints/gguf_checkpoint.h"
#include "base/mapped_file.h"
#include "checkpoints/safetensors_format.h"

namespace kvbound {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path, "", "cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path, "", std::string("invalid JSON: ") + e.what());
  }
}

template <typename T>
T get_or(const json& j, const char* key, T fallback, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    fail(path, key, "has the wrong type");
  }
}

// Views every tensor of one safetensors file in place; converts to `dtype` only where they differ,
// so an F32 file used in F32 is never copied (the mapping lives as long as the tensors).
void load_safetensors_file(const std::string& path, at::ScalarType dtype, LoadedCheckpoint& ck,
                           const std::set<std::string>* only) {
  auto& out = ck.tensors;
  auto file = MappedFile::open(path);
  const SafetensorsHeader header = parse_safetensors(file->data(), file->size(), path);
  for (const auto& [name, info] : header.tensors) {
    if (only != nullptr && !only->count(name)) continue;
    if (out.count(name)) fail(path, name, "tensor appears in more than one shard");
    const auto src_dtype = st_torch_dtype(info.dtype);
    const auto elem = st_dtype_size(info.dtype);
    void* ptr = const_cast<std::uint8_t*>(file->data() + info.begin);  // read-only: weights are frozen
    at::Tensor view;
    if (reinterpret_cast<std::uintptr_t>(ptr) % elem == 0) {
      view = at::from_blob(ptr, info.shape, [file](void*) {}, at::TensorOptions().dtype(src_dtype));
    } else {  // the format does not promise alignment: copy the bytes once into aligned memory
      view = at::empty(info.shape, at::TensorOptions().dtype(src_dtype));
      std::memcpy(view.data_ptr(), ptr, info.nbytes);
    }
    out.emplace(name, src_dtype == dtype ? view : view.to(dtype));
    ++ck.stored_types[st_dtype_name(info.dtype)];
  }
}

}  // namespace

ModelConfig read_hf_config(const std::string& config_path) {
  const json j = read_json_file(config_path);
  if (!j.is_object()) fail(config_path, "", "not a JSON object");
  ModelConfig c;
  c.architecture = get_or<std::string>(j, "model_type", "", config_path);
  static const std::set<std::string> known = {"llama", "mistral", "qwen2", "qwen3"};
  if (!known.count(c.architecture))
    fail(config_path, "model_type", "unsupported '" + c.architecture + "' (llama, mistral, qwen2, qwen3)");
  c.vocab_size = get_or<std::int64_t>(j, "vocab_size", 0, config_path);
  c.hidden_size = get_or<std::int64_t>(j, "hidden_size", 0, config_path);
  c.intermediate_size = get_or<std::int64_t>(j, "intermediate_size", 0, config_path);
  c.num_layers = get_or<std::int64_t>(j, "num_hidden_layers", 0, config_path);
  c.num_heads = get_or<std::int64_t>(j, "num_attention_heads", 0, config_path);
  c.num_kv_heads = get_or<std::int64_t>(j, "num_key_value_heads", c.num_heads, config_path);
  c.head_dim = get_or<std::int64_t>(j, "head_dim", c.num_heads > 0 ? c.hidden_size / c.num_heads : 0, config_path);
  c.max_position_embeddings = get_or<std::int64_t>(j, "max_position_embeddings", 0, config_path);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6, config_path);
  c.hidden_act = get_or<std::string>(j, "hidden_act", "silu", config_path);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, config_path);
  c.attention_bias = c.architecture == "qwen2" || get_or<bool>(j, "attention_bias", false, config_path);
  c.qk_norm = c.architecture == "qwen3";
  c.bos_token_id = get_or<std::int64_t>(j, "bos_token_id", -1, config_path);
  if (j.contains("eos_token_id") && j["eos_token_id"].is_array())
    c.eos_token_id = j["eos_token_id"].empty() ? -1 : j["eos_token_id"][0].get<std::int64_t>();
  else
    c.eos_token_id = get_or<std::int64_t>(j, "eos_token_id", -1, config_path);
  // RoPE: transformers 5 writes "rope_parameters"; 4.x writes rope_theta + "rope_scaling".
  c.rope_theta = get_or<double>(j, "rope_theta", 10000.0, config_path);
  json rope = json::object();
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) rope = j["rope_parameters"];
  else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) rope = j["rope_scaling"];
  if (rope.contains("rope_theta")) c.rope_theta = get_or<double>(rope, "rope_theta", c.rope_theta, config_path);
  c.rope_scaling.type = get_or<std::string>(rope, "rope_type", get_or<std::string>(rope, "type", "default", config_path),
                                            config_path);
  c.rope_scaling.factor = get_or<double>(rope, "factor", 1.0, config_path);
  c.rope_scaling.low_freq_factor = get_or<double>(rope, "low_freq_factor", 1.0, config_path);
  c.rope_scaling.high_freq_factor = get_or<double>(rope, "high_freq_factor", 4.0, config_path);
  c.rope_scaling.original_max_position_embeddings =
      get_or<std::int64_t>(rope, "original_max_position_embeddings", 8192, config_path);
  c.validate(config_path);
  return c;
}

LoadedCheckpoint load_checkpoint(const std::string& path, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) fail(path, "dtype", "compute dtype must be float32 or bfloat16");
  if (!fs::exists(path)) fail(path, "", "no such file or folder");
  if (!fs::is_directory(path)) {
    if (fs::path(path).extension() == ".gguf") return load_gguf_checkpoint(path, dtype);
    fail(path, "", "expected a Hugging Face folder (config.json + *.safetensors) or a .gguf file");
  }
  LoadedCheckpoint ck;
  ck.source = path;
  ck.format = "safetensors";
  ck.config = read_hf_config((fs::path(path) / "config.json").string());
  const json config = read_json_file((fs::path(path) / "config.json").string());
  const std::string named = config.contains("_name_or_path") && config["_name_or_path"].is_string()
                                ? config["_name_or_path"].get<std::string>() : "";
  ck.name = named.empty() ? fs::path(path).lexically_normal().filename().string() : named;
  if (ck.name.empty()) ck.name = fs::path(path).lexically_normal().parent_path().filename().string();  // "dir/"
  const fs::path index = fs::path(path) / "model.safetensors.index.json";
  const fs::path single = fs::path(path) / "model.safetensors";
  if (fs::exists(index)) {
    const json j = read_json_file(index.string());
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) fail(index.string(), "weight_map", "missing");
    std::map<std::string, std::set<std::string>> by_shard;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) fail(index.string(), "weight_map." + it.key(), "must name a shard file");
      const std::string shard = it.value().get<std::string>();
      if (shard.find('/') != std::string::npos) fail(index.string(), "weight_map." + it.key(), "shard outside the folder");
      by_shard[shard].insert(it.key());
    }
    for (const auto& [shard, names] : by_shard) {
      const std::string shard_path = (fs::path(path) / shard).string();
      load_safetensors_file(shard_path, dtype, ck, &names);
      ck.weight_files.push_back(shard_path);
      for (const auto& n : names)
        if (!ck.tensors.count(n)) fail(shard_path, n, "listed in the index but missing from the shard");
    }
  } else if (fs::exists(single)) {
    load_safetensors_file(single.string(), dtype, ck, nullptr);
    ck.weight_files.push_back(single.string());
  } else {
    fail(path, "", "no model.safetensors or model.safetensors.index.json in the folder");
  }
  return ck;
}

}  // namespace kvbound
