// Which keys each query of a whole row sees when the trimkv policy holds the cache to M entries: the row read in
// chunks of C, as the budgeted engine prefills it (modules/budgeted_cache.h), each chunk attending the kept entries
// plus itself (causal), then the cache cut back to the M entries of highest (t − pos)·log β at the chunk's last
// position t (the policy's `exceeds` rule, buffer 0; positions below `sinks` always kept; ties to the later entry).
// The TRIM-KV trainer's cut student (trimkv.cut_budget > 0) attends under this mask, so its forward is the deployment's.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvbound {

struct RetentionCut {
  std::int64_t budget = 0;  // M; 0: no cut (the soft student)
  std::int64_t chunk = 64;  // C
  std::int64_t sinks = 0;
};

// visible [B, Hkv, T, T] (bool): visible[b, h, q, k] when query q reads key k, from log β [B, Hkv, T] of a row
// whose positions are 0 … T − 1.
at::Tensor retention_cut_visibility(const at::Tensor& log_beta, const RetentionCut& cut);

}  // namespace kvbound
