#include "train/model_setup.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <thread>

#include "checkpoints/errors.h"
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

}  // namespace kvbound
