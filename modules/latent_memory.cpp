#include "modules/latent_memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/elu.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/normal.h>
#include <ATen/ops/sigmoid.h>

#include <cmath>

#include "base/errors.h"
#include "modules/leaf_tensors.h"

namespace kvbound {
namespace {

at::Tensor phi(const at::Tensor& x) { return at::elu(x) + 1; }

std::string shape_string(at::IntArrayRef shape) {
  std::string s;
  for (auto v : shape) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return "[" + s + "]";
}

}  // namespace

MemoryRead parse_memory_read(const std::string& name, const std::string& source, const std::string& field) {
  if (name == "add") return MemoryRead::Add;
  if (name == "slot") return MemoryRead::Slot;
  fail(source, field, "'" + name + "' is not a memory read (add | slot)");
}

std::string memory_read_name(MemoryRead read) { return read == MemoryRead::Slot ? "slot" : "add"; }

std::string LatentMemory::tensor_prefix(std::int64_t layer) {
  return "model.layers." + std::to_string(layer) + ".self_attn.latent_memory.";
}

LatentMemory LatentMemory::init(const ModelConfig& c, const LatentMemorySettings& s, std::uint64_t seed) {
  if (s.dim < 1) fail("config", "memory.dim", "must be >= 1");
  if (s.decay_init <= 0 || s.decay_init >= 1) fail("config", "memory decay", "must be in (0, 1)");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const std::int64_t Hkv = c.num_kv_heads, Hq = c.num_heads, D = c.head_dim;
  LatentMemory m;
  m.read_ = s.read;
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    Layer L;
    L.wk = at::normal(0.0, s.proj_std, {Hkv, s.dim, D}, gen, f32);
    L.wq = at::normal(0.0, s.proj_std, {Hkv, s.dim, D}, gen, f32);
    L.theta = at::full({Hkv}, std::log(s.decay_init / (1 - s.decay_init)), f32);
    L.wg = at::normal(0.0, s.gate_std, {Hq, D}, gen, f32);
    L.cg = at::full({Hq}, s.gate_bias_init, f32);
    for (at::Tensor* t : {&L.wk, &L.wq, &L.theta, &L.wg, &L.cg}) t->set_requires_grad(true);
    m.layers_.push_back(std::move(L));
  }
  return m;
}

LatentMemory LatentMemory::from_tensors(const std::map<std::string, at::Tensor>& tensors, const ModelConfig& c,
                                        MemoryRead read, const std::string& source) {
  const std::int64_t Hkv = c.num_kv_heads, Hq = c.num_heads, D = c.head_dim;
  auto find = [&](const std::string& name) {
    const auto it = tensors.find(name);
    if (it == tensors.end()) fail(source, name, "missing tensor (is this a latent memory file for this model?)");
    return it->second;
  };
  auto take = [&](const std::string& name, std::vector<std::int64_t> shape) {
    const at::Tensor t = find(name);
    if (t.sizes() != at::IntArrayRef(shape))
      fail(source, name, "shape " + shape_string(t.sizes()) + " expected " + shape_string(shape) + " for this model");
    return t.to(at::kFloat).contiguous().clone();
  };
  // d_m is whatever layer 0's key projection says; every other tensor must agree with it.
  const at::Tensor wk0 = find(tensor_prefix(0) + "wk");
  if (wk0.dim() != 3 || wk0.size(1) < 1) fail(source, tensor_prefix(0) + "wk", "must be [Hkv, d_m, head_dim]");
  const std::int64_t dm = wk0.size(1);
  LatentMemory m;
  m.read_ = read;
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = tensor_prefix(i);
    Layer L;
    L.wk = take(p + "wk", {Hkv, dm, D});
    L.wq = take(p + "wq", {Hkv, dm, D});
    L.theta = take(p + "theta", {Hkv});
    L.wg = take(p + "wg", {Hq, D});
    L.cg = take(p + "cg", {Hq});
    m.layers_.push_back(std::move(L));
  }
  const std::string extra = tensor_prefix(c.num_layers) + "wk";
  if (tensors.count(extra)) fail(source, extra, "memory for more layers than the model has (" + std::to_string(c.num_layers) + ")");
  return m;
}

