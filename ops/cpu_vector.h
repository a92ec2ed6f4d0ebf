// Helpers of kvbound's fused CPU kernels (ops/rms_norm_cpu.cpp, ops/rope.cpp, ops/gated_activation.cpp,
// ops/causal_attention_cpu.cpp): bfloat16 <-> float32 conversions, exp and a fixed-order sum written as plain
// arithmetic, so the compiler vectorizes the loops that use them, and the attribute that builds a kernel for
// AVX-512, for AVX2 and for any x86-64, the best of which the loader picks on the machine at hand (GCC's
// target_clones; one plain build elsewhere; the build's baseline is x86-64's SSE2).
//
// Every value must come out the same whichever lane, loop tail or clone computes it (a row's result may not
// depend on where it sits in memory or in a batch): so no library calls whose vector and scalar versions differ,
// no reductions whose order the vectorizer picks, and the kernels' files are built with -ffp-contract=off (an FMA
// in one clone and a multiply-add in another round differently).
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVBOUND_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVBOUND_VECTOR_CLONES
#endif

namespace kvbound::ops::cpu {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN to the quiet NaN: c10::BFloat16's rounding, bit for bit.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7FC0) : rounded;
}

// e^x in float32 within ~2 ulp of the exact value for |x| ≤ 87 (Cephes' expf: x = n·ln 2 + r with |r| ≤ ln 2 / 2,
// e^r by a degree-6 polynomial, 2^n written into the exponent bits); x is clamped to [−87, 88], so the result
// stays a normal float (e^−87 ≈ 1.6e−38, e^88 ≈ 1.7e38). n is x·log₂e rounded to nearest even by adding and
// subtracting 1.5·2²³ (exact for |x·log₂e| < 2²²), which vectorizes without a compare per lane. NaN passes both
// clamps and makes r, hence the result, NaN.
// A loop that calls it should do nothing else with x: GCC may otherwise specialise the loop body for the two
// clamped constants and compute it three times per lane (measured: 4× slower in the SwiGLU gate).
inline float exp_float(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float nf = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int>(nf) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e_r * two_n;
}

// Σ term(i) for i < n in float32 in a fixed order, whatever the ISA or the row's address: lane j of 16 sums the
// terms j, j + 16, …, then the lanes are added pairwise (a reduction left to the vectorizer would change order
// with alignment).
template <typename Term>
inline float fixed_order_sum(int64_t n, Term&& term) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  const int64_t full = n - n % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] += term(i + j);
  for (int64_t i = full; i < n; ++i) lane[i - full] += term(i);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

}  // namespace kvbound::ops::cpu
