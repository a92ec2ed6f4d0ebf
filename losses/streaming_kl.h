// IndexMem's indexer loss (DESIGN.md, "IndexMem"): KL(p_T ‖ p_S) between the teacher's pooled attention
// importance and the student's pooled indexer score, over the keys whose window Ω(t) is not empty.
// Both scores come from the streaming (memory-bounded) ops in ops/, hence the name; this part is O(B·H·T).
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::losses {

// teacher_a [B, Hkv, T] ≥ 0 (0 at invalid keys), student_z [B, Hk, T] (−inf at invalid keys; Hk = Hkv or 1,
// broadcast over the KV heads), valid bool [T] with at least one true.
//   p_T = a / Σ_valid a,  log p_S = log_softmax over valid keys of z,  KL = Σ_t p_T (log p_T − log p_S)
// (terms with p_T = 0 contribute 0); the mean over batch and KV heads (a scalar, differentiable in z).
at::Tensor streaming_kl(const at::Tensor& teacher_a, const at::Tensor& student_z, const at::Tensor& valid);

}  // namespace kvbound::losses
