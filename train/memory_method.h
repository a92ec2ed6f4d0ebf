// IndexMem stage 2 (DESIGN.md, "Latent memory"): the latent memory alone, trained locally per layer on the
// frozen backbone's own q/k/v. One no-grad teacher forward over whole rows gives every layer's q/k/v and
// full-attention output o_full; then, at each budget of `budgets`, the engine's eviction under the base
// policy is replayed on those q/k/v in chunks — the backbone's own attention path (attend_over_cache) with
// the engine's own hook (MemoryAugmentedCache), so o = attention(retained + chunk) + g(q)·m(q) exactly as in
// eval — and L_MSE (losses/memory_mse.h) is averaged over layers and budgets. Only the memory's parameters
// get gradients: the teacher tensors are constants. Registered as train.method memory; evaluated by
// "<memory.policy>+mem".
//
// memory.loss kl trains the same memory end to end instead: at each budget the engine's own chunked forward
// (the budgeted cache under the base policy, the memory hook, every layer fed by the layers below it as in
// eval) runs with gradients, and the loss is KL(teacher ‖ student) of the next-token distributions over the
// real positions of the chunks after the first eviction (losses/distillation.h), averaged over budgets. The
// local MSE sees each layer on the teacher's inputs; the KL also sees how a read's error compounds through
// the layers above it, and weighs errors by what they do to the prediction, which is what eval measures.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "losses/distillation.h"
#include "modules/backbone.h"
#include "modules/latent_memory.h"
#include "modules/policies/registry.h"
#include "modules/trained_modules.h"
#include "train/training_method.h"

namespace kvbound {

// What the memory is trained to match: each layer's full-attention output (mse, local) or the full model's
// next-token distribution through the budgeted forward (kl, end to end).
enum class MemoryLoss { Mse, Kl };
MemoryLoss parse_memory_loss(const std::string& name);
std::string memory_loss_name(MemoryLoss loss);

struct MemorySettings {
  LatentMemorySettings memory;
  MemoryLoss loss = MemoryLoss::Mse;
  std::int64_t loss_block_rows = 128;         // kl: positions whose vocabulary logits exist at once
  std::string policy = "h2o";                // the base policy the memory will be used with
  std::vector<std::int64_t> budgets{16, 32};  // replayed budgets M (a memory trained at one M hurt at 4x that)
  std::int64_t chunk = 16;                    // replay chunk, like the engine's prefill chunk
  Config policy_config = kvbound::policy_config();  // the base policy's keys (recent window, ...)
  TrainedModules base_modules;                // a learned base policy's weights (stage 1, constants)
  // Where those weights came from: init_from (the file), init_from_step, init_from_config_hash (metadata).
  std::map<std::string, std::string> base_weights;
};

class MemoryMethod final : public TrainingMethod {
 public:
  MemoryMethod(const Backbone& model, const MemorySettings& settings, std::uint64_t seed);

  std::string name() const override { return "memory"; }
  std::map<std::string, at::Tensor> named_parameters() const override { return memory_->named_tensors(); }
  StepLoss loss(const Batch& batch) override;
  // The base policy with this memory attached ("<policy>+mem"): the periodic eval runs the +mem hook.
  std::unique_ptr<EvictionPolicy> eval_policy() const override { return with_memory_.make(seed_); }
  std::map<std::string, std::string> metadata() const override;
  // kl has no per-layer term; its per-budget KL goes to the stats instead.
  std::string per_layer_name() const override { return "mse_per_layer"; }

 private:
  StepLoss mse_loss(const Batch& batch);
  StepLoss kl_loss(const Batch& batch);

  const Backbone& model_;
  MemorySettings settings_;
  std::uint64_t seed_;
  std::shared_ptr<LatentMemory> memory_;
  ConfiguredPolicy base_, with_memory_;  // the replayed policy, and it with the live memory attached
  std::optional<losses::DistillationHead> head_;  // the frozen LM head prepared once, for the kl loss
};

// The settings of train.method memory (memory.*, the policy keys) from a run's config; a learned
// memory.policy takes its weights from setup's init_from modules. kvbound::Error naming the key otherwise.
struct MethodSetup;
MemorySettings memory_settings(const MethodSetup& setup);

}  // namespace kvbound
