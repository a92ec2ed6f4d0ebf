#include "losses/streaming_kl.h"

#include <ATen/ops/log_softmax.h>
#include <ATen/ops/xlogy.h>

#include <limits>

namespace kvbound::losses {

at::Tensor listwise_kl_rows(const at::Tensor& teacher_a, const at::Tensor& student_z, const at::Tensor& invalid) {
  const at::Tensor a = teacher_a.to(at::kFloat).masked_fill(invalid, 0);
  const at::Tensor p_t = a / a.sum(-1, true).clamp_min(std::numeric_limits<float>::min());
  // log p_S is −inf at invalid keys: zero it there so 0 · (−inf) never makes a NaN (forward or backward).
  const at::Tensor z = student_z.to(at::kFloat).masked_fill(invalid, -std::numeric_limits<float>::infinity());
  const at::Tensor log_ps = at::log_softmax(z, -1).masked_fill(invalid, 0);
  return (at::xlogy(p_t, p_t) - p_t * log_ps).sum(-1);
}

at::Tensor streaming_kl(const at::Tensor& teacher_a, const at::Tensor& student_z, const at::Tensor& valid,
                        int64_t groups) {
  TORCH_CHECK(groups >= 1 && teacher_a.size(0) % groups == 0, "streaming_kl: ", teacher_a.size(0),
              " rows do not split into ", groups, " groups");
  return listwise_kl_rows(teacher_a, student_z, valid.logical_not()).view({groups, -1}).mean(1);
}

}  // namespace kvbound::losses
