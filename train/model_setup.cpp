#include "train/model_setup.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <thread>

#include "checkpoints/errors.h"
#include "checkpoints/safetensors_io.h"
#include "modules/indexer.h"
#include "modules/latent_memory.h"
#include "modules/retention_gate.h"
#include "train/commands.h"

namespace kvbound {

void add_model_keys(ConfigSchema& s) {
  s.add("model.path", ConfigType::String, yaml_quote(default_model_path()), "HF folder or .gguf file (frozen backbone)")
      .add("model.tokenizer", ConfigType::String, "\"\"", "tokenizer file (empty: the one beside model.path)")
      .add("model.dtype", ConfigType::String, "float32", "compute dtype: float32 | bfloat16")
      .add("model.threads", ConfigType::Int, "0", "CPU threads (0 = all cores)");
}

ConfiguredModel load_configured_model(const Config& config) {
  const std::int64_t threads = config.get_int("model.threads");
  if (threads < 0) fail("config", "model.threads", "must be >= 0");
  at::set_num_threads(threads > 0 ? static_cast<int>(threads)
                                  : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  const std::string dtype = config.get_string("model.dtype");
  if (dtype != "float32" && dtype != "bfloat16") fail("config", "model.dtype", "'" + dtype + "' (float32, bfloat16)");
  ConfiguredModel m;
  m.model_path = config.get_string("model.path");
  m.tokenizer_path = config.get_string("model.tokenizer").empty() ? find_tokenizer_beside(m.model_path)
                                                                  : config.get_string("model.tokenizer");
  m.tokenizer = load_tokenizer(m.tokenizer_path);
  m.model = Backbone::load(m.model_path, dtype == "float32" ? at::kFloat : at::kBFloat16);
  return m;
}

void add_policy_keys(ConfigSchema& s) {
  s.add("policy.sinks", ConfigType::Int, "4", "streaming_llm: attention-sink tokens always kept")
      .add("policy.recent", ConfigType::Int, "8", "h2o: most recent tokens always kept")
      .add("policy.snapkv_window", ConfigType::Int, "32", "snapkv: observation window (last queries)")
      .add("policy.snapkv_pool", ConfigType::Int, "5", "snapkv: average-pool width over key positions (odd)")
      .add("indexmem.recent", ConfigType::Int, "8", "indexmem policy: most recent tokens always kept")
      .add("indexmem.stat", ConfigType::String, "mean", "indexmem policy: running statistic of a key's scores: mean | max")
      .add("indexmem.horizon", ConfigType::Int, "16",
           "indexmem policy, stat mean: decay older queries' scores by a = 1 - 1/H (0: every query weighs the same)")
      .add("indexmem.pre_evict", ConfigType::Bool, "true",
           "indexmem policy: evict before a chunk's attention (false: after it, like h2o)");
}

PolicyOptions configured_policy_options(const Config& c) {
  PolicyOptions o;
  o.sinks = c.get_int("policy.sinks");
  o.recent = c.get_int("policy.recent");
  o.snapkv_window = c.get_int("policy.snapkv_window");
  o.snapkv_pool = c.get_int("policy.snapkv_pool");
  if (o.sinks < 0) fail("config", "policy.sinks", "must be >= 0");
  if (o.recent < 0) fail("config", "policy.recent", "must be >= 0");
  if (o.snapkv_window < 1) fail("config", "policy.snapkv_window", "must be >= 1");
  if (o.snapkv_pool < 1 || o.snapkv_pool % 2 == 0) fail("config", "policy.snapkv_pool", "must be odd and >= 1");
  o.indexmem_recent = c.get_int("indexmem.recent");
  o.indexmem_stat = c.get_string("indexmem.stat");
  o.indexmem_horizon = c.get_int("indexmem.horizon");
  o.indexmem_pre_evict = c.get_bool("indexmem.pre_evict");
  if (o.indexmem_recent < 0) fail("config", "indexmem.recent", "must be >= 0");
  return o;
}

namespace {

// Runs `load`, naming the config key that pointed at the file in front of its error.
template <class Load>
auto under_key(const std::string& key, Load&& load) {
  try {
    return load();
  } catch (const Error& e) {
    throw Error(key + ": " + e.what());
  }
}

}  // namespace

SafetensorsFile read_weights(const std::string& path, const std::string& key) {
  return under_key(key, [&] { return read_safetensors(path); });
}

std::shared_ptr<const RetentionGates> load_gates(const std::string& path, const ModelConfig& config, const std::string& key) {
  return under_key(key, [&] {
    return std::make_shared<const RetentionGates>(RetentionGates::from_tensors(read_safetensors(path).tensors, config, path));
  });
}

std::shared_ptr<const Indexer> load_indexer(const std::string& path, const ModelConfig& config, const std::string& key) {
  return under_key(key, [&] {
    const SafetensorsFile file = read_safetensors(path);
    return std::make_shared<const Indexer>(
        Indexer::from_tensors(file.tensors, config, indexer_settings(file.metadata, path), path));
  });
}

std::shared_ptr<const LatentMemory> load_memory(const std::string& path, const ModelConfig& config, const std::string& key,
                                                const std::string& serves) {
  return under_key(key, [&] {
    const SafetensorsFile file = read_safetensors(path);
    const auto trained_under = file.metadata.find("memory_policy");
    if (!serves.empty() && trained_under != file.metadata.end() && trained_under->second != serves)
      fail(path, "memory_policy", "this memory was trained under '" + trained_under->second + "', not '" + serves + "'");
    return std::make_shared<const LatentMemory>(LatentMemory::from_tensors(file.tensors, config, path));
  });
}

}  // namespace kvbound
