#include "modules/kv_cache.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/any.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/masked_fill.h>
#include <ATen/ops/sum.h>


namespace kvbound {

KVCache::KVCache(std::int64_t num_layers) : layers_(static_cast<std::size_t>(num_layers)) {}

namespace {

// Entries some autograd graph reaches (a forward trained end to end through the cache) are never written in
// place: attention saved them for its backward. Such a layer's cache is rebuilt by cat and gather instead.
bool tracked(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

}  // namespace

void KVCache::append(std::int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  Layer& L = layers_.at(layer);
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "KVCache::append: k and v must be [B, Hkv, T, D] alike");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == k.size(2), "KVCache::append: positions must be [T]");
  const std::int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3);
  const std::int64_t need = L.length + T;
  TORCH_CHECK(!L.k.defined() || (L.k.size(0) == B && L.k.size(1) == H && L.k.size(3) == D),
              "KVCache::append: shape changed between calls");
  if (tracked(L.k) || tracked(L.v) || (at::GradMode::is_enabled() && (tracked(k) || tracked(v)))) {
    const at::Tensor pos = positions.to(at::kLong).view({1, 1, T}).expand({B, H, T});
    L.k = L.length > 0 ? at::cat({keys(layer), k}, 2) : k;
    L.v = L.length > 0 ? at::cat({values(layer), v}, 2) : v;
    L.pos = L.length > 0 ? at::cat({this->positions(layer), pos}, 2) : pos.contiguous();
    L.length = need;
    return;
  }
  if (!L.k.defined() || need > L.k.size(2)) {
    const std::int64_t cap = std::max<std::int64_t>(need, L.k.defined() ? 2 * L.k.size(2) : std::max<std::int64_t>(need, 64));
    at::Tensor nk = at::empty({B, H, cap, D}, k.options());
    at::Tensor nv = at::empty({B, H, cap, D}, v.options());
    at::Tensor np = at::empty({B, H, cap}, positions.options().dtype(at::kLong));
    if (L.length > 0) {
      nk.narrow(2, 0, L.length).copy_(L.k.narrow(2, 0, L.length));
      nv.narrow(2, 0, L.length).copy_(L.v.narrow(2, 0, L.length));
      np.narrow(2, 0, L.length).copy_(L.pos.narrow(2, 0, L.length));
    }
    L.k = nk;
    L.v = nv;
    L.pos = np;
  }
  L.k.narrow(2, L.length, T).copy_(k);
  L.v.narrow(2, L.length, T).copy_(v);
  L.pos.narrow(2, L.length, T).copy_(positions.view({1, 1, T}).expand({B, H, T}));
  L.length = need;
}

void KVCache::retain(std::int64_t layer, const at::Tensor& index) {
  Layer& L = layers_.at(layer);
  TORCH_CHECK(index.dim() == 3 && index.size(0) == L.k.size(0) && index.size(1) == L.k.size(1),
              "KVCache::retain: index must be [B, Hkv, M]");
  const std::int64_t M = index.size(2);
  TORCH_CHECK(M <= L.length, "KVCache::retain: keeping more entries than the cache holds");
  const at::Tensor idx = index.to(at::kLong);
  const std::int64_t D = L.k.size(3);
  const at::Tensor idx4 = idx.unsqueeze(-1).expand({idx.size(0), idx.size(1), M, D});
  // Gather first, then write back: the kept rows may overlap the rows they overwrite.
  const at::Tensor k = at::gather(keys(layer), 2, idx4);
  const at::Tensor v = at::gather(values(layer), 2, idx4);
  const at::Tensor p = at::gather(positions(layer), 2, idx);
  if (tracked(L.k) || tracked(L.v)) {
    L.k = k;
    L.v = v;
    L.pos = p;
    L.length = M;
    return;
  }
  L.k.narrow(2, 0, M).copy_(k);
  L.v.narrow(2, 0, M).copy_(v);
  L.pos.narrow(2, 0, M).copy_(p);
  L.length = M;
}

void KVCache::retain(std::int64_t layer, const at::Tensor& index, const at::Tensor& live) {
  TORCH_CHECK(live.sizes() == index.sizes() && live.scalar_type() == at::kBool, "KVCache::retain: live must be bool like index");
  retain(layer, index);
  Layer& L = layers_.at(layer);
  const bool any_padding = live.logical_not().any().item<bool>();
  if (any_padding) {
    const at::Tensor pos = positions(layer).masked_fill(live.logical_not(), kPaddingPosition);
    if (tracked(L.k) || tracked(L.v)) L.pos = pos;
    else L.pos.narrow(2, 0, L.length).copy_(pos);
  }
  L.padded = any_padding;
}

at::Tensor KVCache::live_entries(std::int64_t layer) const {
  const at::Tensor pos = positions(layer);
  return (pos < kPaddingPosition).sum(-1);
}

at::Tensor KVCache::keys(std::int64_t layer) const {
  const Layer& L = layers_.at(layer);
  return L.k.defined() ? L.k.narrow(2, 0, L.length) : at::Tensor();
}
at::Tensor KVCache::values(std::int64_t layer) const {
  const Layer& L = layers_.at(layer);
  return L.v.defined() ? L.v.narrow(2, 0, L.length) : at::Tensor();
}
at::Tensor KVCache::positions(std::int64_t layer) const {
  const Layer& L = layers_.at(layer);
  return L.pos.defined() ? L.pos.narrow(2, 0, L.length) : at::Tensor();
}

std::int64_t KVCache::live_bytes() const {
  std::int64_t total = 0;
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    if (!L.k.defined()) continue;
    const std::int64_t entries = L.padded ? live_entries(static_cast<std::int64_t>(l)).sum().item<std::int64_t>()
                                          : L.length * L.k.size(0) * L.k.size(1);
    total += 2 * entries * L.k.size(3) * static_cast<std::int64_t>(L.k.element_size());
  }
  return total;
}

}  // namespace kvbound
