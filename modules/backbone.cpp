#include "modules/backbone.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tril.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/where.h>

#include <cmath>
#include <set>

#include "base/content_hash.h"
#include "base/errors.h"
#include "checkpoints/model_loader.h"
#include "ops/causal_attention_cpu.h"
#include "ops/causal_attention_float32.h"
#include "ops/gated_activation.h"
#include "ops/onednn_linear.h"
#include "ops/rms_norm.h"
#include "ops/rope.h"

namespace kvbound {

at::Tensor rope_inverse_frequencies(const ModelConfig& c) {
  // Same float32 arithmetic as transformers' default RoPE init, so positions far out agree to 1e-6.
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor exponent = at::arange(0, c.head_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                        static_cast<double>(c.head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(at::scalar_tensor(c.rope_theta, f32), exponent);
  if (c.rope_scaling.type == "llama3") {
    // Llama-3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    const auto& s = c.rope_scaling;
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_ctx / s.low_freq_factor;
    const double high_freq_wavelen = old_ctx / s.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    at::Tensor smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  return inv_freq;
}

namespace {

// The rotation angles [..., D] (float32) of RoPE at `positions` [...]: each frequency twice, for rotate_half.
at::Tensor rope_angles(const at::Tensor& positions, const at::Tensor& inv_freq) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq.to(at::kFloat);  // [..., D/2]
  return at::cat({freqs, freqs}, -1);
}

class TensorTable {
 public:
  TensorTable(std::map<std::string, at::Tensor>& tensors, std::string source)
      : tensors_(tensors), source_(std::move(source)) {}

  // The tensor `name` with exactly `shape`; a missing tensor or another shape is an error naming both.
  at::Tensor take(const std::string& name, std::vector<std::int64_t> shape) {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) fail(source_, name, "missing tensor");
    if (it->second.sizes() != at::IntArrayRef(shape))
      fail(source_, name, "shape " + shape_str(it->second.sizes().vec()) + " expected " + shape_str(shape));
    if (dtype_ && it->second.scalar_type() != *dtype_)
      fail(source_, name, std::string("dtype ") + c10::toString(it->second.scalar_type()) + " differs from the embedding's");
    dtype_ = it->second.scalar_type();
    used_.insert(name);
    return it->second;
  }
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  void reject_unused() const {
    for (const auto& [name, t] : tensors_) {
      if (used_.count(name) || name.find("rotary_emb.inv_freq") != std::string::npos) continue;
      if (name == "lm_head.weight") continue;  // tied models may still carry a copy; the embedding wins, as in HF
      fail(source_, name, "unexpected tensor for this architecture (wrong config?)");
    }
  }

 private:
  static std::string shape_str(const std::vector<std::int64_t>& s) {
    std::string out = "[";
    for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + "]";
  }
  std::map<std::string, at::Tensor>& tensors_;
  std::string source_;
  std::set<std::string> used_;
  std::optional<at::ScalarType> dtype_;  // every backbone tensor shares the embedding's dtype
};

}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  const at::Tensor emb = rope_angles(positions, inv_freq);  // [T, D]
  return ops::rope_rotate(x, emb.cos().to(x.scalar_type()), emb.sin().to(x.scalar_type()));
}

at::Tensor undo_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  const at::Tensor emb = rope_angles(positions, inv_freq);  // [..., N, D]
  const at::Tensor k = x.to(at::kFloat);
  return k * emb.cos() - ops::rotate_half(k) * emb.sin();  // the rotation by −θ of apply_rope's +θ
}

std::unique_ptr<Backbone> Backbone::load(const std::string& path, at::ScalarType dtype, c10::Device device) {
  return std::make_unique<Backbone>(load_checkpoint(path, dtype), device);
}

