// The tensor-core building blocks of kvbound's mma.sync kernels (ops/retention_attention_mma.cu,
// ops/pooled_importance_mma.cu): bf16/fp16 operand conversion and mma m16n8k16 with fp32 accumulation, ldmatrix
// and cp.async, shared tiles of 64 rows with a bank-spreading pitch, register fragments of 16 rows per warp,
// and the host-side launch helpers. A block has 4 warps; a warp owns 16 rows and streams the other side in
// tiles of 64 rows.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16", g = lane/4, c = lane%4): A (16×16, row-major) a0 = A[g][2c..2c+1],
// a1 = A[g+8][2c..], a2 = A[g][2c+8..], a3 = A[g+8][2c+8..]; B (16×8) b0 = B[2c..2c+1][g], b1 = B[2c+8..][g];
// C (16×8) c0,c1 = C[g][2c..2c+1], c2,c3 = C[g+8][2c..2c+1]. A C fragment pair (columns 16k..16k+15) is
// therefore an A fragment of the next product without any data movement.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// An anonymous namespace: every kernel file gets its own copies (no relocatable device code to share them).
namespace kvbound::ops::mma {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockRows = 16 * kWarps;  // rows a block owns
constexpr int kTile = 64;                // rows of the streamed side per shared tile
constexpr int64_t kMaxRowBlocks = 65535;  // gridDim.y limit

// The two input dtypes: conversion to fp32, packing two fp32 into one operand register, and the mma.
template <typename scalar_t>
struct Dtype;

template <>
struct Dtype<c10::BFloat16> {
  __device__ static float to_float(uint16_t bits) { return __uint_as_float(static_cast<uint32_t>(bits) << 16); }
  __device__ static uint16_t from_float(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  __device__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Dtype<c10::Half> {
  __device__ static float to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  __device__ static uint16_t from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
  __device__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ unsigned shared_address(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Four 8×8 matrices; lane l gives the address of row l%8 of matrix l/8.
__device__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

__device__ void ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// 16 bytes global → shared; src_bytes = 0 writes zeros (rows past T).
__device__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes)
               : "memory");
}
__device__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Shared tiles hold rows of D elements with a pitch of D + 8: the 8 row addresses of an ldmatrix phase then
// fall on 8 distinct 16-byte bank groups (pitch 4 words mod 32 for D = 64 and 128).
template <int D>
constexpr int pitch() {
  return D + 8;
}

// Rows first .. first+kRowsIn−1 of a [T, D] matrix into a shared tile, asynchronously; rows past T read as 0.
template <int D, int kRowsIn>
__device__ void load_tile_async(uint16_t* dst, const uint16_t* src, int64_t first, int64_t T) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < kRowsIn * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int64_t t = first + r;
    const bool inside = t < T;
    cp_async_16(dst + r * pitch<D>() + c, src + (inside ? t * D + c : 0), inside ? 16 : 0);
  }
}

// One step of the double-buffered tile pipeline: issues tile n + 1 (if any) into the other stage, then waits for
// tile n's cp.async group (the caller's __syncthreads() then shows it to every warp).
template <typename Issue>
__device__ void issue_next_and_wait(int n, int tiles, Issue&& issue) {
  if (n + 1 < tiles) {
    issue(n + 1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
}

// Entry first + threadIdx.x of a length-T vector (of dtype scalar_t, or fp32) as fp32, 0 past T. The tile
// vectors (log β, lse, Δ) are read into a register when their tile is issued and written to shared memory
// after the current tile's products, so the load's latency hides behind the mma work.
template <typename scalar_t>
__device__ float vector_entry(const uint16_t* src, int64_t first, int64_t T) {
  const int64_t i = first + threadIdx.x % kTile;
  return i < T ? Dtype<scalar_t>::to_float(src[i]) : 0.f;
}
__device__ float vector_entry(const float* src, int64_t first, int64_t T) {
  const int64_t i = first + threadIdx.x % kTile;
  return i < T ? src[i] : 0.f;
}

// A fragments of 16 rows (row0 .. row0+15) of a [T, D] global matrix, straight into registers; rows past T
// are 0. Loaded once per warp, so no shared staging.
template <int D>
__device__ void load_row_fragments(uint32_t (&f)[D / 16][4], const uint16_t* src, int64_t row0, int64_t T) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t lo = row0 + g, hi = lo + 8;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    const int col = 16 * kc + 2 * c;
    f[kc][0] = lo < T ? *reinterpret_cast<const uint32_t*>(src + lo * D + col) : 0u;
    f[kc][1] = hi < T ? *reinterpret_cast<const uint32_t*>(src + hi * D + col) : 0u;
    f[kc][2] = lo < T ? *reinterpret_cast<const uint32_t*>(src + lo * D + col + 8) : 0u;
    f[kc][3] = hi < T ? *reinterpret_cast<const uint32_t*>(src + hi * D + col + 8) : 0u;
  }
}

