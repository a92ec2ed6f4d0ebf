#include "modules/indexer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/normal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>

#include <cmath>

#include "base/errors.h"
#include "modules/leaf_tensors.h"
#include "modules/backbone.h"
#include "ops/onednn_linear.h"
#include "ops/rms_norm.h"

namespace kvbound {
namespace {

// RMSNorm without a weight: the backbone's fused op (ops/rms_norm.h, its fused input gradient in training) with a
// weight of ones, which multiplies exactly.
at::Tensor rms_norm_unweighted(const at::Tensor& x) {
  return ops::rms_norm(x, at::ones({x.size(-1)}, x.options().requires_grad(false)), 1e-6);
}

bool parse_bool(const std::string& v, const std::string& source, const std::string& key) {
  if (v == "true" || v == "1") return true;
  if (v == "false" || v == "0") return false;
  fail(source, key, "'" + v + "' is not a boolean");
}

}  // namespace

IndexerSettings indexer_settings(const std::map<std::string, std::string>& m, const std::string& source) {
  IndexerSettings s;
  if (m.count("d_index")) {
    try {
      s.d_index = std::stoll(m.at("d_index"));
    } catch (const std::exception&) {
      fail(source, "d_index", "'" + m.at("d_index") + "' is not an integer");
    }
  }
  if (m.count("key_heads")) s.key_heads = m.at("key_heads");
  if (m.count("rope")) s.rope = parse_bool(m.at("rope"), source, "rope");
  if (m.count("relu")) s.relu = parse_bool(m.at("relu"), source, "relu");
  if (m.count("key_bias")) s.key_bias = parse_bool(m.at("key_bias"), source, "key_bias");
  return s;
}

std::map<std::string, std::string> indexer_metadata(const IndexerSettings& s) {
  return {{"d_index", std::to_string(s.d_index)},
          {"key_heads", s.key_heads},
          {"rope", s.rope ? "true" : "false"},
          {"relu", s.relu ? "true" : "false"},
          {"key_bias", s.key_bias ? "true" : "false"}};
}

std::string Indexer::tensor_prefix(std::int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".self_attn.indexer.";
}

Indexer::Indexer(const ModelConfig& c, const IndexerSettings& s) : settings_(s) {
  if (s.key_heads != "kv" && s.key_heads != "1") fail("config", "indexmem.key_heads", "'" + s.key_heads + "' (kv, 1)");
  if (s.d_index < 1 || (s.rope && s.d_index % 2 != 0))
    fail("config", "indexmem.d_index", "must be >= 1 (and even with rope), got " + std::to_string(s.d_index));
  key_heads_ = s.key_heads == "kv" ? c.num_kv_heads : 1;
  ModelConfig at_d = c;
  at_d.head_dim = s.d_index;
  inv_freq_ = rope_inverse_frequencies(at_d);
}

Indexer Indexer::init(const ModelConfig& c, const IndexerSettings& s, std::uint64_t seed) {
  Indexer ix(c, s);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    Layer L;
    L.wq = at::normal(0.0, s.init_std, {s.d_index, c.head_dim}, gen, f32);
    L.wk = at::normal(0.0, s.init_std, {ix.key_heads_ * s.d_index, c.hidden_size}, gen, f32);
    L.ww = at::normal(0.0, s.init_std, {c.num_heads, c.hidden_size}, gen, f32);
    L.bw = at::zeros({c.num_heads}, f32);
    for (at::Tensor* t : {&L.wq, &L.wk, &L.ww, &L.bw}) t->set_requires_grad(true);
    if (s.key_bias) L.wb = at::zeros({ix.key_heads_, c.hidden_size}, f32).set_requires_grad(true);
    ix.layers_.push_back(std::move(L));
  }
  return ix;
}

