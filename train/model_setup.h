// The config keys that `kvbound train` and `kvbound eval` share (model.*, policy.*), and what they make.
#pragma once
#include <memory>
#include <string>

#include "checkpoints/safetensors_io.h"
#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "modules/eviction_policy.h"
#include "train/config.h"

namespace kvbound {

// model.path, model.tokenizer, model.dtype, model.threads.
void add_model_keys(ConfigSchema& schema);

struct ConfiguredModel {
  std::string model_path, tokenizer_path;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Backbone> model;
};

// Sets ATen's thread count (model.threads, 0 = every core), loads the tokenizer (model.tokenizer, else the
// one beside the weights) and the backbone in model.dtype. Bad values are kvbound::Error naming the key.
ConfiguredModel load_configured_model(const Config& config);

// policy.sinks, policy.recent, policy.snapkv_window, policy.snapkv_pool (the heuristics' settings) and
// indexmem.recent, indexmem.stat, indexmem.pre_evict (the indexmem policy's inference settings).
void add_policy_keys(ConfigSchema& schema);
// PolicyOptions from those keys (kvbound::Error naming the key for a bad value); other fields default.
PolicyOptions configured_policy_options(const Config& config);

// Trained modules from a safetensors file (an export, or a run checkpoint: extra tensors are ignored) that
// config key `key` named, checked against the backbone; a kvbound::Error names the key, the file and the
// tensor otherwise. The indexer's settings (d_I, key heads, rope, relu) come from the file's metadata; a
// memory trained under another policy than `serves` (when given) is refused.
SafetensorsFile read_weights(const std::string& path, const std::string& key);
std::shared_ptr<const RetentionGates> load_gates(const std::string& path, const ModelConfig& config, const std::string& key);
std::shared_ptr<const Indexer> load_indexer(const std::string& path, const ModelConfig& config, const std::string& key);
std::shared_ptr<const LatentMemory> load_memory(const std::string& path, const ModelConfig& config, const std::string& key,
                                                const std::string& serves = "");

}  // namespace kvbound
