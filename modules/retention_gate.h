// TRIM-KV's retention gates (DESIGN.md, "TRIM-KV"): one small MLP per layer on the layer's normalised input
// x_t = input_layernorm(h_t) gives one retention score per token and KV head,
//
//   z = W2 · act(W1 x_t + c1) + b,   log β = logsigmoid(z)   (≤ 0; β_i^(t−i) is token i's weight at age t−i).
//
// Tensor names follow the official TRIM-KV release, so an export loads into its Python models:
//   model.layers.{i}.self_attn.retention_gate.linear1.weight [h, d], .linear1.bias [h],
//   .linear2.weight [Hkv, h], .bias [Hkv].
// Gate parameters are float32 whatever the backbone's compute dtype (they are tiny; training them in bf16
// would round away the small updates a bias near 8–18 receives).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "modules/backbone.h"
#include "checkpoints/model_config.h"

namespace kvbound {

struct RetentionGateSettings {
  std::int64_t hidden = 128;  // h: 128 for tiny models, 512 for billion-scale ones
  double bias_init = 8.0;     // b at init: 8 (the released Qwen3 checkpoint) or 18 (the paper)
  double init_std = 0.02;     // W1, W2 ~ N(0, init_std); c1 = 0
};

class RetentionGates {
 public:
  // Fresh gates for a backbone, drawn from `seed` (same seed, same weights).
  static RetentionGates init(const ModelConfig& config, const RetentionGateSettings& settings, std::uint64_t seed);
  // Gates from named tensors (an export or a run checkpoint), as constants (no gradient). Every layer's four tensors must be present
  // with the shapes `config` implies; otherwise kvbound::Error naming `source` and the tensor.
  static RetentionGates from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& config,
                                     const std::string& source);

  // Moves every tensor to `device` (trainable ones stay trainable leaves); modules live on the run's device.
  void to(c10::Device device);

  // log β [B, Hkv, T] (float32) for layer `layer` from its normalised input x [B, T, hidden].
  at::Tensor log_beta(std::int64_t layer, const at::Tensor& x) const;

  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers_.size()); }
  std::int64_t hidden() const { return layers_.empty() ? 0 : layers_.front().w1.size(0); }
  // The trainable leaves in a fixed order (layer-major: linear1.weight, linear1.bias, linear2.weight, bias).
  std::vector<at::Tensor> parameters() const;
  // Every tensor under its official name, sharing storage with the parameters.
  std::map<std::string, at::Tensor> named_tensors() const;
  std::int64_t num_parameters() const;

  static std::string tensor_prefix(std::int64_t layer);

 private:
  struct Layer {
    at::Tensor w1, c1, w2, b;
  };
  std::string activation_;
  std::vector<Layer> layers_;
};

// The training attention hook: every layer's attention becomes TRIM-KV's gated attention
// (ops::retention_attention with this layer's log β); the log β of every layer is kept for the capacity loss.
// With a cut (RetentionCut::budget > 0: trimkv.cut_budget) the forward is instead the deployment's: plain
// attention over the keys the trimkv policy would keep at M (modules/retention_cut.h), and the gates' gradient
// the gated attention's (a straight-through estimate: the cut itself has none, and an evicted key must still
// learn that it was missed).
class GatedAttentionHook final : public AttentionHook {
 public:
  // sinks s: positions 0..s−1 keep β = 1 (log β = 0, no gradient), what the trimkv policy's trimkv.sinks
  // keeps at deployment whatever the gates say; so training neither charges nor credits the gates for them.
  explicit GatedAttentionHook(const RetentionGates& gates, std::int64_t sinks = 0, std::int64_t cut_budget = 0,
                              std::int64_t cut_chunk = 64)
      : gates_(gates), sinks_(sinks), cut_budget_(cut_budget), cut_chunk_(cut_chunk) {}
  bool replaces_attention() const override { return true; }
  at::Tensor attend(const AttentionCall& call) override;
  // [B, Hkv, T] per layer, from the last forward.
  const std::vector<at::Tensor>& log_betas() const { return log_betas_; }

 private:
  const RetentionGates& gates_;
  std::int64_t sinks_, cut_budget_, cut_chunk_;
  std::vector<at::Tensor> log_betas_;
};

}  // namespace kvbound
