// IndexMem's latent memory (DESIGN.md, "Latent memory"): an add-on for any eviction policy that folds
// every evicted token into a small linear-attention state per layer and KV head g, and adds what the
// chunk's queries read from it to the attention output (before o_proj):
//
//   k̂ = φ(W_mk^g k_pre), q̂ = φ(W_mq^g q_pre), φ(x) = elu(x) + 1          (pre-RoPE q/k)
//   eviction of token i:  Mem_g ← λ_g Mem_g + k̂_i v_iᵀ,  z_g ← λ_g z_g + k̂_i,  λ_g = sigmoid(θ_g)
//   read:  m(q) = (q̂ᵀ Mem_g) / (q̂ᵀ z_g + ε), per query head one of
//     add:   o = o_attn + g(q)·m(q),  g(q) = sigmoid(w_g·q_pre + c_g);
//     slot:  the memory is one more entry in the retained keys' softmax, with value m(q) and logit
//            s_m(q) = log((q̂ᵀ z_g + ε) / d_m) + w_g·q_pre + c_g (a linear-attention estimate of the evicted
//            tokens' total exp-score, corrected by a learned term), so with lse = log Σ_retained exp(q·k/√D)
//            o = o_attn + α (m − o_attn),  α = sigmoid(s_m − lse).
//   Add gives the memory the same weight beside a nearly full cache as beside a starved one; the slot's
//   weight shrinks as the retained keys' mass grows and grows with the evicted mass z.
//
// Tensor names (per layer i): model.layers.{i}.self_attn.latent_memory.
//   wk [Hkv, d_m, D], wq [Hkv, d_m, D], theta [Hkv], wg [Hq, D], cg [Hq].
// Parameters are float32 whatever the backbone's compute dtype (like the retention gates).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoints/model_config.h"

namespace kvbound {

// How a read enters the attention output (see above). Files without the `memory_read` metadata key are add
// (the only read before slot existed); slot is the default, better on stories260K and SmolLM2 (DESIGN.md).
enum class MemoryRead { Add, Slot };
MemoryRead parse_memory_read(const std::string& name, const std::string& source, const std::string& field);
std::string memory_read_name(MemoryRead read);
// c_g at init. add: −4, the gate starts almost closed and opens as training finds it useful. slot: 0, the
// memory starts weighted like its evicted tokens at their φ-similarity (the slot's own normalisation).
constexpr double initial_gate_bias(MemoryRead read) { return read == MemoryRead::Slot ? 0.0 : -4.0; }

struct LatentMemorySettings {
  MemoryRead read = MemoryRead::Slot;
  std::int64_t dim = 16;          // d_m
  double proj_std = 0.1;          // W_mk, W_mq ~ N(0, proj_std): φ starts near 1, i.e. a plain running mean
  double decay_init = 0.99;       // λ at init: θ = log(λ / (1 − λ))
  double gate_std = 0.02;         // w_g ~ N(0, gate_std)
  double gate_bias_init = initial_gate_bias(MemoryRead::Slot);
};

// The memory of one sequence batch: per layer Mem [B, Hkv, d_m, D] and z [B, Hkv, d_m] (float32),
// undefined until the layer's first eviction (an empty memory reads as exactly 0).
class MemoryState {
 public:
  explicit MemoryState(std::int64_t num_layers) : layers_(static_cast<std::size_t>(num_layers)) {}
  struct Layer {
    at::Tensor mem, z;
  };
  Layer& layer(std::int64_t i) { return layers_.at(static_cast<std::size_t>(i)); }
  const Layer& layer(std::int64_t i) const { return layers_.at(static_cast<std::size_t>(i)); }

 private:
  std::vector<Layer> layers_;
};

class LatentMemory {
 public:
  static constexpr double kEpsilon = 1e-6;

  // A fresh memory for a backbone, drawn from `seed` (same seed, same weights); parameters require grad.
  static LatentMemory init(const ModelConfig& config, const LatentMemorySettings& settings, std::uint64_t seed);
  // A memory from named tensors (an export), as constants. d_m comes from the shapes; every layer's five
  // tensors must be present with shapes `config` implies, else kvbound::Error naming `source` and the tensor.
  static LatentMemory from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& config,
                                   MemoryRead read, const std::string& source);

  // Moves every tensor to `device` (trainable ones stay trainable leaves); modules live on the run's device.
  void to(c10::Device device);

  // Folds evicted tokens into `state`: k_pre (pre-RoPE keys), v [B, Hkv, E, D], in position order (token
  // E−1 is the newest). Closed form of E one-token updates: Mem ← λ^E Mem + Σ_i λ^(E−1−i) k̂_i v_iᵀ.
  void write(std::int64_t layer, MemoryState& state, const at::Tensor& k_pre, const at::Tensor& v) const;
  // The chunk's attention output `attention` [B, Hq, T, D] (over the retained entries + the chunk) with the
  // memory's read for pre-RoPE queries q_pre [B, Hq, T, D] mixed in, float32. `retained_lse` [B, Hq, T, 1]
  // is that attention's row logsumexp (scale 1/√D), needed by slot only (see needs_retained_lse). Returns
  // `attention` itself while the layer's memory is empty.
  at::Tensor mix(std::int64_t layer, const MemoryState& state, const at::Tensor& q_pre, const at::Tensor& attention,
                 const at::Tensor& retained_lse) const;
  MemoryRead read_mode() const { return read_; }
  bool needs_retained_lse() const { return read_ == MemoryRead::Slot; }

  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers_.size()); }
  std::int64_t dim() const { return layers_.empty() ? 0 : layers_.front().wk.size(1); }
  // The trainable leaves, layer-major: wk, wq, theta, wg, cg.
  std::vector<at::Tensor> parameters() const;
  // Every tensor under its name, sharing storage with the parameters.
  std::map<std::string, at::Tensor> named_tensors() const;
  std::int64_t num_parameters() const;

  static std::string tensor_prefix(std::int64_t layer);

 private:
  struct Layer {
    at::Tensor wk, wq, theta, wg, cg;
  };
  std::vector<Layer> layers_;
  MemoryRead read_ = MemoryRead::Add;
};

}  // namespace kvbound