Backbone::Backbone(LoadedCheckpoint ck, c10::Device device)
    : config_(ck.config), source_(ck.source), format_(ck.format), name_(ck.name), weight_files_(ck.weight_files),
      stored_types_(ck.stored_types), device_(device) {
  config_.validate(source_);
  const auto& c = config_;
  const std::int64_t d = c.hidden_size, q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  TensorTable t(ck.tensors, source_);
  embed_ = t.take("model.embed_tokens.weight", {c.vocab_size, d});
  dtype_ = embed_.scalar_type();
  final_norm_ = t.take("model.norm.weight", {d});
  lm_head_ = c.tie_word_embeddings ? embed_ : t.take("lm_head.weight", {c.vocab_size, d});
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer L;
    L.input_norm = t.take(p + "input_layernorm.weight", {d});
    L.q_proj = t.take(p + "self_attn.q_proj.weight", {q_dim, d});
    L.k_proj = t.take(p + "self_attn.k_proj.weight", {kv_dim, d});
    L.v_proj = t.take(p + "self_attn.v_proj.weight", {kv_dim, d});
    L.o_proj = t.take(p + "self_attn.o_proj.weight", {d, q_dim});
    if (c.attention_bias) {
      L.q_bias = t.take(p + "self_attn.q_proj.bias", {q_dim});
      L.k_bias = t.take(p + "self_attn.k_proj.bias", {kv_dim});
      L.v_bias = t.take(p + "self_attn.v_proj.bias", {kv_dim});
    }
    if (c.qk_norm) {
      L.q_norm = t.take(p + "self_attn.q_norm.weight", {c.head_dim});
      L.k_norm = t.take(p + "self_attn.k_norm.weight", {c.head_dim});
    }
    L.post_norm = t.take(p + "post_attention_layernorm.weight", {d});
    L.gate_proj = t.take(p + "mlp.gate_proj.weight", {c.intermediate_size, d});
    L.up_proj = t.take(p + "mlp.up_proj.weight", {c.intermediate_size, d});
    L.down_proj = t.take(p + "mlp.down_proj.weight", {d, c.intermediate_size});
    layers_.push_back(std::move(L));
  }
  t.reject_unused();
  // The backbone is frozen: nothing here is a trainable parameter.
  for (auto& [name, tensor] : ck.tensors) tensor.set_requires_grad(false);
  inv_freq_ = rope_inverse_frequencies(c);
  if (!device_.is_cpu()) {  // on the CPU the memory-mapped views stay as they are
    for (at::Tensor* w : {&embed_, &final_norm_, &inv_freq_}) *w = w->to(device_);
    lm_head_ = c.tie_word_embeddings ? embed_ : lm_head_.to(device_);
    for (Layer& L : layers_)
      for (at::Tensor* w : {&L.input_norm, &L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.q_bias, &L.k_bias, &L.v_bias,
                            &L.q_norm, &L.k_norm, &L.post_norm, &L.gate_proj, &L.up_proj, &L.down_proj})
        if (w->defined()) *w = w->to(device_);
  }
}

bool Backbone::set_float32_products(Float32Products products) {
  const bool on = products == Float32Products::kBf16x3 && dtype_ == at::kFloat && device_.is_cpu() &&
                  ops::bf16x3_available();
  auto prepare = [on](const at::Tensor& w) { return on ? ops::Bf16x3Weight(w) : ops::Bf16x3Weight(); };
  if (on != bf16x3_on_) {
    lm_head_tiles_ = prepare(lm_head_);
    for (Layer& L : layers_) {
      L.q_tiles = prepare(L.q_proj);
      L.k_tiles = prepare(L.k_proj);
      L.v_tiles = prepare(L.v_proj);
      L.o_tiles = prepare(L.o_proj);
      L.gate_tiles = prepare(L.gate_proj);
      L.up_tiles = prepare(L.up_proj);
      L.down_tiles = prepare(L.down_proj);
    }
  }
  bf16x3_on_ = on;
  return on;
}

bool Backbone::on_bf16x3(const at::Tensor& x) const {
  return bf16x3_on_ && x.is_cpu() && x.scalar_type() == at::kFloat && x.numel() >= kBf16x3MinRows * x.size(-1) &&
         ops::bf16x3_available();
}

