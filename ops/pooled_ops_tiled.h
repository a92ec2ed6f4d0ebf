// IndexMem's two pooled ops (ops/pooled_attention_importance.h, ops/pooled_index_score.h) computed with ATen ops
// on query tiles: each tile is a few batched matrix products over every key (cuBLAS on a GPU, tensor cores in
// bf16/fp16) whose rows are folded into per-key running sums, maxima (+ argmax) or logsumexps, in place, so
// memory is about one [B, H, rows, T] tile (two in the relu backward), never [B, H, T, T]. They are the ops' CUDA kernels (registered for the CUDA dispatch
// key), and run on any device, so the CPU tests hold them to the same references as the CPU kernels.
// Arithmetic in float32 (float64 stays float64), like the CPU kernels. On CUDA, the importance of bf16/fp16
// inputs with head dim 64 or 128 goes to the CUDA module's tensor-core kernels instead
// (ops/pooled_importance_mma.cu): each tile here makes several fp32 passes over [B, Hq, rows, T] in memory.
// Max pooling's backward needs no tiles: each key's gradient reaches its argmax query alone (gathers and a
// deterministic accumulating scatter, O(B·Hq·T·dI)).
#pragma once
#include <ATen/core/Tensor.h>

#include <tuple>

namespace kvbound::ops {

// Query rows per tile at length T: at least `query_block`, and enough that T is covered in ≤ 256 tiles (a tile
// is then ≤ 1/256 of the naive T×T scores plus one row block).
int64_t pooled_tile_rows(int64_t T, int64_t query_block);

at::Tensor pooled_attention_importance_tiled(const at::Tensor& q, const at::Tensor& k, int64_t pool, int64_t window,
                                             int64_t min_gap, int64_t query_block, int64_t key_block);

// (z, argmax): argmax is int32 [B, Hk, T] for max pooling (the query each key's max came from, −1 for a key no
// query sees), else an empty
// [0, Hk, T] placeholder, as from the CPU kernel.
std::tuple<at::Tensor, at::Tensor> pooled_index_score_tiled_fwd(const at::Tensor& qI, const at::Tensor& kI,
                                                                const at::Tensor& w, int64_t pool, int64_t window,
                                                                int64_t min_gap, bool relu, int64_t query_block,
                                                                int64_t key_block);

std::tuple<at::Tensor, at::Tensor, at::Tensor> pooled_index_score_tiled_bwd(
    const at::Tensor& grad_z, const at::Tensor& qI, const at::Tensor& kI, const at::Tensor& w, const at::Tensor& z,
    const at::Tensor& argmax, int64_t pool, int64_t window, int64_t min_gap, bool relu, int64_t query_block,
    int64_t key_block);

}  // namespace kvbound::ops
