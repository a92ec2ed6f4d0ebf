// Run checkpoints of the trainers. One checkpoint is one safetensors file,
//   RUN_DIR/checkpoints/step_0000120.safetensors
// holding the trainable tensors under their export names, the optimizer moments ("optimizer.*"), and in its
// metadata the step (= the optimizer's step count), the data position (epoch, cursor), tokens seen and the
// config hash. It is written atomically (temp file, fsync, rename); then RUN_DIR/checkpoints/LATEST (the
// completion marker, also atomic) names it. A crash at any point leaves LATEST naming a complete file.
// The RNG needs no state: data order is a function of (seed, epoch) and nothing else is random after init.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

namespace kvbound {

struct RunCheckpoint {
  std::int64_t step = 0;  // updates done
  std::int64_t epoch = 0, cursor = 0;
  std::int64_t tokens_seen = 0;
  std::string method;       // "trimkv", ...
  std::string config_hash;  // Config::hash() of the run's resolved config
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> extra;  // further metadata (backbone identity, ...)
};

// Writes the checkpoint and then LATEST; removes all but the newest `keep` checkpoint files (keep >= 1).
// Returns the checkpoint's path.
std::string save_run_checkpoint(const std::string& run_dir, const RunCheckpoint& checkpoint, std::int64_t keep);

// The checkpoint LATEST names. kvbound::Error naming the file when there is none or it is damaged.
RunCheckpoint load_latest_checkpoint(const std::string& run_dir);
// The path LATEST names, or "" when the run has no checkpoint yet.
std::string latest_checkpoint_path(const std::string& run_dir);

// Whether a checkpoint metadata key is the run's own bookkeeping (format, data position, tokens seen) rather
// than a description of the weights: exports leave these out.
bool is_run_bookkeeping(const std::string& key);

// The trained weights a run folder holds: best.safetensors (the best periodic eval) when `best`, else the
// latest checkpoint. kvbound::Error naming the folder and `key` (the option that asked) when it has none.
std::string run_weights_path(const std::string& run_dir, bool best, const std::string& key);

}  // namespace kvbound