namespace {

// The input of one or more frozen projections: on the bf16x3 path its rows are split once, on first use, for
// every weight that reads it (q, k and v; gate and up); off it, float32 products on oneDNN where MKL's sgemm would
// run its AVX2 kernels (ops/onednn_linear.h), ATen's GEMM otherwise.
class ProjectionInput {
 public:
  ProjectionInput(at::Tensor x, bool bf16x3) : x_(std::move(x)), bf16x3_(bf16x3) {}
  at::Tensor apply(const at::Tensor& weight, const ops::Bf16x3Weight& tiles, const at::Tensor& bias = {}) {
    if (!bf16x3_) return ops::onednn::preferred_linear(x_, weight, bias);
    if (!split_.hi.defined()) split_ = ops::split_rows(x_);
    return ops::bf16x3_linear(x_, split_, tiles, weight, bias);
  }

 private:
  at::Tensor x_;
  bool bf16x3_;
  ops::Bf16x3Rows split_;
};

}  // namespace

const std::string& Backbone::content_hash() const {
  if (content_hash_.empty()) content_hash_ = files_content_hash(weight_files_);
  return content_hash_;
}

std::int64_t Backbone::num_parameters() const {
  std::int64_t n = embed_.numel() + final_norm_.numel() + (config_.tie_word_embeddings ? 0 : lm_head_.numel());
  for (const Layer& L : layers_)
    for (const at::Tensor* w : {&L.input_norm, &L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.q_bias, &L.k_bias,
                                &L.v_bias, &L.q_norm, &L.k_norm, &L.post_norm, &L.gate_proj, &L.up_proj, &L.down_proj})
      if (w->defined()) n += w->numel();
  return n;
}

std::int64_t Backbone::parameter_bytes() const { return num_parameters() * static_cast<std::int64_t>(embed_.element_size()); }

at::Tensor Backbone::rms_norm(const at::Tensor& x, const at::Tensor& weight) const {
  return ops::rms_norm(x, weight, config_.rms_norm_eps);
}

