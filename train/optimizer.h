// Optimisation pieces of the trainers: AdamW over a fixed list of parameters (ATen's fused CPU/CUDA
// AdamW kernel does the update; this class owns the state so checkpoints can save it exactly), the
// warm-up + cosine learning-rate schedule and global gradient-norm clipping.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvbound {

struct AdamWSettings {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;  // applied to matrices only: decaying the gate bias (≈ 8) would push every
                               // token towards being forgotten, whatever the data says
};

class AdamW {
 public:
  // lr_scales[i] multiplies the step's learning rate for params[i] (empty: all 1), e.g. a slower indexer
  // beside a faster memory in joint training.
  AdamW(std::vector<at::Tensor> params, AdamWSettings settings, std::vector<double> lr_scales = {});

  // One update with learning rate `lr` (times each parameter's scale) from each parameter's .grad();
  // parameters without a gradient are skipped (their moments and step count stay as they were, as in torch.optim).
  void step(double lr);
  void zero_grad();
  std::int64_t steps() const { return steps_; }

  // The moments under "optimizer.exp_avg.<name>" / "optimizer.exp_avg_sq.<name>" (names[i] for params[i]).
  std::map<std::string, at::Tensor> state(const std::vector<std::string>& names) const;
  // Restores moments and the step count; a missing or mis-shaped tensor is kvbound::Error naming `source`.
  void load_state(const std::map<std::string, at::Tensor>& tensors, const std::vector<std::string>& names,
                  std::int64_t steps, const std::string& source);

 private:
  std::vector<at::Tensor> params_, exp_avg_, exp_avg_sq_, step_counts_;
  AdamWSettings settings_;
  std::vector<double> lr_scales_;
  std::int64_t steps_ = 0;
};

// Linear warm-up over `warmup` steps to `lr`, then cosine decay to `min_lr` at `total` steps. `step`
// counts from 0 (the first update uses step 0's rate, lr/warmup when warming up).
double scheduled_lr(std::int64_t step, std::int64_t total, std::int64_t warmup, double lr, double min_lr);

// Scales every gradient so the global L2 norm is at most max_norm (max_norm <= 0: no clipping).
// Returns the norm before clipping (NaN/inf when a gradient is not finite).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

}  // namespace kvbound
