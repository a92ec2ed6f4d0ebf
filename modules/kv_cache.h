// Per-layer key/value cache. Keys are stored after RoPE, with the original position of every entry,
// per (batch, KV head), so an eviction policy may keep a different set of tokens in each KV head.
// Storage grows geometrically (amortised O(1) appends); keys()/values() are views of the live prefix.
// Entries that require grad (a budgeted forward trained end to end) are never written in place: that layer
// is rebuilt by cat/gather, so what attention saved for its backward stays intact.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace kvbound {

// The position of a padding slot. A pooled budget (BudgetedCache's layer and model scopes) lets the heads of a
// layer hold different numbers of entries; the layer's tensors are as wide as its fullest head, and a head's
// slots past its own entries carry this position, which no query reaches, so attention never sees them.
inline constexpr std::int64_t kPaddingPosition = std::numeric_limits<std::int64_t>::max() / 4;

class KVCache {
 public:
  explicit KVCache(std::int64_t num_layers);

  // Appends a chunk: k, v [B, Hkv, T, D]; positions [T] (int64, the same for every batch row and head).
  void append(std::int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);
  // Keeps, per (batch, KV head), the entries at `index` [B, Hkv, M] (int64, in increasing order): in place, or
  // by gather when the entries require grad.
  void retain(std::int64_t layer, const at::Tensor& index);
  // As retain, but only where `live` [B, Hkv, M] (bool) is true: the other slots become padding.
  void retain(std::int64_t layer, const at::Tensor& index, const at::Tensor& live);
  // Whether some head of `layer` holds padding slots (its queries must then be masked by position).
  bool padded(std::int64_t layer) const { return layers_.at(layer).padded; }
  // Entries per (batch, KV head) of `layer` that are not padding, [B, Hkv] int64.
  at::Tensor live_entries(std::int64_t layer) const;

  at::Tensor keys(std::int64_t layer) const;       // [B, Hkv, N, D]
  at::Tensor values(std::int64_t layer) const;     // [B, Hkv, N, D]
  at::Tensor positions(std::int64_t layer) const;  // [B, Hkv, N] int64
  std::int64_t size(std::int64_t layer) const { return layers_.at(layer).length; }
  std::int64_t num_layers() const { return static_cast<std::int64_t>(layers_.size()); }
  // Position the next token will take (tokens seen so far, evicted or not).
  std::int64_t next_position() const { return next_position_; }
  void advance(std::int64_t tokens) { next_position_ += tokens; }
  // Bytes held by live entries (keys + values, padding slots left out), summed over layers.
  std::int64_t live_bytes() const;

 private:
  struct Layer {
    at::Tensor k, v, pos;  // capacity-sized buffers; the first `length` entries along dim 2 are live
    std::int64_t length = 0;
    bool padded = false;
  };
  std::vector<Layer> layers_;
  std::int64_t next_position_ = 0;
};

}  // namespace kvbound
