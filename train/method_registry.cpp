#include "train/method_registry.h"

#include <filesystem>

#include "base/errors.h"
#include "train/run_checkpoint.h"

namespace kvbound {
namespace methods {
#define KVBOUND_METHOD(NAME) extern const MethodRegistration NAME;
#include "train/method_list.h"
#undef KVBOUND_METHOD
}  // namespace methods

const std::vector<const MethodRegistration*>& method_registry() {
  static const std::vector<const MethodRegistration*> all = {
#define KVBOUND_METHOD(NAME) &methods::NAME,
#include "train/method_list.h"
#undef KVBOUND_METHOD
  };
  return all;
}

std::vector<std::string> method_names() {
  std::vector<std::string> names;
  for (const MethodRegistration* m : method_registry()) names.emplace_back(m->name);
  return names;
}

const MethodRegistration& find_method(const std::string& name, const std::string& where) {
  for (const MethodRegistration* m : method_registry())
    if (name == m->name) return *m;
  std::string known;
  for (const auto& n : method_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error(where + ": unknown method '" + name + "' (known: " + known + ")");
}

const MethodRegistration* method_serving(const std::string& policy, const Config& config) {
  for (const MethodRegistration* m : method_registry())
    if (m->eval_policy(config) == policy) return m;
  return nullptr;
}

void declare_method_train_keys(ConfigSchema& schema) {
  for (const MethodRegistration* m : method_registry()) m->declare_train_keys(schema);
}

void declare_method_eval_keys(ConfigSchema& schema) {
  for (const MethodRegistration* m : method_registry()) m->declare_eval_keys(schema);
}

std::map<std::string, std::string> backbone_metadata(const Backbone& model) {
  const ModelConfig& c = model.config();
  return {{"backbone", model.name()},
          {"backbone_hash", model.content_hash()},
          {"backbone_source", model.source()},
          {"backbone_config", c.to_hf_json()},
          {"architecture", c.architecture},
          {"num_layers", std::to_string(c.num_layers)},
          {"hidden_size", std::to_string(c.hidden_size)},
          {"num_kv_heads", std::to_string(c.num_kv_heads)}};
}

std::map<std::string, std::string> load_weights(const std::string& path, const std::string& key, const Backbone& model,
                                                TrainedModules& modules, const WeightsLoader& load) {
  try {
    const SafetensorsFile file = read_safetensors(path);
    load(file, path, model, modules);
    return file.metadata;
  } catch (const Error& e) {
    throw Error(key + ": " + e.what());
  }
}

std::string resolve_weights_path(const std::string& run_or_export, const std::string& key) {
  if (!std::filesystem::is_directory(run_or_export)) return run_or_export;
  return run_weights_path(run_or_export, std::filesystem::exists(run_or_export + "/best.safetensors"), key);
}

void load_weights_key(const Config& config, const std::string& key, const Backbone& model, TrainedModules& modules,
                      std::map<std::string, std::string>& meta, const WeightsLoader& load) {
  const std::string path = config.get_string(key);
  if (path.empty()) return;
  load_weights(path, key, model, modules, load);
  meta[key] = path;
}

void load_init_from(MethodSetup& setup, const MethodRegistration& from) {
  const std::string key = "train.init_from";
  const std::string given = setup.config.get_string(key);
  if (given.empty()) fail("config", key, "needs the " + std::string(from.name) + " run folder (or its export) to start from");
  const std::string path = resolve_weights_path(given, key);
  const std::map<std::string, std::string> metadata = load_weights(path, key, setup.model, setup.init_modules, from.load);
  const auto meta = [&](const char* k) { return metadata.count(k) ? metadata.at(k) : std::string(); };
  setup.init_metadata = {{"init_from", path}, {"init_from_step", meta("step")}, {"init_from_config_hash", meta("config_hash")}};
}

}  // namespace kvbound
