#include "train/joint_method.h"

#include "checkpoints/errors.h"

namespace kvbound {

JointMethod::JointMethod(std::unique_ptr<IndexMemIndexerMethod> indexer, std::unique_ptr<MemoryMethod> memory,
                         double lambda_mse, double indexer_lr_scale)
    : indexer_(std::move(indexer)), memory_(std::move(memory)), lambda_mse_(lambda_mse), indexer_lr_scale_(indexer_lr_scale) {
  if (!(lambda_mse >= 0)) fail("config", "indexmem.lambda_mse", "must be >= 0");
  if (!(indexer_lr_scale > 0)) fail("config", "indexmem.lr", "must be > 0");
}

double JointMethod::lr_scale(const std::string& name) const {
  return indexer_->named_parameters().count(name) ? indexer_lr_scale_ : 1.0;
}

std::map<std::string, at::Tensor> JointMethod::named_parameters() const {
  std::map<std::string, at::Tensor> all = indexer_->named_parameters();
  for (auto& [name, t] : memory_->named_parameters()) all.emplace(name, t);
  return all;
}

StepLoss JointMethod::loss(const Batch& batch) {
  StepLoss kl = indexer_->loss(batch);
  StepLoss mse = memory_->loss(batch);
  StepLoss out;
  out.total = kl.total + mse.total * lambda_mse_;
  out.terms = std::move(kl.terms);
  for (auto& term : mse.terms) out.terms.push_back(std::move(term));
  out.stats = std::move(kl.stats);
  out.stats.insert(mse.stats.begin(), mse.stats.end());
  out.per_layer = std::move(mse.per_layer);
  return out;
}

std::map<std::string, std::string> JointMethod::metadata() const {
  std::map<std::string, std::string> m = memory_->metadata();
  for (auto& [key, value] : indexer_->metadata()) m.emplace(key, value);  // memory's method/stage win...
  m["method"] = "joint";  // ...then name both
  m["stage"] = "joint";
  m["lambda_mse"] = std::to_string(lambda_mse_);
  m["indexer_lr_scale"] = std::to_string(indexer_lr_scale_);
  return m;
}

}  // namespace kvbound
