// The config keys that `kvbound train` and `kvbound eval` share (model.*, policy.*), and what they make.
#pragma once
#include <memory>
#include <string>

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

// policy.sinks, policy.recent, policy.snapkv_window, policy.snapkv_pool: the heuristics' settings.
void add_policy_keys(ConfigSchema& schema);
// PolicyOptions from those keys (kvbound::Error naming the key for a bad value); other fields default.
PolicyOptions heuristic_policy_options(const Config& config);

}  // namespace kvbound
