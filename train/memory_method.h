// IndexMem stage 2 (DESIGN.md, "Latent memory"): the latent memory alone, trained locally per layer on the
// frozen backbone's own q/k/v. One no-grad teacher forward over whole rows gives every layer's q/k/v and
// full-attention output o_full; then, at each budget of `budgets`, the engine's eviction under the base
// policy is replayed on those q/k/v in chunks (MemoryAugmentedCache, the very hook the eval runs), so
// o = attention(retained + chunk) + g(q)·m(q), and
//   L_MSE = mean((o_full − o)²) over the positions after the first eviction, averaged over layers and budgets.
// Only the memory's parameters get gradients: the teacher tensors are constants.
#pragma once
#include <string>
#include <vector>

#include "modules/backbone.h"
#include "modules/latent_memory.h"
#include "train/training_method.h"

namespace kvbound {

struct MemorySettings {
  LatentMemorySettings memory;
  std::string policy = "h2o";                // the base policy the memory will be used with
  std::vector<std::int64_t> budgets{16, 32};  // replayed budgets M (a memory trained at one M hurt at 4x that)
  std::int64_t chunk = 16;                    // replay chunk, like the engine's prefill chunk
  PolicyOptions policy_options;               // the base policy's settings (recent window, ...)
  // A learned base policy's weights: init_from (the file), init_from_step, init_from_config_hash (metadata).
  std::map<std::string, std::string> base_weights;
};

class MemoryMethod final : public TrainingMethod {
 public:
  MemoryMethod(const Backbone& model, const MemorySettings& settings, std::uint64_t seed);

  std::string name() const override { return "memory"; }
  std::map<std::string, at::Tensor> named_parameters() const override { return memory_->named_tensors(); }
  StepLoss loss(const Batch& batch) override;
  // The base policy with this memory attached ("<policy>+mem"): the periodic eval runs the +mem hook.
  std::unique_ptr<EvictionPolicy> eval_policy() const override;
  std::map<std::string, std::string> metadata() const override;
  std::string per_layer_name() const override { return "mse_per_layer"; }

 private:
  const Backbone& model_;
  MemorySettings settings_;
  std::shared_ptr<LatentMemory> memory_;
};

}  // namespace kvbound