// acc[j] += A · Bᵀ-tile j, for the 8 column blocks j of a [64, D] shared tile used as B = tileᵀ (the tile's rows
// are the product's columns: S = Q Kᵀ with the tile = K). A: D/16 register fragments.
template <typename scalar_t, int D>
__device__ void mma_rows_by_tile_rows(float (&acc)[kTile / 8][4], const uint32_t (&a)[D / 16][4], const uint16_t* tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kTile / 8; ++j) {
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2) {
      uint32_t b[4];  // b0, b1 of column chunk kc, then of kc + 1
      ldmatrix_x4(b, tile + (8 * j + (lane & 7)) * pitch<D>() + 16 * kc + 8 * (lane >> 3));
      Dtype<scalar_t>::mma(acc[j], a[kc], b[0], b[1]);
      Dtype<scalar_t>::mma(acc[j], a[kc + 1], b[2], b[3]);
    }
  }
}

// The same with A from shared memory too: 16 rows (row0 ..) of a [64, D] shared tile.
template <typename scalar_t, int D>
__device__ void mma_shared_rows_by_tile_rows(float (&acc)[kTile / 8][4], const uint16_t* rows, int row0,
                                             const uint16_t* tile) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < D / 16; kc += 2) {
    uint32_t a0[4], a1[4];  // column chunks kc, kc + 1; matrices: rows 0–7 / 8–15 × columns +0 / +8
    const uint16_t* a_row = rows + (row0 + 8 * ((lane >> 3) & 1) + (lane & 7)) * pitch<D>() + 8 * (lane >> 4);
    ldmatrix_x4(a0, a_row + 16 * kc);
    ldmatrix_x4(a1, a_row + 16 * (kc + 1));
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
      uint32_t b[4];  // b0, b1 of column chunk kc, then of kc + 1
      ldmatrix_x4(b, tile + (8 * j + (lane & 7)) * pitch<D>() + 16 * kc + 8 * (lane >> 3));
      Dtype<scalar_t>::mma(acc[j], a0, b[0], b[1]);
      Dtype<scalar_t>::mma(acc[j], a1, b[2], b[3]);
    }
  }
}

// acc[n] += P · tile for the D/8 column blocks n: P = 16 × 64 fp32 values in C-fragment layout (p[j] = its
// columns 8j..8j+7), rounded to the input dtype; tile = [64, D] shared (its rows are the product's k index).
template <typename scalar_t, int D>
__device__ void mma_fragments_by_tile(float (&acc)[D / 8][4], const float (&p)[kTile / 8][4], const uint16_t* tile) {
  using T = Dtype<scalar_t>;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kc = 0; kc < kTile / 16; ++kc) {
    const uint32_t a[4] = {T::pack(p[2 * kc][0], p[2 * kc][1]), T::pack(p[2 * kc][2], p[2 * kc][3]),
                           T::pack(p[2 * kc + 1][0], p[2 * kc + 1][1]), T::pack(p[2 * kc + 1][2], p[2 * kc + 1][3])};
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t b[4];  // b0, b1 of column block n, then of n + 1
      ldmatrix_x4_trans(b, tile + (16 * kc + 8 * ((lane >> 3) & 1) + (lane & 7)) * pitch<D>() + 8 * (n + (lane >> 4)));
      T::mma(acc[n], a, b[0], b[1]);
      T::mma(acc[n + 1], a, b[2], b[3]);
    }
  }
}

