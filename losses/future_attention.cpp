#include "losses/future_attention.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/flip.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include "losses/streaming_kl.h"

namespace kvbound::losses {
namespace {

at::Tensor cut_tensor(const std::vector<std::int64_t>& cuts, const at::Device& device) {
  return at::tensor(cuts, at::TensorOptions().dtype(at::kLong)).to(device);
}

// [C, T] bool: key i lies after cut c.
at::Tensor after_cut(const at::Tensor& cut_positions, std::int64_t T) {
  return at::arange(T, cut_positions.options()).view({1, T}) > cut_positions.view({-1, 1});
}

}  // namespace

std::vector<std::int64_t> future_cuts(std::int64_t T, std::int64_t stride) {
  std::vector<std::int64_t> cuts;
  for (std::int64_t t = stride - 1; stride >= 1 && t < T - 1; t += stride) cuts.push_back(t);
  return cuts;
}

at::Tensor future_attention_mass(const at::Tensor& attention, const std::vector<std::int64_t>& cuts,
                                 const at::Tensor& weights) {
  const std::int64_t B = attention.size(0), T = attention.size(2);
  const at::Tensor weighted = attention.to(at::kFloat) * weights.to(attention.device()).reshape({B, 1, T, 1});
  // later[q0] = Σ_{q ≥ q0} w_q · A[q]: the row after a cut is everything its later queries paid each key.
  const at::Tensor later = weighted.flip(2).cumsum(2).flip(2);
  const at::Tensor cut_positions = cut_tensor(cuts, attention.device());
  return later.index_select(2, cut_positions + 1).masked_fill(after_cut(cut_positions, T), 0);
}

at::Tensor future_attention_loss(const std::vector<at::Tensor>& log_betas, const std::vector<at::Tensor>& future_mass,
                                 const std::vector<std::int64_t>& cuts, const at::Tensor& weights) {
  const at::Tensor lb0 = log_betas.at(0);
  const std::int64_t B = lb0.size(0), Hkv = lb0.size(1), T = lb0.size(2);
  const at::Tensor cut_positions = cut_tensor(cuts, lb0.device());
  const at::Tensor invalid = after_cut(cut_positions, T);                            // [C, T]
  const at::Tensor age = (cut_positions.view({-1, 1}) - at::arange(T, cut_positions.options()).view({1, T}))
                             .clamp_min(0).to(at::kFloat);                          // [C, T]: t_c − i
  // A pair counts when its cut position is real and some later query carries weight: with none, F is all 0 and
  // the pair would only dilute the mean.
  const at::Tensor w = weights.to(lb0.device()).to(at::kFloat);
  const at::Tensor later_weight = w.flip(1).cumsum(1).flip(1);  // Σ_{q ≥ q0} w_q
  const at::Tensor counted = ((w.index_select(1, cut_positions) > 0) & (later_weight.index_select(1, cut_positions + 1) > 0))
                                 .to(at::kFloat)
                                 .view({B, 1, -1});
  at::Tensor total = at::zeros({}, lb0.options().dtype(at::kFloat));
  for (std::size_t l = 0; l < log_betas.size(); ++l) {
    const at::Tensor scores = log_betas[l].to(at::kFloat).unsqueeze(2) * age;      // [B, Hkv, C, T]
    total = total + (listwise_kl_rows(future_mass[l], scores, invalid) * counted).sum();
  }
  // A tensor divisor: no host sync; with no pair counted the sum is 0 and so is the loss.
  return total / (counted.sum() * static_cast<double>(Hkv * static_cast<std::int64_t>(log_betas.size()))).clamp_min(1);
}

}  // namespace kvbound::losses
