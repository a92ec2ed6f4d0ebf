// The frozen Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): RMSNorm, RoPE in
// Hugging Face's rotate-half convention (with Llama-3 scaling), GQA, SwiGLU, tied or untied head.
// Every parameter has requires_grad=false. Attention reads and writes a KVCache; an AttentionHook
// sees each layer's q/k/v and may evict from the cache or change the attention output.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "checkpoints/weights.h"
#include "modules/kv_cache.h"
#include "checkpoints/model_config.h"
#include "ops/bf16x3_linear.h"

namespace kvbound {

// What a hook sees of one attention call of one layer. Shapes: B batch, T new tokens, Hq query heads,
// Hkv KV heads, D head_dim.
struct AttentionCall {
  std::int64_t layer = 0;
  at::Tensor normed_input;  // [B, T, hidden]: input_layernorm(h), what q/k/v are projected from
  at::Tensor q, k, v;       // [B, Hq|Hkv, T, D]; q and k after RoPE
  at::Tensor q_pre_rope, k_pre_rope;
  at::Tensor inv_freq;      // [D/2] float32: the RoPE frequencies q and k were rotated with (undo_rope)
  at::Tensor positions;     // [T] int64: start, start + 1, ..., start + T - 1
  std::int64_t start = 0;   // the chunk's first position, known on the host (no device sync to read it)
  at::Tensor output;        // [B, Hq, T, D]: set by attention, before o_proj; after_attention may replace it
  // A hook that weighs something against what the attention saw (a latent memory's slot read) sets this in
  // before_attention; attend_over_cache then also sets `logsumexp`, each query's row logsumexp [B, Hq, T, 1]
  // (float32, scale 1/√D) over the entries it attended, from the same pass as `output` where the device's
  // attention kernel returns it (CPU), so the scores are not formed twice.
  bool wants_logsumexp = false;
  at::Tensor logsumexp;
  // Set by a float32 backbone whose products are bf16x3 (Backbone::set_float32_products): attention's products
  // too, where ops/causal_attention_cpu takes the chunk. Calls made elsewhere (the trainers' replays) keep SDPA.
  bool bf16x3 = false;
  // Set by a hook in before_attention (the trimkv policy's gated read, trimkv.gated_read): one log decay rate per
  // entry the chunk will attend, [B, Hkv, N] float32 over the cached entries followed by the chunk's own. Each
  // query's logit of entry i then gets (pos_q − pos_i)·rate_i added, the retention-gated attention the gates
  // were trained under (β_i^(t−i)), instead of reading the retained entries plainly.
  at::Tensor key_log_decay;
};

class AttentionHook {
 public:
  virtual ~AttentionHook() = default;
  // Before the chunk's keys enter the cache and before attention (pre-eviction happens here).
  virtual void before_attention(AttentionCall& call, KVCache& cache) { (void)call; (void)cache; }
  // After attention over the cache (which now holds the chunk too); may edit call.output or evict.
  virtual void after_attention(AttentionCall& call, KVCache& cache) { (void)call; (void)cache; }
  // A hook that replaces attention (training: TRIM-KV's gated attention) computes call.output itself from the
  // chunk's q/k/v alone; the chunk then never enters the cache, so such forwards see one whole sequence.
  virtual bool replaces_attention() const { return false; }
  virtual at::Tensor attend(const AttentionCall& call) { (void)call; return {}; }
};

// One layer's attention of a chunk over the KV cache, the one path of the backbone's forward and of the
// trainers' replays of captured q/k/v: the hook's before_attention (pre-eviction), the chunk appended to the
// cache, scaled dot-product attention over "every cached entry + causal within the chunk" (every cached entry
// precedes the chunk, so one mask serves all heads), then the hook's after_attention. Sets call.output, and
// call.logsumexp when the hook asked for it.
void attend_over_cache(AttentionCall& call, KVCache& cache, AttentionHook* hook);

class Backbone {
 public:
  // Loads an HF folder or .gguf file in `dtype` (kFloat or kBFloat16) onto `device` and checks every tensor.
  static std::unique_ptr<Backbone> load(const std::string& path, at::ScalarType dtype, c10::Device device = c10::kCPU);
  explicit Backbone(LoadedCheckpoint checkpoint, c10::Device device = c10::kCPU);

  const ModelConfig& config() const { return config_; }
  const std::string& source() const { return source_; }
  // The model's own name (config.json _name_or_path, GGUF general.name, else the path's stem) and a hash of
  // its weight files' bytes (base/content_hash.h, computed on first use): an identity that holds on any
  // machine, unlike the path.
  const std::string& name() const { return name_; }
  const std::string& content_hash() const;
  const std::string& format() const { return format_; }
  at::ScalarType dtype() const { return dtype_; }
  // Where every weight lives and every forward computes (tokens may come from the CPU).
  c10::Device device() const { return device_; }
  const std::map<std::string, std::int64_t>& stored_types() const { return stored_types_; }
  std::int64_t num_parameters() const;
  std::int64_t parameter_bytes() const;

