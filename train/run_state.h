// A run folder's state apart from the training loop: where the run stands (step, data position, tokens
// seen), its checkpoints (train/run_checkpoint.h: atomic, LATEST last) and resume from them, the weights
// of the best periodic eval (best.safetensors), and the NaN stop message's "last good checkpoint".
//
// Run folder:
//   config.yaml        the resolved config (written by the command)
//   metrics.jsonl      one JSON object per logged step ("type": "train") and per evaluation ("type": "eval")
//   checkpoints/       step_*.safetensors + LATEST
//   best.safetensors   the trainable tensors at the best periodic eval (lowest KL), with its step and KL
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/training_rows.h"
#include "train/optimizer.h"
#include "train/training_method.h"

namespace kvbound {

struct RunProgress {
  std::int64_t step = 0;  // updates done
  DataPosition position;
  std::int64_t tokens_seen = 0;
};

struct BestEval {
  std::int64_t step = 0;
  double kl = 0;
};

class RunState {
 public:
  RunState(std::string run_dir, std::string config_hash, std::int64_t keep_checkpoints);

  const std::string& run_dir() const { return run_dir_; }
  const std::string& config_hash() const { return config_hash_; }
  std::string metrics_path() const;
  // The checkpoint a failure can fall back to ("" before the first one).
  const std::string& last_good() const { return last_good_; }

  // Restores the latest checkpoint into the method's parameters and the optimizer and returns where the run
  // stood. kvbound::Error naming the checkpoint when it belongs to another method, started from other
  // stage-1 weights (the method's init_from* metadata), or lacks or mis-shapes a tensor.
  RunProgress resume(const TrainingMethod& method, const std::vector<std::string>& names,
                     const std::vector<at::Tensor>& params, AdamW& optimizer);
  // Writes a checkpoint of the parameters, the optimizer state and the progress (keeping the newest few).
  void save_checkpoint(const RunProgress& progress, const TrainingMethod& method, const std::vector<std::string>& names,
                       const std::vector<at::Tensor>& params, const AdamW& optimizer);

  // The best periodic eval recorded in best.safetensors at or before `step` (a resumed run ignores a later one).
  std::optional<BestEval> best_eval(std::int64_t step) const;
  // Records the trainable tensors of a new best eval (at `budget`) in best.safetensors, atomically.
  void save_best(const BestEval& best, std::int64_t budget, const TrainingMethod& method);

 private:
  std::string run_dir_, config_hash_;
  std::int64_t keep_checkpoints_;
  std::string last_good_;
};

}  // namespace kvbound
