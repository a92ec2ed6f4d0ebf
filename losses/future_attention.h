// TRIM-KV's hindsight ranking loss (DESIGN.md, "TRIM-KV", trimkv.w_future). At a cut after position t the trimkv
// policy keeps the keys i ≤ t with the largest (t − i)·log β_i; the hindsight oracle (modules/policies/oracle.cpp,
// `later`) keeps those the full model's later queries attend to. This loss pulls the gates' ranking toward the
// oracle's at a few cut points of each training row: per cut,
//   F_t(i) = Σ_{q > t} w_q · A[q, i]   (A: the full model's attention, averaged over each KV group's heads)
//   L_t    = KL(F_t / Σ_{j ≤ t} F_t(j)  ‖  softmax_{i ≤ t}((t − i)·log β_i)),
// i.e. the retentions β_i^(t−i), normalised over the keys, in proportion to the attention still to come.
// The KL distillation loss never sees a hard cut; this one states what the cut needs to know.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvbound::losses {

// The cut points t = stride − 1, 2·stride − 1, … that have a later position (t < T − 1). stride >= 1.
std::vector<std::int64_t> future_cuts(std::int64_t T, std::int64_t stride);

// attention [B, Hkv, T, T] (row q: query q over the keys), weights [B, T] (the queries' weights) →
// F [B, Hkv, C, T] float32 with F[.., c, i] = Σ_{q > t_c} w_q · A[q, i] for i ≤ t_c and 0 for i > t_c.
at::Tensor future_attention_mass(const at::Tensor& attention, const std::vector<std::int64_t>& cuts,
                                 const at::Tensor& weights);

// log_betas: per layer [B, Hkv, T]; future_mass: per layer future_attention_mass at `cuts`; weights [B, T].
// The mean of L_t over layers, KV heads and the (row, cut) pairs whose cut position has weight > 0 and some
// later query weight > 0 (a float32 scalar, differentiable in the log-betas; 0 when no pair counts).
at::Tensor future_attention_loss(const std::vector<at::Tensor>& log_betas, const std::vector<at::Tensor>& future_mass,
                                 const std::vector<std::int64_t>& cuts, const at::Tensor& weights);

}  // namespace kvbound::losses
