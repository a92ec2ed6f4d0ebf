#include "train/optimizer.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/full.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>

#include "base/errors.h"

namespace kvbound {

AdamW::AdamW(std::vector<at::Tensor> params, AdamWSettings settings, std::vector<double> lr_scales)
    : params_(std::move(params)), settings_(settings), lr_scales_(std::move(lr_scales)) {
  if (lr_scales_.empty()) lr_scales_.assign(params_.size(), 1.0);
  TORCH_CHECK(lr_scales_.size() == params_.size(), "AdamW: ", lr_scales_.size(), " lr scales for ", params_.size(), " parameters");
  for (const at::Tensor& p : params_) {
    exp_avg_.push_back(at::zeros_like(p));
    exp_avg_sq_.push_back(at::zeros_like(p));
    step_counts_.push_back(at::full({}, 0.0, p.options().dtype(at::kFloat)));
  }
}

void AdamW::step(double lr) {
  const at::NoGradGuard no_grad;  // updating leaves in place
  // One fused call per group: matrices decay, vectors (biases) do not; and per learning-rate scale.
  std::vector<double> scales = lr_scales_;
  std::sort(scales.begin(), scales.end());
  scales.erase(std::unique(scales.begin(), scales.end()), scales.end());
  for (const double scale : scales) {
    for (const bool decayed : {true, false}) {
      std::vector<at::Tensor> p, g, m, v, s;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if ((params_[i].dim() >= 2) != decayed || lr_scales_[i] != scale || !params_[i].grad().defined()) continue;
        p.push_back(params_[i]);
        g.push_back(params_[i].grad());
        m.push_back(exp_avg_[i]);
        v.push_back(exp_avg_sq_[i]);
        s.push_back(step_counts_[i]);
      }
      if (p.empty()) continue;
      // The fused kernel reads the step count, it does not advance it (torch.optim increments first too).
      for (at::Tensor& count : s) count.add_(1);
      at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr * scale, settings_.beta1, settings_.beta2,
                        decayed ? settings_.weight_decay : 0.0, settings_.eps, /*amsgrad=*/false, /*maximize=*/false);
    }
  }
  ++steps_;
}

void AdamW::zero_grad() {
  for (at::Tensor& p : params_)
    if (p.grad().defined()) p.mutable_grad() = at::Tensor();
}

std::map<std::string, at::Tensor> AdamW::state(const std::vector<std::string>& names) const {
  TORCH_CHECK(names.size() == params_.size(), "AdamW::state: ", names.size(), " names for ", params_.size(), " parameters");
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out["optimizer.exp_avg." + names[i]] = exp_avg_[i];
    out["optimizer.exp_avg_sq." + names[i]] = exp_avg_sq_[i];
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, const std::vector<std::string>& names,
                       std::int64_t steps, const std::string& source) {
  TORCH_CHECK(names.size() == params_.size(), "AdamW::load_state: ", names.size(), " names for ", params_.size(), " parameters");
  for (std::size_t i = 0; i < names.size(); ++i) {
    for (auto [prefix, dst] : {std::pair{"optimizer.exp_avg.", &exp_avg_[i]}, std::pair{"optimizer.exp_avg_sq.", &exp_avg_sq_[i]}}) {
      const std::string name = prefix + names[i];
      const auto it = tensors.find(name);
      if (it == tensors.end()) fail(source, name, "missing optimizer state");
      if (it->second.sizes() != params_[i].sizes()) fail(source, name, "shape differs from the parameter's");
      *dst = it->second.to(params_[i].device(), params_[i].scalar_type()).clone();
    }
    step_counts_[i].fill_(static_cast<double>(steps));
  }
  steps_ = steps;
}

double scheduled_lr(std::int64_t step, std::int64_t total, std::int64_t warmup, double lr, double min_lr) {
  if (warmup > 0 && step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<std::int64_t>(total - warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> norms;
  for (const at::Tensor& p : params)
    if (p.grad().defined()) norms.push_back(p.grad().detach().to(at::kDouble).norm());
  if (norms.empty()) return 0.0;
  const double total = at::stack(norms).norm().item<double>();
  if (max_norm > 0 && std::isfinite(total) && total > max_norm) {
    const at::NoGradGuard no_grad;
    for (const at::Tensor& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(max_norm / (total + 1e-6));
  }
  return total;
}

}  // namespace kvbound