at::Tensor apply_activation(const std::string& act, const at::Tensor& x) {
  if (act == "silu") return at::silu(x);
  if (act == "gelu") return at::gelu(x);
  if (act == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  return at::relu(x);
}

namespace {

// The row logsumexp [B, Hq, T, 1] of q [B, Hq, T, D] over keys [B, Hkv, N, D], the chunk's T queries being the
// last T positions: query t sees keys 0 … N − T + t, which is the first chunk's causal mask (N = T), a later
// chunk's mask (everything cached + causal within the chunk) and a single token's (everything) alike. Formed
// explicitly: the path of devices whose attention kernel does not hand it out, and of inputs that carry a
// gradient (the latent memory trained end to end: a slot read's weight depends on it), which it passes on.
at::Tensor explicit_logsumexp(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& bias) {
  const std::int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const std::int64_t Hkv = keys.size(1), N = keys.size(2);
  const at::Tensor scores = at::matmul(q.to(at::kFloat).view({B, Hkv, Hq / Hkv, T, D}),
                                       keys.to(at::kFloat).transpose(-1, -2).unsqueeze(2)) /
                            std::sqrt(static_cast<double>(D));  // [B, Hkv, G, T, N]
  if (bias.defined()) return at::logsumexp(scores + bias.view({B, Hkv, Hq / Hkv, T, N}), -1, true).view({B, Hq, T, 1});
  const at::Tensor hidden = at::ones({T, N}, q.options().dtype(at::kBool)).tril(N - T).logical_not();
  return at::logsumexp(scores.masked_fill(hidden, -INFINITY), -1, true).view({B, Hq, T, 1});
}

// A gated read's additive logits [B, Hq, T, N] (float32): (pos_q − pos_i)·rate_i where entry i is visible to
// query q, −inf where it is not (AttentionCall::key_log_decay).
at::Tensor gated_read_bias(const AttentionCall& call, const KVCache& cache) {
  const at::Tensor& rate = call.key_log_decay;
  const at::Tensor kpos = cache.positions(call.layer);
  TORCH_CHECK(rate.sizes() == kpos.sizes(), "gated read: ", rate.sizes(), " decay rates for cache entries ", kpos.sizes());
  const at::Tensor age = (call.positions.view({1, 1, -1, 1}) - kpos.unsqueeze(2)).to(at::kFloat);  // [B, Hkv, T, N]
  const at::Tensor bias = (age * rate.to(at::kFloat).unsqueeze(2)).masked_fill(age < 0, -INFINITY);
  return bias.repeat_interleave(call.q.size(1) / kpos.size(1), 1);
}

// The additive mask [B, Hq, T, N] (float32) of a layer some of whose heads hold padding slots (KVCache::padded):
// 0 where entry i's position is at or before the query's, −inf elsewhere (a padding slot's position is never).
at::Tensor position_mask(const AttentionCall& call, const KVCache& cache) {
  const at::Tensor kpos = cache.positions(call.layer);
  const at::Tensor hidden = kpos.unsqueeze(2) > call.positions.view({1, 1, -1, 1});  // [B, Hkv, T, N]
  const at::Tensor bias = at::zeros(hidden.sizes(), call.q.options().dtype(at::kFloat)).masked_fill(hidden, -INFINITY);
  return bias.repeat_interleave(call.q.size(1) / kpos.size(1), 1);
}

}  // namespace

void attend_over_cache(AttentionCall& call, KVCache& cache, AttentionHook* hook) {
  if (hook) hook->before_attention(call, cache);
  const std::int64_t T = call.q.size(2), cached = cache.size(call.layer);
  cache.append(call.layer, call.k, call.v, call.positions);
  const at::Tensor& keys = cache.keys(call.layer);
  const at::Tensor& values = cache.values(call.layer);
  // A bfloat16 prefill chunk on an AMX CPU or one with AVX512-BF16, or a float32 one of a bf16x3 backbone
  // (ops/causal_attention_cpu.h); a float32 one of a float32 backbone, or a bfloat16 one on a CPU with neither,
  // whose SDPA kernel forms its bfloat16 products as float32 GEMMs through per-block conversions
  // (ops/causal_attention_float32.h): the logsumexp comes with either. Each kernel's `fits` says when it is the
  // faster one (a bfloat16 chunk too short for the tiles on AMX stays with SDPA).
  const bool bf16 = call.q.scalar_type() != at::kFloat;
  using Kernel = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor*);
  // A gated read adds a bias per (query, entry) that neither kernel takes, and a layer with padding slots needs its
  // mask by position: SDPA's with the bias as its mask.
  const bool gated = call.key_log_decay.defined() || cache.padded(call.layer);
  Kernel kernel = nullptr;
  if (!gated && (call.bf16x3 || bf16) && ops::causal_attention_cpu_fits(call.q, keys, values))
    kernel = &ops::causal_attention_cpu;
  else if (!gated && !call.bf16x3 && ops::causal_attention_float32_fits(call.q, keys, values))
    kernel = &ops::causal_attention_float32;
  if (kernel) {
    at::Tensor lse;
    call.output = kernel(call.q, keys, values, call.wants_logsumexp ? &lse : nullptr);
    if (call.wants_logsumexp) call.logsumexp = lse.unsqueeze(-1);
  } else {
    std::optional<at::Tensor> mask;  // none for a first chunk (plain causal) or a single token
    bool causal = false;
    at::Tensor bias;  // a gated read's, float32
    if (gated) {
      bias = call.key_log_decay.defined() ? gated_read_bias(call, cache) : position_mask(call, cache);
      mask = bias.to(call.q.scalar_type());
    } else if (T > 1 && cached == 0) {
      causal = true;
    } else if (T > 1) {
      const auto opts = at::TensorOptions().dtype(at::kBool).device(call.q.device());
      mask = at::cat({at::ones({T, cached}, opts), at::ones({T, T}, opts).tril()}, 1);
    }
    // The CPU flash kernel's logsumexp carries no gradient: inputs that need one take the explicit path.
    const bool differentiable = at::GradMode::is_enabled() && (call.q.requires_grad() || keys.requires_grad());
    if (call.wants_logsumexp && call.q.is_cpu() && !differentiable) {
      // The kernel SDPA itself runs on the CPU (GQA included), called directly for the logsumexp it computes anyway;
      // it takes the mask additive, in the query's dtype. A private ATen op whose signature follows the pinned
      // torch (2.11): the test AttendOverCache.HandsOutTheLogsumexpOfWhatEachQueryAttended checks it still
      // equals SDPA bit for bit.
      std::optional<at::Tensor> additive;
      if (gated)
        additive = mask;
      else if (mask)
        additive = at::zeros(mask->sizes(), call.q.options()).masked_fill(mask->logical_not(), -INFINITY);
      at::Tensor lse;
      std::tie(call.output, lse) = at::_scaled_dot_product_flash_attention_for_cpu(call.q, keys, values, 0.0, causal, additive);
      call.logsumexp = lse.to(at::kFloat).unsqueeze(-1);
    } else {
      call.output = at::scaled_dot_product_attention(call.q, keys, values, mask, 0.0, causal, std::nullopt,
                                                     /*enable_gqa=*/call.q.size(1) != call.k.size(1));
      if (call.wants_logsumexp) call.logsumexp = explicit_logsumexp(call.q, keys, bias);
    }
  }
  if (hook) hook->after_attention(call, cache);
}

