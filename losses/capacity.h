// TRIM-KV's capacity loss (DESIGN.md, "TRIM-KV"): S_t = Σ_{i≤t} β_i^(t−i) is how many entries a cache that
// keeps token i with weight β_i^(t−i) holds at step t; the loss pushes it under the budget M.
//
//   per_head (default): mean over (b, l, g, t) of max(0, S_t − M) / max(t + 1 − M, 1)
//   global:             mean over (b, t) of max(0, Σ_{l,g} S_t − M·L·Hkv) / (L·Hkv·max(t + 1 − M, 1))
//
// The global variant lets some heads keep more than M as long as the whole cache fits (same normaliser,
// so both start on the same scale). Positions with weight 0 (padding) are left out of the mean.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvbound::losses {

enum class CapacityMode { PerHead, Global };

// "per_head" | "global"; anything else is kvbound::Error naming `field`.
CapacityMode parse_capacity_mode(const std::string& name, const std::string& field);

// log_betas: one [B, Hkv, T] tensor per layer; weights [B, T] (> 0: counted). Returns a float32 scalar.
at::Tensor capacity_loss(const std::vector<at::Tensor>& log_betas, std::int64_t budget, CapacityMode mode,
                         const at::Tensor& weights);

// Mean of S_t over (b, l, g) at the last weighted position of each row, averaged over rows: the
// expected cache size the gates imply at the end of a sequence (logged as "capacity").
double expected_cache_size(const std::vector<at::Tensor>& log_betas, const at::Tensor& weights);

}  // namespace kvbound::losses
