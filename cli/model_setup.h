// The model every command runs: its command-line options (info, generate), its config keys (model.*: train,
// eval) and the default model's path.
#pragma once
#include <cxxopts.hpp>
#include <memory>
#include <string>

#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "base/config.h"

namespace kvbound {

// The default model as scripts/setup.sh places it: $KVBOUND_MODEL_DIR, else models/ beside the build
// folder that holds this binary, else ./models.
std::string default_model_path();

// --model, --dtype, --threads, --fp32-products, --device (info, generate), and the backbone they name (threads
// applied first).
void add_model_options(cxxopts::Options& options);
std::unique_ptr<Backbone> load_backbone_from_options(const cxxopts::ParseResult& options);

// model.path, model.tokenizer, model.dtype, model.threads, model.fp32_products, model.device.
void add_model_keys(ConfigSchema& schema);

struct ConfiguredModel {
  std::string model_path, tokenizer_path;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Backbone> model;
};

// Sets ATen's thread count (model.threads, 0 = every core), loads the tokenizer (model.tokenizer, else the
// one beside the weights) and the backbone in model.dtype on model.device (resolved once: a CUDA device
// this machine lacks is an error) with model.fp32_products. Bad values are kvbound::Error naming the key.
ConfiguredModel load_configured_model(const Config& config);
// The same without a tokenizer: for models that have none (the random-weight ones the GPU benches use).
std::unique_ptr<Backbone> load_configured_backbone(const Config& config);

// "float32" / "fp32" / "bfloat16" / "bf16"; kvbound::Error "WHERE: unknown dtype ..." otherwise (`where`
// names the option or config key, e.g. "--dtype", "config: model.dtype").
at::ScalarType parse_dtype(const std::string& value, const std::string& where);

}  // namespace kvbound