Indexer Indexer::from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& c,
                              const IndexerSettings& s, const std::string& source) {
  Indexer ix(c, s);
  auto take = [&](const std::string& name, std::vector<std::int64_t> shape) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) fail(source, name, "missing tensor (is this an IndexMem indexer file for this model?)");
    if (it->second.sizes() != at::IntArrayRef(shape)) {
      std::string want, got;
      for (auto v : shape) want += (want.empty() ? "" : ", ") + std::to_string(v);
      for (auto v : it->second.sizes()) got += (got.empty() ? "" : ", ") + std::to_string(v);
      fail(source, name, "shape [" + got + "] expected [" + want + "] for this model and indexer settings");
    }
    return it->second.to(at::kFloat).contiguous().clone();
  };
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = tensor_prefix(i);
    Layer L;
    L.wq = take(p + "wq", {s.d_index, c.head_dim});
    L.wk = take(p + "wk", {ix.key_heads_ * s.d_index, c.hidden_size});
    L.ww = take(p + "ww", {c.num_heads, c.hidden_size});
    L.bw = take(p + "bw", {c.num_heads});
    if (s.key_bias) {
      if (!tensors.count(p + "wb")) fail(source, p + "wb", "missing: the file's metadata says key_bias true");
      L.wb = take(p + "wb", {ix.key_heads_, c.hidden_size});
    } else if (tensors.count(p + "wb")) {
      fail(source, p + "wb", "key bias present but the file's metadata says key_bias false or does not name it");
    }
    ix.layers_.push_back(std::move(L));
  }
  const std::string extra = tensor_prefix(c.num_layers) + "wq";
  if (tensors.count(extra)) fail(source, extra, "indexer for more layers than the model has (" + std::to_string(c.num_layers) + ")");
  return ix;
}

at::Tensor Indexer::finish_queries(const at::Tensor& projected, const at::Tensor& positions) const {
  const at::Tensor q = rms_norm_unweighted(projected);
  return settings_.rope ? apply_rope(q, positions, inv_freq_) : q;
}

at::Tensor Indexer::finish_keys(const at::Tensor& projected_keys, const at::Tensor& positions) const {
  const std::int64_t B = projected_keys.size(0), T = projected_keys.size(1);
  // Normed as the projection lays them out ([B, T, heads, d_I] rows), then viewed head-major: the norm would copy
  // a transposed view to contiguous rows, forward and backward; RoPE takes the view as it is.
  const at::Tensor k = rms_norm_unweighted(projected_keys.view({B, T, key_heads_, settings_.d_index})).transpose(1, 2);
  return settings_.rope ? apply_rope(k, positions, inv_freq_) : k;
}

at::Tensor Indexer::query(std::int64_t layer, const at::Tensor& q_pre_rope, const at::Tensor& positions) const {
  return finish_queries(ops::onednn::preferred_linear(q_pre_rope.to(at::kFloat), layers_.at(static_cast<std::size_t>(layer)).wq), positions);
}

at::Tensor Indexer::key(std::int64_t layer, const at::Tensor& x, const at::Tensor& positions) const {
  return finish_keys(ops::onednn::preferred_linear(x.to(at::kFloat), layers_.at(static_cast<std::size_t>(layer)).wk), positions);
}

at::Tensor Indexer::head_weights(std::int64_t layer, const at::Tensor& x) const {
  const Layer& L = layers_.at(static_cast<std::size_t>(layer));
  return at::sigmoid(ops::onednn::preferred_linear(x.to(at::kFloat), L.ww, L.bw)).permute({0, 2, 1});
}

at::Tensor Indexer::key_bias(std::int64_t layer, const at::Tensor& x) const {
  TORCH_CHECK(settings_.key_bias, "Indexer::key_bias: this indexer has no key bias");
  return ops::onednn::preferred_linear(x.to(at::kFloat), layers_.at(static_cast<std::size_t>(layer)).wb).transpose(1, 2);
}

