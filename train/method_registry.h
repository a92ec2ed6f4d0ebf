// Name -> learned method. Each method file (train/NAME_method.cpp) defines one MethodRegistration: the
// config keys it owns in `kvbound train` and in `kvbound eval`, how it builds the modules it trains (fresh,
// or from an earlier stage's run: train.init_from), how its trained modules are loaded back from an export
// or checkpoint, and which eviction policy evaluates it. train/method_list.h lists them. `kvbound train`,
// `export`, `eval` and `--resume` know the methods only through this registry.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "checkpoints/safetensors_io.h"
#include "modules/backbone.h"
#include "modules/trained_modules.h"
#include "train/training_method.h"

namespace kvbound {

// What a method is built from: the run's resolved config (train.*, the policy keys and every method's
// keys), the frozen backbone, and the weights an earlier stage left (train.init_from: already loaded, with
// the file's identity for the run's metadata).
struct MethodSetup {
  const Config& config;
  const Backbone& model;
  std::uint64_t seed = 0;
  TrainedModules init_modules;                        // empty unless init_from names a run or an export
  std::map<std::string, std::string> init_metadata;   // init_from, init_from_step, init_from_config_hash
};

// Loads the trained modules of an export or checkpoint (`path`) as constants checked against the backbone,
// on its device, into `modules`; errors name the file and the tensor (callers put the config key in front).
using WeightsLoader = std::function<void(const SafetensorsFile& file, const std::string& path, const Backbone& model,
                                         TrainedModules& modules)>;

// An export format beyond kvbound's own safetensors file (`kvbound export --format NAME`): writes `out` from
// a run's trained tensors and metadata (read from `source`).
struct ExportFormat {
  const char* name;
  const char* summary;
  void (*write)(const std::map<std::string, at::Tensor>& tensors, const std::map<std::string, std::string>& metadata,
                const std::string& source, const std::string& out);
};

struct MethodRegistration {
  const char* name;     // the value of train.method (and the "method" of its checkpoints and exports)
  const char* summary;  // one line for --help
  // The method that train.init_from must name (a run folder or an export of it); nullptr when the method
  // starts from nothing, or when the config decides: memory (memory.policy's own method, if learned), trimkv
  // (earlier gates to continue from, if train.init_from is set).
  const char* starts_from;
  // The keys of `kvbound eval` that take this method's export, e.g. {"trimkv.gates"}.
  std::vector<std::string> weights_keys;
  void (*declare_train_keys)(ConfigSchema& schema);
  void (*declare_eval_keys)(ConfigSchema& schema);
  // The eviction policy that serves the method in eval: "trimkv", "indexmem", "<memory.policy>+mem", ...
  std::string (*eval_policy)(const Config& config);
  std::unique_ptr<TrainingMethod> (*make)(MethodSetup& setup);
  // The trained modules of an export or checkpoint of this method.
  WeightsLoader load;
  // `kvbound eval`: the modules the files its eval keys name (none set: nothing), recorded in `meta`.
  void (*load_for_eval)(const Config& config, const Backbone& model, TrainedModules& modules,
                        std::map<std::string, std::string>& meta);
  // Further formats `kvbound export --format` writes for this method (e.g. trimkv: the official release's folder).
  std::vector<ExportFormat> export_formats;
};

const std::vector<const MethodRegistration*>& method_registry();
std::vector<std::string> method_names();
// The registration named `name`; otherwise kvbound::Error "WHERE: unknown method ... (known: ...)".
const MethodRegistration& find_method(const std::string& name, const std::string& where = "config: train.method");
// The registration whose eval policy (under `config`) is `policy`, or null (a heuristic).
const MethodRegistration* method_serving(const std::string& policy, const Config& config);

void declare_method_train_keys(ConfigSchema& schema);
void declare_method_eval_keys(ConfigSchema& schema);

// What every method records about its backbone in checkpoints and exports: "backbone" (the model's name) and
// "backbone_hash" (its weights' content hash) — an identity that holds on another machine — the path it was
// loaded from ("backbone_source"), architecture and sizes, and "backbone_config", its Hugging Face
// config.json (what the official TRIM-KV classes are built from).
std::map<std::string, std::string> backbone_metadata(const Backbone& model);

// Reads the weights file that config key `key` names and hands it to `load`, putting the key in front of any
// error ("KEY: FILE: TENSOR: ..."). Returns the file's metadata.
std::map<std::string, std::string> load_weights(const std::string& path, const std::string& key, const Backbone& model,
                                                TrainedModules& modules, const WeightsLoader& load);
// The weights a run folder or an export holds: a folder gives its best.safetensors when it has one, else its
// latest checkpoint. Errors name `key`.
std::string resolve_weights_path(const std::string& run_or_export, const std::string& key);

// For load_for_eval: when config key `key` names a file, reads it and hands it to `load`, and records it in `meta`.
void load_weights_key(const Config& config, const std::string& key, const Backbone& model, TrainedModules& modules,
                      std::map<std::string, std::string>& meta, const WeightsLoader& load);

// The stage-1 weights train.init_from names, loaded by `from`'s loader into setup.init_modules (with their
// identity in setup.init_metadata); kvbound::Error naming train.init_from when it is empty or lacks a tensor
// `from` needs.
void load_init_from(MethodSetup& setup, const MethodRegistration& from);

}  // namespace kvbound
