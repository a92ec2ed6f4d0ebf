// kvbound::ops::pooled_index_score: IndexMem's student score (DESIGN.md, "IndexMem"),
//
//   I_g[s,t] = Σ_{h∈g} w[b,h,s] · act(qI[b,h,s]·kI[b,g,t]) / √dI,   act = identity or relu,
//   z[b,g,t] = pool_{s∈Ω(t)} I_g[s,t]                              (−inf for keys with empty Ω(t)),
//
// with Ω(t) and pool (mean | max | logsumexp) as in ops/pooled_window.h. qI: [B, Hq, T, dI], kI: [B, Hk, T, dI]
// with Hk dividing Hq (Hk = Hkv: one key per KV head; Hk = 1: one key shared by all heads), group g = the
// G = Hq/Hk query heads h with h / G = g; w: [B, Hq, T] → z: [B, Hk, T] in qI's dtype. Differentiable in
// qI, kI and w; relu'(0) = 0. Keys with empty Ω(t) get no gradient (z is constant there), whatever their
// incoming gradient.
//
// Memory-bounded: the forward walks key blocks × the query blocks that meet Ω, keeping a running sum, max
// (+ argmax query, int32, saved for the backward's scatter) or max-shifted logsumexp per key. The mean and
// logsumexp backward recompute I tile by tile (logsumexp from the saved z: dz/dI = exp(I − z)). O(B·Hq·T·dI)
// memory plus a few tiles per thread, never T×T. With act = identity, I_g = (Σ_h w_h qI_h)·kI/√dI: the
// kernels run on that one effective query per group (G× fewer products), and the chain rule back to qI and w
// is two ATen ops; with mean pooling too, it is linear in the queries, and pooled_index_score skips the kernels
// for a suffix sum over the queries (O(B·Hq·T·dI), no T² products; autograd through ATen) that reads only the
// queries some Ω holds (a window's last W: rows before them may be anything, e.g. zeros). Dispatcher ops
// kvbound::pooled_index_score_fwd / _bwd with CPU kernels (float32/float64; bf16/fp16 computed in float32);
// a CUDA kernel can register under the same schemas.
#pragma once
#include <ATen/core/Tensor.h>

#include "ops/pooled_window.h"

namespace kvbound::ops {

// query_block × key_block: the CPU kernel's tile (any positive sizes; T need not be a multiple). qI and w may hold
// only the last R of the T queries (qI [B, Hq, R, dI], w [B, Hq, R]) when no Ω holds an earlier one (an error
// otherwise): IndexMem's training forms the window's queries alone, and the linear mean reads nothing else (the
// kernels get the missing rows as zeros).
at::Tensor pooled_index_score(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, PoolMode pool,
                              int64_t window, int64_t min_gap, bool relu, int64_t query_block = 64,
                              int64_t key_block = 64);

// The formula with plain ATen ops (materialises [B, Hq, T, T]; autograd through ATen): what tests and
// benches compare with.
at::Tensor pooled_index_score_reference(const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, PoolMode pool,
                                        int64_t window, int64_t min_gap, bool relu);

}  // namespace kvbound::ops