namespace {

// Each layer's input through that layer's projection, concatenated along the batch dim.
template <typename Project>
at::Tensor per_layer(const std::vector<at::Tensor>& inputs, std::size_t layers, Project&& project) {
  TORCH_CHECK(inputs.size() == layers, "Indexer: ", inputs.size(), " inputs for ", layers, " layers");
  std::vector<at::Tensor> out;
  out.reserve(layers);
  for (std::size_t l = 0; l < layers; ++l) out.push_back(project(l, inputs[l].to(at::kFloat)));
  return at::cat(out, 0);
}

}  // namespace

at::Tensor Indexer::queries(const std::vector<at::Tensor>& q_pre_rope, const at::Tensor& positions) const {
  return finish_queries(per_layer(q_pre_rope, layers_.size(),
                                  [&](std::size_t l, const at::Tensor& q) { return ops::onednn::preferred_linear(q, layers_[l].wq); }),
                        positions);
}

at::Tensor Indexer::keys(const std::vector<at::Tensor>& x, const at::Tensor& positions) const {
  return finish_keys(per_layer(x, layers_.size(), [&](std::size_t l, const at::Tensor& in) { return ops::onednn::preferred_linear(in, layers_[l].wk); }),
                     positions);
}

at::Tensor Indexer::head_weights(const std::vector<at::Tensor>& x) const {
  const at::Tensor logits = per_layer(x, layers_.size(), [&](std::size_t l, const at::Tensor& in) {
    return ops::onednn::preferred_linear(in, layers_[l].ww, layers_[l].bw);
  });
  return at::sigmoid(logits).permute({0, 2, 1});
}

at::Tensor Indexer::key_biases(const std::vector<at::Tensor>& x) const {
  TORCH_CHECK(settings_.key_bias, "Indexer::key_biases: this indexer has no key bias");
  return per_layer(x, layers_.size(), [&](std::size_t l, const at::Tensor& in) { return ops::onednn::preferred_linear(in, layers_[l].wb); })
      .transpose(1, 2);
}

at::Tensor Indexer::score(const at::Tensor& qI, const at::Tensor& w, const at::Tensor& kI) const {
  const std::int64_t B = qI.size(0), Hq = qI.size(1), S = qI.size(2), Hc = kI.size(1);
  // Each cache head's group of query heads: its own G = Hq/Hc heads ("kv"), or every head (one shared key).
  const bool per_kv_head = key_heads_ != 1 || Hc == 1;
  const std::int64_t G = per_kv_head ? Hq / Hc : Hq;
  const at::Tensor q = per_kv_head ? qI.reshape({B, Hc, G, S, settings_.d_index}) : qI.unsqueeze(1);
  const at::Tensor wg = per_kv_head ? w.reshape({B, Hc, G, S, 1}) : w.view({B, 1, Hq, S, 1});
  at::Tensor dots = at::matmul(q, kI.unsqueeze(2).transpose(-1, -2));  // [B, Hc, G, S, N]
  if (settings_.relu) dots = at::relu(dots);
  return (wg * dots).sum(2) / std::sqrt(static_cast<double>(settings_.d_index));
}

void Indexer::to(c10::Device device) {
  inv_freq_ = inv_freq_.to(device);
  for (Layer& L : layers_)
    for (at::Tensor* t : {&L.wq, &L.wk, &L.ww, &L.bw, &L.wb})
      if (t->defined()) *t = to_device_as_leaf(*t, device);
}

std::vector<at::Tensor> Indexer::parameters() const {
  std::vector<at::Tensor> out;
  for (const Layer& L : layers_) {
    out.insert(out.end(), {L.wq, L.wk, L.ww, L.bw});
    if (L.wb.defined()) out.push_back(L.wb);
  }
  return out;
}

std::map<std::string, at::Tensor> Indexer::named_tensors() const {
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = tensor_prefix(static_cast<std::int64_t>(i));
    out[p + "wq"] = layers_[i].wq;
    out[p + "wk"] = layers_[i].wk;
    out[p + "ww"] = layers_[i].ww;
    out[p + "bw"] = layers_[i].bw;
    if (layers_[i].wb.defined()) out[p + "wb"] = layers_[i].wb;
  }
  return out;
}

}  // namespace kvbound
