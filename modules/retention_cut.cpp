#include "modules/retention_cut.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <limits>

namespace kvbound {

at::Tensor retention_cut_visibility(const at::Tensor& log_beta, const RetentionCut& cut) {
  TORCH_CHECK(log_beta.dim() == 3, "retention_cut_visibility: log β must be [B, Hkv, T], got ", log_beta.sizes());
  TORCH_CHECK(cut.budget >= 1 && cut.chunk >= 1, "retention_cut_visibility: budget and chunk must be >= 1");
  const at::NoGradGuard no_grad;
  const std::int64_t B = log_beta.size(0), H = log_beta.size(1), T = log_beta.size(2);
  const at::Tensor lb = log_beta.to(at::kFloat);
  const auto index_options = lb.options().dtype(at::kLong);
  at::Tensor visible = at::ones({T, T}, lb.options().dtype(at::kBool)).tril();
  visible = visible.view({1, 1, T, T}).expand({B, H, T, T}).clone();
  at::Tensor kept = at::zeros({B, H, 0}, index_options);  // positions held, ascending
  for (std::int64_t start = 0; start < T; start += cut.chunk) {
    const std::int64_t end = std::min(T, start + cut.chunk);
    // The chunk's queries see the kept entries (the causal mask already shows them the chunk and everything
    // older: hide the older entries that were cut).
    if (start > 0) {
      at::Tensor older = at::zeros({B, H, start}, lb.options().dtype(at::kBool));
      older.scatter_(-1, kept, true);
      visible.narrow(2, start, end - start).narrow(3, 0, start).copy_(older.unsqueeze(2).expand({B, H, end - start, start}));
    }
    const at::Tensor chunk = at::arange(start, end, index_options).view({1, 1, -1}).expand({B, H, end - start});
    at::Tensor held = at::cat({kept, chunk}, -1);
    if (held.size(-1) <= cut.budget) {
      kept = held;
      continue;
    }
    const double now = static_cast<double>(end - 1);
    at::Tensor score = (now - held.to(at::kFloat)) * at::gather(lb, -1, held);
    if (cut.sinks > 0) score.masked_fill_(held < cut.sinks, std::numeric_limits<float>::infinity());
    // The budgeted cache's rule: a stable ascending sort's top M, back in position order.
    const at::Tensor order = std::get<1>(at::sort(score, /*stable=*/true, -1, /*descending=*/false));
    const at::Tensor top = order.narrow(-1, held.size(-1) - cut.budget, cut.budget);
    kept = std::get<0>(at::sort(at::gather(held, -1, top), -1));
  }
  return visible;
}

}  // namespace kvbound
