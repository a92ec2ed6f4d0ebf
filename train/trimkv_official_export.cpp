#include "train/trimkv_official_export.h"

#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/atomic_file.h"
#include "base/errors.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

const std::string& need(const std::map<std::string, std::string>& metadata, const std::string& key,
                        const std::string& source) {
  const auto it = metadata.find(key);
  if (it == metadata.end())
    fail(source, "__metadata__." + key, "missing: the official config needs it (retrain with this kvbound?)");
  return it->second;
}

// `value` as torch.save writes it (a zip archive: data.pkl + one record per tensor), without the TorchScript
// type tags torch::pickle_save adds to containers: torch.load's default weights_only unpickler rejects
// those (torch.jit._pickle.restore_type_tag is not an allowed global), and the official loader uses it.
std::string torch_save_bytes(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::string archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) {
    archive.append(static_cast<const char*>(bytes), n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace

void write_trimkv_official_folder(const std::map<std::string, at::Tensor>& gates,
                                  const std::map<std::string, std::string>& metadata, const std::string& source,
                                  const std::string& out) {
  if (need(metadata, "method", source) != "trimkv")
    fail(source, "__metadata__.method", "'" + metadata.at("method") + "': --format trimkv exports TRIM-KV gates only");
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(need(metadata, "backbone_config", source), nullptr, false);
  if (!config.is_object()) fail(source, "__metadata__.backbone_config", "not a JSON object");
  config["base_model"] = need(metadata, "backbone", source);
  config["trainable_params"] = "retention_gate";
  config["retention_gate"] = "rg";
  config["retention_gate_intermediate_size"] = std::stoll(need(metadata, "retention_gate_intermediate_size", source));
  config["retention_gate_bias_init"] = std::stod(need(metadata, "retention_gate_bias_init", source));
  config["memory_size"] = std::stoll(need(metadata, "budget", source));
  // kvbound cuts a layer holding more than M + eval.buffer entries; the official cache one holding
  // memory_size + buffer_size or more: buffer_size 1 is kvbound's default buffer 0.
  config["buffer_size"] = 1;
  config["compress_memory"] = true;
  config["torch_dtype"] = "float32";
  config["kvbound"] = {{"method", "trimkv"},
                       {"step", metadata.count("step") ? metadata.at("step") : ""},
                       {"config_hash", metadata.count("config_hash") ? metadata.at("config_hash") : ""},
                       {"backbone_hash", need(metadata, "backbone_hash", source)},
                       {"source", source}};

  c10::Dict<std::string, at::Tensor> state;
  for (const auto& [name, tensor] : gates) state.insert(name, tensor.to(at::kFloat).contiguous());

  // Both files into a fresh sibling folder, then one rename: a reader sees the old export or the new one.
  const fs::path target = fs::path(out).lexically_normal();
  const fs::path partial = target.string() + ".partial";
  fs::remove_all(partial);
  write_file_atomic((partial / "trimkv_weights.pth").string(), torch_save_bytes(state));
  write_file_atomic((partial / "config.json").string(), config.dump(2) + "\n");
  if (fs::exists(target) && !fs::is_directory(target)) fail(out, "--out", "exists and is not a folder");
  const fs::path previous = target.string() + ".previous";
  fs::remove_all(previous);
  if (fs::exists(target)) fs::rename(target, previous);
  fs::rename(partial, target);
  fs::remove_all(previous);
}

}  // namespace kvbound