AttentionCall Backbone::attention_inputs(const Layer& L, std::int64_t layer, const at::Tensor& x,
                                        const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                        const KVCache& cache) const {
  const auto& c = config_;
  const std::int64_t B = x.size(0), T = x.size(1);
  AttentionCall call;
  call.layer = layer;
  call.normed_input = rms_norm(x, L.input_norm);
  call.positions = positions;
  call.inv_freq = inv_freq_;
  call.start = cache.next_position();
  call.bf16x3 = bf16x3_on_;
  ProjectionInput input(call.normed_input, on_bf16x3(call.normed_input));
  auto project = [&](const at::Tensor& w, const ops::Bf16x3Weight& tiles, const at::Tensor& b, std::int64_t heads) {
    return input.apply(w, tiles, b).view({B, T, heads, c.head_dim}).transpose(1, 2);
  };
  at::Tensor q = project(L.q_proj, L.q_tiles, L.q_bias, c.num_heads);
  at::Tensor k = project(L.k_proj, L.k_tiles, L.k_bias, c.num_kv_heads);
  call.v = project(L.v_proj, L.v_tiles, L.v_bias, c.num_kv_heads);
  if (c.qk_norm) {
    q = rms_norm(q, L.q_norm);
    k = rms_norm(k, L.k_norm);
  }
  call.q_pre_rope = q;
  call.k_pre_rope = k;
  call.q = ops::rope_rotate(q, cos, sin);
  call.k = ops::rope_rotate(k, cos, sin);
  return call;
}

at::Tensor Backbone::attention(const Layer& L, std::int64_t layer, const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& cos, const at::Tensor& sin, KVCache& cache,
                               AttentionHook* hook) const {
  AttentionCall call = attention_inputs(L, layer, x, positions, cos, sin, cache);
  if (hook && hook->replaces_attention()) {
    hook->before_attention(call, cache);
    call.output = hook->attend(call);
  } else {
    attend_over_cache(call, cache, hook);
  }
  const std::int64_t B = x.size(0), T = x.size(1);
  const at::Tensor attended = call.output.transpose(1, 2).reshape({B, T, config_.num_heads * config_.head_dim});
  return ProjectionInput(attended, on_bf16x3(attended)).apply(L.o_proj, L.o_tiles);
}

