// kvbound::ops::pooled_attention_importance: IndexMem's teacher target (DESIGN.md, "IndexMem"),
//
//   A_h[s,t] = softmax over t ≤ s of q_s·k_t/√D            (causal attention probabilities of query head h),
//   a[b,g,t] = mean over the G = Hq/Hkv query heads h of KV head g of  pool_{s∈Ω(t)} A_h[s,t],
//
// with Ω(t) and pool (mean | max | logsumexp) as in ops/pooled_window.h; a = 0 for keys with empty Ω(t).
// q: [B, Hq, T, D], k: [B, Hkv, T, D] → [B, Hkv, T]: q's dtype for float32/float64; bf16/fp16 are computed
// in float32 and returned as float32 (the targets are normalised later; rounding them gains nothing).
// Note: logsumexp pools probabilities (in [0, 1]), so it is ≈ log|Ω(t)| plus a small attention term.
//
// No gradient: it is a constant target. The op runs under NoGradGuard, so the result never requires grad
// even if q or k do; there is no autograd Function.
//
// Memory-bounded, two passes: pass 1 keeps each query row's running max and sum over key blocks (its
// logsumexp, only for queries in some Ω); pass 2 walks key blocks × the query blocks that meet Ω and keeps
// a running sum, max (of logits, one exp at the end) or sum of exp(A) per key. O(B·Hq·T) memory plus one tile
// per thread, never T×T. When every query of any window fits one query block (window ≤ query_block, e.g.
// IndexMem's default 32 ≤ 64), the CPU kernel instead forms that block's logits against every key at once,
// [B, Hkv, G·W, T] — W·T per head, as many values as q when W ≤ D — in a dozen ATen ops (the tiled passes' many
// small products cost more in dispatch than in arithmetic there). Dispatcher op
// kvbound::pooled_attention_importance_fwd with a CPU kernel (parallel over batch × head × block); a CUDA kernel
// can register under the same schema.
#pragma once
#include <ATen/core/Tensor.h>

#include "ops/pooled_window.h"

namespace kvbound::ops {

// query_block × key_block: the CPU kernel's tile (any positive sizes; T need not be a multiple).
at::Tensor pooled_attention_importance(const at::Tensor& q, const at::Tensor& k, PoolMode pool, int64_t window,
                                       int64_t min_gap, int64_t query_block = 64, int64_t key_block = 64);

// The formula with plain ATen ops in q's dtype (materialises [B, Hq, T, T]; no gradient): what tests and
// benches compare with.
at::Tensor pooled_attention_importance_reference(const at::Tensor& q, const at::Tensor& k, PoolMode pool,
                                                 int64_t window, int64_t min_gap);

}  // namespace kvbound::ops
