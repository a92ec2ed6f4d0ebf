#include "modules/retention_gate.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/normal.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>

#include "base/errors.h"
#include "modules/leaf_tensors.h"
#include "modules/retention_cut.h"
#include "ops/onednn_linear.h"
#include "ops/retention_attention.h"

namespace kvbound {

std::string RetentionGates::tensor_prefix(std::int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".self_attn.retention_gate.";
}

RetentionGates RetentionGates::init(const ModelConfig& c, const RetentionGateSettings& s, std::uint64_t seed) {
  if (s.hidden < 1) fail("config", "retention gate hidden size", "must be >= 1");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  RetentionGates g;
  g.activation_ = c.hidden_act;
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    Layer L;
    L.w1 = at::normal(0.0, s.init_std, {s.hidden, c.hidden_size}, gen, f32);
    L.c1 = at::zeros({s.hidden}, f32);
    L.w2 = at::normal(0.0, s.init_std, {c.num_kv_heads, s.hidden}, gen, f32);
    L.b = at::full({c.num_kv_heads}, s.bias_init, f32);
    for (at::Tensor* t : {&L.w1, &L.c1, &L.w2, &L.b}) t->set_requires_grad(true);
    g.layers_.push_back(std::move(L));
  }
  return g;
}

RetentionGates RetentionGates::from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& c,
                                            const std::string& source) {
  RetentionGates g;
  g.activation_ = c.hidden_act;
  std::int64_t hidden = -1;
  auto take = [&](const std::string& name, std::vector<std::int64_t> shape) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) fail(source, name, "missing tensor (is this a TRIM-KV gates file for this model?)");
    at::Tensor t = it->second;
    if (t.sizes() != at::IntArrayRef(shape)) {
      std::string want, got;
      for (auto v : shape) want += (want.empty() ? "" : ", ") + std::to_string(v);
      for (auto v : t.sizes()) got += (got.empty() ? "" : ", ") + std::to_string(v);
      fail(source, name, "shape [" + got + "] expected [" + want + "] for this model");
    }
    return t.to(at::kFloat).contiguous().clone();
  };
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = tensor_prefix(i);
    const auto w1 = tensors.find(p + "linear1.weight");
    if (w1 == tensors.end()) fail(source, p + "linear1.weight", "missing tensor (is this a TRIM-KV gates file for this model?)");
    if (hidden < 0) hidden = w1->second.dim() == 2 ? w1->second.size(0) : -1;
    if (hidden < 1) fail(source, p + "linear1.weight", "must be a matrix [h, hidden_size]");
    Layer L;
    L.w1 = take(p + "linear1.weight", {hidden, c.hidden_size});
    L.c1 = take(p + "linear1.bias", {hidden});
    L.w2 = take(p + "linear2.weight", {c.num_kv_heads, hidden});
    L.b = take(p + "bias", {c.num_kv_heads});
    g.layers_.push_back(std::move(L));
  }
  const std::string extra = tensor_prefix(c.num_layers) + "linear1.weight";
  if (tensors.count(extra)) fail(source, extra, "gates for more layers than the model has (" + std::to_string(c.num_layers) + ")");
  return g;
}

at::Tensor RetentionGates::log_beta(std::int64_t layer, const at::Tensor& x) const {
  const Layer& L = layers_.at(static_cast<std::size_t>(layer));
  const at::Tensor h = apply_activation(activation_, ops::onednn::preferred_linear(x.to(at::kFloat), L.w1, L.c1));
  const at::Tensor z = ops::onednn::preferred_linear(h, L.w2) + L.b;  // [B, T, Hkv]
  // logsigmoid, not log(sigmoid): z starts near 8–18, where sigmoid rounds to 1 and log β to 0 exactly.
  return at::log_sigmoid(z).permute({0, 2, 1}).contiguous();
}

void RetentionGates::to(c10::Device device) {
  for (Layer& L : layers_)
    for (at::Tensor* t : {&L.w1, &L.c1, &L.w2, &L.b}) *t = to_device_as_leaf(*t, device);
}

std::vector<at::Tensor> RetentionGates::parameters() const {
  std::vector<at::Tensor> out;
  for (const Layer& L : layers_) out.insert(out.end(), {L.w1, L.c1, L.w2, L.b});
  return out;
}

std::map<std::string, at::Tensor> RetentionGates::named_tensors() const {
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = tensor_prefix(static_cast<std::int64_t>(i));
    out[p + "linear1.weight"] = layers_[i].w1;
    out[p + "linear1.bias"] = layers_[i].c1;
    out[p + "linear2.weight"] = layers_[i].w2;
    out[p + "bias"] = layers_[i].b;
  }
  return out;
}

std::int64_t RetentionGates::num_parameters() const {
  std::int64_t n = 0;
  for (const at::Tensor& t : parameters()) n += t.numel();
  return n;
}

at::Tensor GatedAttentionHook::attend(const AttentionCall& call) {
  at::Tensor log_beta = gates_.log_beta(call.layer, call.normed_input);  // [B, Hkv, T]
  if (sinks_ > 0) log_beta = log_beta.masked_fill(call.positions.lt(sinks_).view({1, 1, -1}), 0.0);
  if (static_cast<std::int64_t>(log_betas_.size()) <= call.layer) log_betas_.resize(static_cast<std::size_t>(call.layer) + 1);
  log_betas_[static_cast<std::size_t>(call.layer)] = log_beta;
  if (cut_budget_ == 0) return ops::retention_attention(call.q, call.k, call.v, log_beta.to(call.q.scalar_type()));
  TORCH_CHECK(call.start == 0, "GatedAttentionHook with a cut: the row must start at position 0");
  // The gated attention carries the gates' gradient only (q, k, v detached), the cut forward q, k and v's.
  const at::Tensor gated =
      ops::retention_attention(call.q.detach(), call.k.detach(), call.v.detach(), log_beta.to(call.q.scalar_type()));
  const std::int64_t group = call.q.size(1) / call.k.size(1);
  const at::Tensor visible =
      retention_cut_visibility(log_beta, RetentionCut{cut_budget_, cut_chunk_, sinks_}).repeat_interleave(group, 1);
  const at::Tensor cut = at::scaled_dot_product_attention(call.q, call.k, call.v, visible, 0.0, false, std::nullopt,
                                                          /*enable_gqa=*/group != 1);
  return cut + (gated - gated.detach());
}

}  // namespace kvbound
