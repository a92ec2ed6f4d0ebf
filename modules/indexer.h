// IndexMem's learned indexer (DESIGN.md, "IndexMem"), one per layer, trained to predict which cached keys
// later queries will attend to:
//
//   qI[t,h] = rope(RMSNorm(W_q q_pre_rope[t,h]))   W_q [d_I, head_dim], shared by the query heads
//   kI[t,g] = rope(RMSNorm(W_k^g x_t))             W_k [Hk·d_I, hidden]; Hk = Hkv ("kv") or 1 ("1")
//   w[t,h]  = sigmoid(W_w x_t + b_w)               W_w [Hq, hidden], b_w [Hq]
//   I_g[s,t] = Σ_{h∈g} w[s,h] · act(qI[s,h]·kI[t,g]) / √d_I
//   b_g[t]   = W_b^g x_t                           W_b [Hk, hidden]; only with key_bias
//
// b_g[t] is a key's query-independent importance: the pooled score is pool_s I_g[s,t] + b_g[t], and the policy
// ranks by its running statistic of I plus b. RoPE on every dimension of qI and kI leaves the dot product no
// query-independent term, so without it a key's score is only what the current queries make of it.
// x_t = input_layernorm(h_t), the layer's normalised input. RMSNorm has no weight (eps 1e-6); RoPE uses the
// backbone's frequencies and rope_theta at head size d_I. Parameters are float32 whatever the backbone's dtype.
// Tensor names: model.layers.{i}.self_attn.indexer.{wq, wk, ww, bw} and, with key_bias, wb.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoints/model_config.h"

namespace kvbound {

struct IndexerSettings {
  std::int64_t d_index = 32;     // d_I (even when rope is on)
  std::string key_heads = "kv";  // "kv": one key per KV head; "1": one key shared by all heads (the seed's)
  bool rope = true;
  bool relu = false;             // act in I_g: identity (default) or relu (ablation)
  double init_std = 0.02;        // W_q, W_k, W_w ~ N(0, init_std); b_w = 0
  bool key_bias = false;         // b_g[t] = W_b^g x_t (W_b = 0 at init: training starts from the plain indexer)
};

// The settings an export's metadata describes (the keys indexer_metadata writes; missing ones: defaults),
// and back. Throws kvbound::Error naming `source` for an unparsable value.
IndexerSettings indexer_settings(const std::map<std::string, std::string>& metadata, const std::string& source);
std::map<std::string, std::string> indexer_metadata(const IndexerSettings& settings);

class Indexer {
 public:
  // A fresh indexer drawn from `seed` (same seed, same weights); trainable leaves.
  static Indexer init(const ModelConfig& config, const IndexerSettings& settings, std::uint64_t seed);
  // From named tensors (an export or a run checkpoint), as constants. Every layer's tensors must be present
  // with the shapes `config` and `settings` imply; otherwise kvbound::Error naming `source` and the tensor.
  static Indexer from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& config,
                              const IndexerSettings& settings, const std::string& source);

  // Moves every tensor to `device` (trainable ones stay trainable leaves); modules live on the run's device.
  void to(c10::Device device);

  // qI [B, Hq, T, d_I] from pre-RoPE queries [B, Hq, T, head_dim] at positions [T].
  at::Tensor query(std::int64_t layer, const at::Tensor& q_pre_rope, const at::Tensor& positions) const;
  // kI [B, Hk, T, d_I] from the normalised input x [B, T, hidden].
  at::Tensor key(std::int64_t layer, const at::Tensor& x, const at::Tensor& positions) const;
  // w [B, Hq, T] from x [B, T, hidden].
  at::Tensor head_weights(std::int64_t layer, const at::Tensor& x) const;
  // b [B, Hk, T] from x [B, T, hidden]; settings().key_bias only.
  at::Tensor key_bias(std::int64_t layer, const at::Tensor& x) const;
  // The same four for every layer at once (training's loss), one input per layer in layer order, each [B, ...]
  // as above: the results concatenated along the batch dim, [layers·B, ...] with row l·B + b layer l's row b.
  // Only the projections run per layer; the norms, RoPE and sigmoid run once over all layers (a step's worth of
  // small ops, and their backward, one per step rather than one per layer).
  at::Tensor queries(const std::vector<at::Tensor>& q_pre_rope, const at::Tensor& positions) const;
  at::Tensor keys(const std::vector<at::Tensor>& x, const at::Tensor& positions) const;
  at::Tensor head_weights(const std::vector<at::Tensor>& x) const;
  at::Tensor key_biases(const std::vector<at::Tensor>& x) const;
  // I_g[s,t] [B, Hc, S, N] for queries qI [B, Hq, S, d_I], w [B, Hq, S] and keys kI [B, Hc, N, d_I] where
  // Hc is the cache's KV heads (Hk = 1 keys are stored per KV head, since eviction differs per head).
  at::Tensor score(const at::Tensor& qI, const at::Tensor& w, const at::Tensor& kI) const;

  const IndexerSettings& settings() const { return settings_; }
  std::vector<at::Tensor> parameters() const;
  // Every tensor under its export name, sharing storage with the parameters.
  std::map<std::string, at::Tensor> named_tensors() const;

  static std::string tensor_prefix(std::int64_t layer);

 private:
  Indexer(const ModelConfig& config, const IndexerSettings& settings);
  struct Layer {
    at::Tensor wq, wk, ww, bw;
    at::Tensor wb;  // key_bias only
  };
  // qI and kI from their projections: RMSNorm, then RoPE where on. projected_keys [B, T, Hk·d_I].
  at::Tensor finish_queries(const at::Tensor& projected, const at::Tensor& positions) const;
  at::Tensor finish_keys(const at::Tensor& projected_keys, const at::Tensor& positions) const;
  IndexerSettings settings_;
  std::int64_t key_heads_ = 1;
  at::Tensor inv_freq_;  // RoPE at head size d_I
  std::vector<Layer> layers_;
};

}  // namespace kvbound
