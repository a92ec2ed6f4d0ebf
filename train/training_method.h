// What a learned method gives the trainer (train/trainer.h): its trainable tensors under their export
// names, a loss for a batch, and the eviction policy that evaluates it. Each method's registration
// (train/method_registry.h) builds one from a run's config: trimkv, indexmem, memory, joint.
#pragma once
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "modules/eviction_policy.h"
#include "data/training_rows.h"

namespace kvbound {

struct StepLoss {
  at::Tensor total;                                         // what backward() runs on
  std::vector<std::pair<std::string, at::Tensor>> terms;    // named scalar terms, logged and NaN-checked
  std::map<std::string, double> stats;                      // extra numbers for metrics.jsonl
  std::vector<double> per_layer;                            // e.g. mean retention per layer
};

// A loss that is a sum per layer divided by `count` (rows, budgets, ...), then averaged over layers and
// logged as `term`. With count 0 (nothing to learn from in this batch) a zero loss that still reaches every
// parameter in `params`, so backward and the optimizer step run as usual.
inline StepLoss layer_mean_loss(std::vector<at::Tensor> layer_sums, double count, const std::string& term,
                                const std::vector<at::Tensor>& params) {
  StepLoss out;
  if (count == 0) {
    at::Tensor zero;
    for (const at::Tensor& p : params) zero = zero.defined() ? zero + p.sum() * 0 : p.sum() * 0;
    out.total = zero;
    out.terms = {{term, zero}};
    out.per_layer.assign(layer_sums.size(), 0.0);
    return out;
  }
  at::Tensor total;
  for (at::Tensor& layer : layer_sums) {
    layer = layer / count;
    total = total.defined() ? total + layer : layer;
  }
  out.total = total / static_cast<double>(layer_sums.size());
  out.terms = {{term, out.total}};
  for (const at::Tensor& layer : layer_sums) out.per_layer.push_back(layer.item<double>());
  return out;
}

class TrainingMethod {
 public:
  virtual ~TrainingMethod() = default;
  virtual std::string name() const = 0;
  // The trainable tensors under their export names (sharing storage with the leaves being trained).
  virtual std::map<std::string, at::Tensor> named_parameters() const = 0;
  virtual StepLoss loss(const Batch& batch) = 0;
  // A fresh policy that evicts with the current weights (for the periodic budgeted eval).
  virtual std::unique_ptr<EvictionPolicy> eval_policy() const = 0;
  // Metadata written into checkpoints and exports (backbone identity, budget, settings).
  virtual std::map<std::string, std::string> metadata() const = 0;
  // The name of the per_layer statistic in metrics.jsonl.
  virtual std::string per_layer_name() const = 0;
  // Per-layer values the trained modules compute on held-out windows ([T] token ids each), logged as
  // histograms at every periodic eval (TRIM-KV: "log_beta", every token's log β per layer and KV head).
  virtual std::map<std::string, std::vector<at::Tensor>> distributions(const Backbone& model,
                                                                      const std::vector<at::Tensor>& windows) const {
    (void)model;
    (void)windows;
    return {};
  }
  // What the trainer's learning rate (schedule included) is multiplied by for the parameter `name`.
  virtual double lr_scale(const std::string& name) const {
    (void)name;
    return 1.0;
  }
};

}  // namespace kvbound
