// IndexMem stage 2, joint (DESIGN.md, "IndexMem"): the indexer (continued from stage 1) and the latent
// memory trained together,
//   L = L_KL(indexer) + lambda_mse · L_MSE(memory),
// where the memory's replay evicts with the live indexer (policy indexmem), so the memory always learns
// what the current indexer throws away. The eviction choice is not differentiable: the indexer's gradient
// comes from L_KL alone, the memory's from L_MSE alone; the sum shares one optimizer, clip and schedule,
// with the indexer's learning rate scaled (it was trained at a smaller rate than the memory's gate needs).
// Registered as train.method joint, starting from an indexmem run (train.init_from); evaluated by indexmem+mem.
#pragma once
#include <memory>

#include "train/indexmem_method.h"
#include "train/memory_method.h"

namespace kvbound {

class JointMethod final : public TrainingMethod {
 public:
  // `memory` must replay policy indexmem with indexer->indexer() (make it with that in its policy options).
  JointMethod(std::unique_ptr<IndexMemIndexerMethod> indexer, std::unique_ptr<MemoryMethod> memory, double lambda_mse,
              double indexer_lr_scale);

  std::string name() const override { return "joint"; }
  std::map<std::string, at::Tensor> named_parameters() const override;
  StepLoss loss(const Batch& batch) override;
  // indexmem+mem with both live modules.
  std::unique_ptr<EvictionPolicy> eval_policy() const override { return memory_->eval_policy(); }
  std::map<std::string, std::string> metadata() const override;
  std::string per_layer_name() const override { return memory_->per_layer_name(); }
  double lr_scale(const std::string& name) const override;

 private:
  std::unique_ptr<IndexMemIndexerMethod> indexer_;
  std::unique_ptr<MemoryMethod> memory_;
  double lambda_mse_, indexer_lr_scale_;
};

}  // namespace kvbound
