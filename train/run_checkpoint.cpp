#include "train/run_checkpoint.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "checkpoints/safetensors_io.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;
constexpr const char* kFormat = "kvbound-run-checkpoint";

std::string step_name(std::int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "step_%07lld.safetensors", static_cast<long long>(step));
  return buf;
}

std::int64_t meta_int(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& path) {
  const auto it = meta.find(key);
  if (it == meta.end()) fail(path, "__metadata__." + key, "missing (not a kvbound run checkpoint?)");
  try {
    std::size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument(key);
    return v;
  } catch (const std::exception&) {
    fail(path, "__metadata__." + key, "'" + it->second + "' is not an integer");
  }
}

}  // namespace

std::string save_run_checkpoint(const std::string& run_dir, const RunCheckpoint& ck, std::int64_t keep) {
  const fs::path dir = fs::path(run_dir) / "checkpoints";
  fs::create_directories(dir);
  std::map<std::string, std::string> meta = ck.extra;
  meta["format"] = kFormat;
  meta["format_version"] = "1";
  meta["step"] = std::to_string(ck.step);
  meta["epoch"] = std::to_string(ck.epoch);
  meta["cursor"] = std::to_string(ck.cursor);
  meta["tokens_seen"] = std::to_string(ck.tokens_seen);
  meta["method"] = ck.method;
  meta["config_hash"] = ck.config_hash;
  const std::string name = step_name(ck.step);
  write_safetensors((dir / name).string(), ck.tensors, meta);
  write_file_atomic((dir / "LATEST").string(), name + "\n");
  // Older checkpoints beyond `keep`: names sort by step (zero-padded).
  std::vector<fs::path> all;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors" && e.path().filename().string().rfind("step_", 0) == 0) all.push_back(e.path());
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(std::max<std::int64_t>(keep, 1)) < all.size(); ++i) fs::remove(all[i]);
  return (dir / name).string();
}

bool is_run_bookkeeping(const std::string& key) {
  return key == "format" || key == "format_version" || key == "epoch" || key == "cursor" || key == "tokens_seen";
}

std::string latest_checkpoint_path(const std::string& run_dir) {
  const fs::path marker = fs::path(run_dir) / "checkpoints" / "LATEST";
  std::ifstream in(marker);
  if (!in) return "";
  std::string name;
  std::getline(in, name);
  if (name.empty() || name.find('/') != std::string::npos) fail(marker.string(), "LATEST", "damaged marker (expected a checkpoint file name)");
  return (marker.parent_path() / name).string();
}

std::string run_weights_path(const std::string& run_dir, bool best, const std::string& key) {
  if (!fs::is_directory(run_dir)) fail(run_dir, key, "not a run folder");
  if (best) {
    const std::string path = (fs::path(run_dir) / "best.safetensors").string();
    if (!fs::exists(path)) fail(path, key, "no periodic eval has run in this folder (data.eval_text empty?)");
    return path;
  }
  const std::string path = latest_checkpoint_path(run_dir);
  if (path.empty()) fail(run_dir, key, "no checkpoint in this run folder (checkpoints/LATEST missing)");
  return path;
}

RunCheckpoint load_latest_checkpoint(const std::string& run_dir) {
  const std::string path = latest_checkpoint_path(run_dir);
  if (path.empty()) fail(run_dir, "checkpoints/LATEST", "no checkpoint in this run folder");
  SafetensorsFile file = read_safetensors(path);
  const auto& meta = file.metadata;
  const auto format = meta.find("format");
  if (format == meta.end() || format->second != kFormat) fail(path, "__metadata__.format", "not a kvbound run checkpoint");
  RunCheckpoint ck;
  ck.step = meta_int(meta, "step", path);
  ck.epoch = meta_int(meta, "epoch", path);
  ck.cursor = meta_int(meta, "cursor", path);
  ck.tokens_seen = meta_int(meta, "tokens_seen", path);
  ck.method = meta.count("method") ? meta.at("method") : "";
  ck.config_hash = meta.count("config_hash") ? meta.at("config_hash") : "";
  ck.extra = meta;
  ck.tensors = std::move(file.tensors);
  return ck;
}

}  // namespace kvbound