at::Tensor Backbone::teacher_hidden(const at::Tensor& tokens, AttentionHook* hook) const {
  const at::NoGradGuard no_grad;
  KVCache cache = make_cache();
  return forward_hidden(tokens, cache, hook);
}

void Backbone::teacher_attention_inputs(const at::Tensor& tokens, AttentionHook& hook) const {
  const at::NoGradGuard no_grad;
  KVCache cache = make_cache();
  run_layers(tokens, cache, &hook, /*attention_inputs_only=*/true);
}

at::Tensor Backbone::forward_hidden(const at::Tensor& tokens, KVCache& cache, AttentionHook* hook) const {
  return run_layers(tokens, cache, hook, /*attention_inputs_only=*/false);
}

at::Tensor Backbone::run_layers(const at::Tensor& tokens, KVCache& cache, AttentionHook* hook,
                                bool attention_inputs_only) const {
  TORCH_CHECK(tokens.dim() == 2, "Backbone::forward: tokens must be [B, T]");
  TORCH_CHECK(cache.num_layers() == config_.num_layers, "Backbone::forward: cache has the wrong number of layers");
  const std::int64_t T = tokens.size(1);
  // Ids from the host (a tokenizer, a dataset, a sampler) are checked. Ids already on an accelerator are the
  // model's own argmax and in range by construction; checking them would cost a host sync per decoded token.
  if (tokens.is_cpu()) {
    const std::int64_t bad = ((tokens < 0) | (tokens >= config_.vocab_size)).sum().item<std::int64_t>();
    if (bad > 0) fail(source_, "tokens", std::to_string(bad) + " token ids outside [0, " + std::to_string(config_.vocab_size) + ")");
  }
  const at::Tensor ids = tokens.to(device_, at::kLong);
  const at::Tensor positions = at::arange(cache.next_position(), cache.next_position() + T, ids.options());
  const at::Tensor emb = rope_angles(positions, inv_freq_);  // [T, D]
  const at::Tensor cos = emb.cos().to(dtype_), sin = emb.sin().to(dtype_);
  at::Tensor h = at::embedding(embed_, ids);
  for (std::int64_t i = 0; i < config_.num_layers; ++i) {
    const Layer& L = layers_[static_cast<std::size_t>(i)];
    if (attention_inputs_only && i == config_.num_layers - 1) {
      TORCH_CHECK(hook != nullptr, "Backbone: a forward up to the attention inputs needs a hook to hand them to");
      AttentionCall call = attention_inputs(L, i, h, positions, cos, sin, cache);
      hook->before_attention(call, cache);
      return {};
    }
    h = h + attention(L, i, h, positions, cos, sin, cache, hook);
    const at::Tensor x = rms_norm(h, L.post_norm);
    ProjectionInput input(x, on_bf16x3(x));
    const at::Tensor gate = input.apply(L.gate_proj, L.gate_tiles), up = input.apply(L.up_proj, L.up_tiles);
    const bool silu = config_.hidden_act == "silu";
    at::Tensor mlp;
    if (silu && on_bf16x3(gate) && !(at::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad()))) {
      // Without a gradient the product goes straight into the down projection's tile rows.
      mlp = ops::bf16x3_linear(ops::silu_gate_rows(gate, up), L.down_tiles);
    } else {
      const at::Tensor gated = silu ? ops::silu_gate(gate, up) : apply_activation(config_.hidden_act, gate) * up;
      mlp = ProjectionInput(gated, on_bf16x3(gated)).apply(L.down_proj, L.down_tiles);
    }
    h = h + mlp;
  }
  cache.advance(T);
  return rms_norm(h, final_norm_);
}

at::Tensor Backbone::logits(const at::Tensor& hidden) const {
  return ProjectionInput(hidden, on_bf16x3(hidden)).apply(lm_head_, lm_head_tiles_);
}

}  // namespace kvbound