__device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax of a warp's 16 rows over streamed tiles of logits (lane (g, c): row g in the `lo` values, row
// g + 8 in the `hi` ones; l is this lane's share of the row sum until finish() adds up the quad).
struct OnlineSoftmaxRows {
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;

  // Folds in one tile of logits s (−inf where masked) whose lane-local row maxima the caller took while writing
  // them: s becomes exp(s − m) under the new row maxima m, and rescale_* are the factors by which whatever was
  // accumulated under the old maxima must be multiplied. A row with no visible key so far keeps m = −inf; its
  // rescale and probabilities are then 0.
  __device__ void absorb(float (&s)[kTile / 8][4], float tile_max_lo, float tile_max_hi, float& rescale_lo,
                         float& rescale_hi) {
    const float new_lo = fmaxf(m_lo, quad_max(tile_max_lo)), new_hi = fmaxf(m_hi, quad_max(tile_max_hi));
    const float base_lo = new_lo == -INFINITY ? 0.f : new_lo, base_hi = new_hi == -INFINITY ? 0.f : new_hi;
    rescale_lo = __expf(m_lo - base_lo);
    rescale_hi = __expf(m_hi - base_hi);
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int j = 0; j < kTile / 8; ++j) {
      s[j][0] = __expf(s[j][0] - base_lo);
      s[j][1] = __expf(s[j][1] - base_lo);
      s[j][2] = __expf(s[j][2] - base_hi);
      s[j][3] = __expf(s[j][3] - base_hi);
      sum_lo += s[j][0] + s[j][1];
      sum_hi += s[j][2] + s[j][3];
    }
    l_lo = l_lo * rescale_lo + sum_lo;
    l_hi = l_hi * rescale_hi + sum_hi;
    m_lo = new_lo;
    m_hi = new_hi;
  }
  // After the last tile: l becomes the whole row sum in every lane of the quad.
  __device__ void finish() {
    l_lo = quad_sum(l_lo);
    l_hi = quad_sum(l_hi);
  }
  __device__ float lse_lo() const { return m_lo + logf(l_lo); }
  __device__ float lse_hi() const { return m_hi + logf(l_hi); }
};

// Rows row0 + g and row0 + g + 8 of a [T, D] output from C fragments (scaled), skipping rows past T.
template <typename scalar_t, int D>
__device__ void store_rows(uint16_t* dst, const float (&acc)[D / 8][4], int64_t row0, int64_t T, float scale_lo,
                           float scale_hi) {
  const int lane = threadIdx.x % 32, g = lane >> 2, c = lane & 3;
  const int64_t lo = row0 + g, hi = lo + 8;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = 8 * n + 2 * c;
    if (lo < T)
      *reinterpret_cast<uint32_t*>(dst + lo * D + col) = Dtype<scalar_t>::pack(acc[n][0] * scale_lo, acc[n][1] * scale_lo);
    if (hi < T)
      *reinterpret_cast<uint32_t*>(dst + hi * D + col) = Dtype<scalar_t>::pack(acc[n][2] * scale_hi, acc[n][3] * scale_hi);
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

const uint16_t* bits(const at::Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); }
uint16_t* mutable_bits(at::Tensor& t) { return static_cast<uint16_t*>(t.mutable_data_ptr()); }

// Calls f(scalar_t{}, std::integral_constant<int, D>{}) for the input dtype and head dim.
template <typename F>
void dispatch(const at::Tensor& q, F&& f) {
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  if (q.size(3) == 64) {
    if (bf16) f(c10::BFloat16{}, std::integral_constant<int, 64>{});
    else f(c10::Half{}, std::integral_constant<int, 64>{});
  } else {
    if (bf16) f(c10::BFloat16{}, std::integral_constant<int, 128>{});
    else f(c10::Half{}, std::integral_constant<int, 128>{});
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0; }

}  // namespace
}  // namespace kvbound::ops::mma