void LatentMemory::write(std::int64_t layer, MemoryState& state, const at::Tensor& k_pre, const at::Tensor& v) const {
  const Layer& L = layers_.at(static_cast<std::size_t>(layer));
  const std::int64_t Hkv = L.wk.size(0), E = k_pre.size(2);
  if (E == 0) return;
  const at::Tensor khat = phi(at::matmul(k_pre.to(at::kFloat), L.wk.transpose(-1, -2)));  // [B, Hkv, E, d_m]
  const at::Tensor log_decay = at::log_sigmoid(L.theta);                                  // [Hkv]
  // Token i has E−1−i later writes after it, each multiplying it by λ.
  const at::Tensor age = at::arange(E - 1, -1, -1, L.theta.options());
  const at::Tensor weight = at::exp(log_decay.view({Hkv, 1}) * age).view({1, Hkv, E, 1});
  const at::Tensor weighted = khat * weight;
  const at::Tensor add_mem = at::matmul(weighted.transpose(-1, -2), v.to(at::kFloat));  // [B, Hkv, d_m, D]
  const at::Tensor add_z = weighted.sum(2);                                              // [B, Hkv, d_m]
  MemoryState::Layer& s = state.layer(layer);
  if (!s.mem.defined()) {
    s.mem = add_mem;
    s.z = add_z;
    return;
  }
  const at::Tensor decay = at::exp(log_decay * static_cast<double>(E));
  s.mem = decay.view({1, Hkv, 1, 1}) * s.mem + add_mem;
  s.z = decay.view({1, Hkv, 1}) * s.z + add_z;
}

at::Tensor LatentMemory::mix(std::int64_t layer, const MemoryState& state, const at::Tensor& q_pre,
                             const at::Tensor& attention, const at::Tensor& retained_lse) const {
  const Layer& L = layers_.at(static_cast<std::size_t>(layer));
  const MemoryState::Layer& s = state.layer(layer);
  const at::Tensor o = attention.to(at::kFloat);
  if (!s.mem.defined()) return o;
  const std::int64_t B = q_pre.size(0), Hq = q_pre.size(1), T = q_pre.size(2), D = q_pre.size(3);
  const std::int64_t Hkv = L.wk.size(0), G = Hq / Hkv, dm = L.wk.size(1);
  const at::Tensor q = q_pre.to(at::kFloat);
  // Query head h belongs to KV head h / G (the backbone's GQA grouping) and uses that head's W_mq.
  const at::Tensor qhat = phi(at::matmul(q.view({B, Hkv, G, T, D}), L.wq.transpose(-1, -2).unsqueeze(1)));  // [B, Hkv, G, T, d_m]
  const at::Tensor num = at::matmul(qhat, s.mem.unsqueeze(2));                        // [B, Hkv, G, T, D]
  const at::Tensor den = at::matmul(qhat, s.z.unsqueeze(2).unsqueeze(-1)) + kEpsilon;  // [B, Hkv, G, T, 1]
  const at::Tensor m = (num / den).view({B, Hq, T, D});
  const at::Tensor logit = at::matmul(q, L.wg.unsqueeze(-1)) + L.cg.view({1, Hq, 1, 1});  // [B, Hq, T, 1]
  if (read_ == MemoryRead::Add) return o + at::sigmoid(logit) * m;
  TORCH_CHECK(retained_lse.defined(), "LatentMemory::mix: a slot read needs the retained keys' logsumexp");
  const at::Tensor slot_logit = at::log(den / static_cast<double>(dm)).view({B, Hq, T, 1}) + logit;
  const at::Tensor alpha = at::sigmoid(slot_logit - retained_lse.to(at::kFloat));
  return o + alpha * (m - o);
}

void LatentMemory::to(c10::Device device) {
  for (Layer& L : layers_)
    for (at::Tensor* t : {&L.wk, &L.wq, &L.theta, &L.wg, &L.cg}) *t = to_device_as_leaf(*t, device);
}

std::vector<at::Tensor> LatentMemory::parameters() const {
  std::vector<at::Tensor> out;
  for (const Layer& L : layers_) out.insert(out.end(), {L.wk, L.wq, L.theta, L.wg, L.cg});
  return out;
}

std::map<std::string, at::Tensor> LatentMemory::named_tensors() const {
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const std::string p = tensor_prefix(static_cast<std::int64_t>(i));
    const Layer& L = layers_[i];
    out[p + "wk"] = L.wk;
    out[p + "wq"] = L.wq;
    out[p + "theta"] = L.theta;
    out[p + "wg"] = L.wg;
    out[p + "cg"] = L.cg;
  }
  return out;
}

std::int64_t LatentMemory::num_parameters() const {
  std::int64_t n = 0;
  for (const at::Tensor& t : parameters()) n += t.numel();
  return n;
}

}  // namespace kvbound
