#include "train/run_state.h"

#include <ATen/core/grad_mode.h>

#include <filesystem>

#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "train/run_checkpoint.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

}  // namespace

RunState::RunState(std::string run_dir, std::string config_hash, std::int64_t keep_checkpoints)
    : run_dir_(std::move(run_dir)), config_hash_(std::move(config_hash)), keep_checkpoints_(keep_checkpoints) {}

std::string RunState::metrics_path() const { return (fs::path(run_dir_) / "metrics.jsonl").string(); }

RunProgress RunState::resume(const TrainingMethod& method, const std::vector<std::string>& names,
                             const std::vector<at::Tensor>& params, AdamW& optimizer) {
  const RunCheckpoint ck = load_latest_checkpoint(run_dir_);
  last_good_ = latest_checkpoint_path(run_dir_);
  if (ck.method != method.name())
    fail(last_good_, "__metadata__.method", "'" + ck.method + "' but this run trains " + method.name());
  // Weights the run started from (train.init_from) are part of its identity: a stage-1 run that moved on
  // since (a newer best.safetensors) would change the policy the rest of the run replays.
  for (const auto& [key, value] : method.metadata()) {
    if (key.rfind("init_from", 0) != 0) continue;
    const auto saved = ck.extra.find(key);
    const std::string was = saved == ck.extra.end() ? "(none)" : saved->second;
    if (was != value)
      fail(last_good_, "train.init_from", key + " is now '" + value + "' but the run started from '" + was +
                                              "'; resume needs the same stage-1 weights");
  }
  {
    const at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < names.size(); ++i) {
      const auto it = ck.tensors.find(names[i]);
      if (it == ck.tensors.end()) fail(last_good_, names[i], "missing tensor");
      if (it->second.sizes() != params[i].sizes()) fail(last_good_, names[i], "shape differs from this run's");
      params[i].copy_(it->second);  // to the parameter's device
    }
  }
  optimizer.load_state(ck.tensors, names, ck.step, last_good_);
  return {ck.step, {ck.epoch, ck.cursor}, ck.tokens_seen};
}

void RunState::save_checkpoint(const RunProgress& progress, const TrainingMethod& method,
                               const std::vector<std::string>& names, const std::vector<at::Tensor>& params,
                               const AdamW& optimizer) {
  RunCheckpoint ck;
  ck.step = progress.step;
  ck.epoch = progress.position.epoch;
  ck.cursor = progress.position.cursor;
  ck.tokens_seen = progress.tokens_seen;
  ck.method = method.name();
  ck.config_hash = config_hash_;
  ck.extra = method.metadata();
  const at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i) ck.tensors[names[i]] = params[i].detach().cpu();
  for (auto& [k, v] : optimizer.state(names)) ck.tensors[k] = v.cpu();
  last_good_ = save_run_checkpoint(run_dir_, ck, keep_checkpoints_);
}

std::optional<BestEval> RunState::best_eval(std::int64_t step) const {
  const std::string path = (fs::path(run_dir_) / "best.safetensors").string();
  if (!fs::exists(path)) return std::nullopt;
  const auto meta = read_safetensors(path).metadata;
  if (!meta.count("eval_kl") || !meta.count("step") || std::stoll(meta.at("step")) > step) return std::nullopt;
  return BestEval{std::stoll(meta.at("step")), std::stod(meta.at("eval_kl"))};
}

void RunState::save_best(const BestEval& best, std::int64_t budget, const TrainingMethod& method) {
  std::map<std::string, std::string> meta = method.metadata();
  meta["step"] = std::to_string(best.step);
  meta["eval_kl"] = std::to_string(best.kl);
  meta["eval_budget"] = std::to_string(budget);
  meta["config_hash"] = config_hash_;
  std::map<std::string, at::Tensor> tensors;
  const at::NoGradGuard no_grad;
  for (const auto& [name, p] : method.named_parameters()) tensors[name] = p.detach().cpu();
  write_safetensors((fs::path(run_dir_) / "best.safetensors").string(), tensors, meta);
}

}  // namespace kvbound
