// The model.* config keys that `kvbound train` and `kvbound eval` share, and loading what they name.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizer.h"
#include "modules/backbone.h"
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

}  // namespace kvbound