  // Runs tokens [B, T] at positions cache.next_position() + [0, T) through every layer, appending their
  // keys/values to `cache`; returns the final normed hidden states [B, T, hidden] (compute dtype, on the
  // backbone's device). Host token ids outside the vocabulary are a kvbound::Error; ids already on an
  // accelerator (the model's own argmax, fed back while decoding) are not checked, so decoding on the device
  // makes no host synchronisation per token.
  at::Tensor forward_hidden(const at::Tensor& tokens, KVCache& cache, AttentionHook* hook = nullptr) const;
  // Logits [B, T, vocab] for hidden states from forward_hidden, in the compute dtype (as transformers returns
  // them; a float32 copy of bf16 logits costs more than any consumer's upcast: log_softmax(x, -1, kFloat)).
  at::Tensor logits(const at::Tensor& hidden) const;
  // The output projection [vocab, hidden] (the embedding when tied): blockwise losses form logits from it.
  const at::Tensor& lm_head() const { return lm_head_; }
  at::Tensor forward(const at::Tensor& tokens, KVCache& cache, AttentionHook* hook = nullptr) const {
    return logits(forward_hidden(tokens, cache, hook));
  }
  KVCache make_cache() const { return KVCache(config_.num_layers); }
  // How a float32 backbone on the CPU forms its frozen projections and logits: kFloat32 through ATen's float32
  // GEMM, kBf16x3 on the bfloat16 tile units as three bfloat16 passes (ops/bf16x3_linear.h: worst case ~2^-15
  // of Σ|x|·|w|, within the float32 goldens' tolerance, about half the time); an input that carries a gradient
  // gets it through the float32 weights. kBf16x3 packs every projection's W_hi and W_lo once (as many more bytes
  // as the float32 weights) where this CPU has AMX; elsewhere, in bfloat16 compute and on other devices it is
  // refused (returns false) and the float32 GEMM runs, as it does for chunks of fewer than kBf16x3MinRows rows
  // (B·T: a decode step of fewer than 8 sequences; one float32 pass over the same bytes was faster at 1–2 rows).
  // Prefill chunks' attention too (AttentionCall::bf16x3; ops/causal_attention_cpu.h, from 128 queries).
  // The trainers' losses form their logits from lm_head() themselves (losses::DistillationHead), in float32.
  // Returns whether the bf16x3 products are on.
  enum class Float32Products { kFloat32, kBf16x3 };
  static constexpr std::int64_t kBf16x3MinRows = 8;
  bool set_float32_products(Float32Products products);
  Float32Products float32_products() const { return bf16x3_on_ ? Float32Products::kBf16x3 : Float32Products::kFloat32; }
  // The frozen model's own final hidden states for tokens [B, T] from an empty cache, without autograd: the
  // teacher side of every distillation loss. `hook` may watch (capture the teacher's attention inputs).
  at::Tensor teacher_hidden(const at::Tensor& tokens, AttentionHook* hook = nullptr) const;
  // The same forward as far as the last layer's attention inputs, for a hook that reads only before_attention's
  // call (IndexMem stage 1's targets and inputs): that layer's attention and MLP and the final norm, which nothing
  // would read, are not computed (1/num_layers of the forward).
  void teacher_attention_inputs(const at::Tensor& tokens, AttentionHook& hook) const;

 private:
  struct Layer {
    at::Tensor input_norm, q_proj, k_proj, v_proj, o_proj, q_bias, k_bias, v_bias, q_norm, k_norm;
    at::Tensor post_norm, gate_proj, up_proj, down_proj;
    ops::Bf16x3Weight q_tiles, k_tiles, v_tiles, o_tiles, gate_tiles, up_tiles, down_tiles;  // when bf16x3 is on
  };
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) const;
  // Whether the frozen projections of input x take the bf16x3 path (set_float32_products).
  bool on_bf16x3(const at::Tensor& x) const;
  // The layers over tokens; with attention_inputs_only, up to the last layer's hook->before_attention (returns {}).
  at::Tensor run_layers(const at::Tensor& tokens, KVCache& cache, AttentionHook* hook, bool attention_inputs_only) const;
  // A layer's attention call up to attention itself: normed input, q/k/v, RoPE.
  AttentionCall attention_inputs(const Layer& L, std::int64_t layer, const at::Tensor& x, const at::Tensor& positions,
                                 const at::Tensor& cos, const at::Tensor& sin, const KVCache& cache) const;
  at::Tensor attention(const Layer& L, std::int64_t layer, const at::Tensor& x, const at::Tensor& positions,
                       const at::Tensor& cos, const at::Tensor& sin, KVCache& cache, AttentionHook* hook) const;

  ModelConfig config_;
  std::string source_, format_, name_;
  std::vector<std::string> weight_files_;
  mutable std::string content_hash_;  // filled by content_hash()
  std::map<std::string, std::int64_t> stored_types_;
  at::ScalarType dtype_ = at::kFloat;
  c10::Device device_ = c10::kCPU;
  at::Tensor embed_, final_norm_, lm_head_, inv_freq_;
  ops::Bf16x3Weight lm_head_tiles_;
  bool bf16x3_on_ = false;
  std::vector<Layer> layers_;
};

// The MLP activation named by a config's hidden_act (silu, gelu, gelu_pytorch_tanh, relu): the backbone's
// MLP and the retention gates use it.
at::Tensor apply_activation(const std::string& hidden_act, const at::Tensor& x);

// The RoPE inverse frequencies [D/2] (float32) for a config, Llama-3 scaling included.
at::Tensor rope_inverse_frequencies(const ModelConfig& config);

// RoPE (rotate-half) of x [..., T, D] at positions [T] with inverse frequencies [D/2], in the backbone's
// arithmetic: modules with their own head size (the IndexMem indexer) rotate the same way.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq);
// The inverse rotation, in float32, of keys x [..., N, D] that sit at `positions` [..., N] (per entry: a
// cache's entries after evictions): the pre-RoPE keys back from cached ones, equal to them up to float
// rounding, so a latent memory needs no copy of them beside the cache.
at::Tensor undo_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq);

}  // namespace kvbound
