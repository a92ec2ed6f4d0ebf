// IndexMem's indexer loss (DESIGN.md, "IndexMem"): KL(p_T ‖ p_S) between the teacher's pooled attention
// importance and the student's pooled indexer score, over the keys whose window Ω(t) is not empty.
// Both scores come from the streaming (memory-bounded) ops in ops/, hence the name; this part is O(B·H·T).
#pragma once
#include <ATen/core/Tensor.h>

namespace kvbound::losses {

// The listwise KL both ranking losses share (this one and losses/future_attention.h): over the last dim,
//   p_T = a / Σ_valid a,  log p_S = log_softmax over valid entries of z,  KL = Σ p_T (log p_T − log p_S),
// one value per row (terms with p_T = 0 contribute 0; a row with no mass gives 0). teacher_a ≥ 0 and
// student_z broadcast against `invalid` (bool, true: left out); every counted row needs one valid entry.
at::Tensor listwise_kl_rows(const at::Tensor& teacher_a, const at::Tensor& student_z, const at::Tensor& invalid);

// teacher_a [G·B, Hkv, T] ≥ 0 (0 at invalid keys), student_z [G·B, Hk, T] (−inf at invalid keys; Hk = Hkv or
// 1, broadcast over the KV heads), valid bool [T] with at least one true: listwise_kl_rows' mean over the B rows
// and KV heads of each of the G groups of rows (the layers of one batched step, group g rows g·B … g·B + B − 1):
// [G], differentiable in z.
at::Tensor streaming_kl(const at::Tensor& teacher_a, const at::Tensor& student_z, const at::Tensor& valid,
                        int64_t groups = 1);

}  // namespace kvbound::losses
