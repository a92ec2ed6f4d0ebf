// The keys a warp owns in the key-major pooled kernels (ops/pooled_importance_mma.cu, ops/pooled_index_score_mma.cu):
// block y holds keys 64y .., warp w the 16 from block_t0 + 16w, and lane (g, c) rows t_lo = t0 + g and t_hi = t_lo + 8
// of its C fragments. Ω(t) = [start(t), T) with start(t) = max(t + min_gap, window_first) (ops/pooled_window.h);
// start grows with t, so no query before first_query is in the window of any key of the block.
#pragma once
#include "ops/mma_tiles.cuh"

namespace kvbound::ops::mma {
namespace {

struct WarpKeys {
  int block_t0, t0, t_lo, t_hi;
  int start_lo, start_hi, size_lo, size_hi;  // |Ω| is 0 for keys past T
  int first_query;

  __device__ WarpKeys(int T, int window_first, int min_gap)
      : block_t0(static_cast<int>(blockIdx.y) * kBlockRows),
        t0(block_t0 + 16 * static_cast<int>(threadIdx.x / 32)),
        t_lo(t0 + static_cast<int>(threadIdx.x % 32) / 4),
        t_hi(t_lo + 8),
        start_lo(max(t_lo + min_gap, window_first)),
        start_hi(max(t_hi + min_gap, window_first)),
        size_lo(t_lo < T ? max(T - start_lo, 0) : 0),
        size_hi(t_hi < T ? max(T - start_hi, 0) : 0),
        first_query(max(block_t0 + min_gap, window_first)) {}

  // Calls pool(x, query, hi) for every entry of a warp's C fragments [16 keys × 64 queries u0 ..] whose query is
  // in its key's Ω (start ≤ query < T); hi: the entry belongs to key t_hi (else t_lo). Queries arrive in
  // increasing order per key and lane.
  template <typename Pool>
  __device__ void pool_window(const float (&frag)[kTile / 8][4], int u0, int T, Pool&& pool) const {
    const int c = static_cast<int>(threadIdx.x % 4), queries = min(kTile, T - u0);
    const int from_lo = start_lo - u0, from_hi = start_hi - u0;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * c + (e & 1);
        if (col < queries && col >= (e < 2 ? from_lo : from_hi)) pool(frag[j][e], col, e >= 2);
      }
    }
  }
};

// Their shared memory: the block's own key rows, and two stages of a query tile with one fp32 entry per query
// (the logsumexp, or the head's weight).
template <int D>
struct KeyMajorSmem {
  static constexpr size_t kBytes =
      kBlockRows * pitch<D>() * sizeof(uint16_t) + 2 * (kTile * pitch<D>() * sizeof(uint16_t) + kTile * sizeof(float));
  uint16_t* keys;     // [kBlockRows][pitch]
  uint16_t* queries;  // [stage][kTile][pitch]
  float* entries;     // [stage][kTile]

  __device__ explicit KeyMajorSmem(unsigned char* raw)
      : keys(reinterpret_cast<uint16_t*>(raw)),
        queries(keys + kBlockRows * pitch<D>()),
        entries(reinterpret_cast<float*>(queries + 2 * kTile * pitch<D>())) {}
  __device__ uint16_t* query_stage(int n) const { return queries + (n & 1) * kTile * pitch<D>(); }
  __device__ float* entry_stage(int n) const { return entries + (n & 1) * kTile; }
};

}  // namespace
}  // namespace kvbound::ops::mma
