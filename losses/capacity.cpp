#include "losses/capacity.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/stack.h>

#include "base/errors.h"
#include "ops/retention_sum.h"

namespace kvbound::losses {

CapacityMode parse_capacity_mode(const std::string& name, const std::string& field) {
  if (name == "per_head") return CapacityMode::PerHead;
  if (name == "global") return CapacityMode::Global;
  fail("config", field, "'" + name + "' (per_head, global)");
}

at::Tensor capacity_loss(const std::vector<at::Tensor>& log_betas, std::int64_t budget, CapacityMode mode,
                         const at::Tensor& weights) {
  TORCH_CHECK(!log_betas.empty(), "capacity_loss: no layers");
  TORCH_CHECK(budget >= 1, "capacity_loss: budget must be >= 1, got ", budget);
  const at::Tensor S = at::stack(log_betas, 1).to(at::kFloat);  // [B, L, Hkv, T] of log β
  const std::int64_t T = S.size(-1), layers = S.size(1), heads = S.size(2);
  const at::Tensor occupancy = ops::retention_sum(S);            // [B, L, Hkv, T]
  const at::Tensor t = at::arange(T, S.options());
  const at::Tensor norm = at::clamp_min(t + 1 - static_cast<double>(budget), 1.0);  // [T]
  const at::Tensor w = weights.to(at::kFloat);                   // [B, T]
  const at::Tensor total_w = w.sum();
  TORCH_CHECK(total_w.item<double>() > 0, "capacity_loss: every position has weight 0");
  if (mode == CapacityMode::PerHead) {
    const at::Tensor excess = at::relu(occupancy - static_cast<double>(budget)) / norm;  // [B, L, Hkv, T]
    return (excess.sum({1, 2}) * w).sum() / (total_w * static_cast<double>(layers * heads));
  }
  const double cache = static_cast<double>(budget * layers * heads);
  const at::Tensor excess = at::relu(occupancy.sum({1, 2}) - cache) / (norm * static_cast<double>(layers * heads));
  return (excess * w).sum() / total_w;
}

double expected_cache_size(const std::vector<at::Tensor>& log_betas, const at::Tensor& weights) {
  const at::Tensor occupancy = ops::retention_sum(at::stack(log_betas, 1).to(at::kFloat).detach());  // [B, L, Hkv, T]
  // The last weighted position of each row: (number of weighted positions − 1), weights being a prefix mask.
  const at::Tensor last = ((weights > 0).sum(1) - 1).clamp_min(0);  // [B]
  const at::Tensor idx = last.view({-1, 1, 1, 1}).expand({occupancy.size(0), occupancy.size(1), occupancy.size(2), 1});
  return at::gather(occupancy, 3, idx).mean().item<double>();
}

}  // namespace kvbound::losses
