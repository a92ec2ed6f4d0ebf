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
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

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

// x rounded to the nearest integer by the 1.5·2²³ shift, for |x| < 2²²: shifted = x + 1.5·2²³ lands in
// [2²³, 2²⁴), where floats are the integers, so its mantissa bits hold the integer; read from the bits, as a
// conversion of NaN to int would be undefined.
inline float shifted_by_round_constant(float x) { return x + 12582912.f; }
inline int32_t integer_of_shifted(float shifted) {
  uint32_t u;
  std::memcpy(&u, &shifted, sizeof u);
  return static_cast<int32_t>(u - 0x4B400000u);
}

// c[0]·x^(K−1) + c[1]·x^(K−2) + … + c[K−1] by Horner's rule, one multiply and one add per coefficient in this
// order (so every caller rounds alike).
template <int K>
inline float horner(float x, const float (&c)[K]) {
  float p = c[0];
  for (int i = 1; i < K; ++i) p = p * x + c[i];
  return p;
}

// 2^n for an integer n in [−127, 128): the exponent bits (n = −127 gives the bits of 0).
inline float power_of_two(int32_t n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x in float32 within ~2 ulp of the exact value for |x| ≤ 87 (Cephes' expf: x = n·ln 2 + r with |r| ≤ ln 2 / 2,
// e^r by a degree-6 polynomial, 2^n written into the exponent bits); x is clamped to [−87, 88], so the result
// stays a normal float (e^−87 ≈ 1.6e−38, e^88 ≈ 1.7e38). n is x·log₂e rounded to nearest by the shift above,
// which vectorizes without a compare per lane. NaN passes both clamps and makes r, hence the result, NaN.
// A loop that calls it should do nothing else with x: GCC may otherwise specialise the loop body for the two
// clamped constants and compute it three times per lane (measured: 4× slower in the SwiGLU gate).
inline float exp_float(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float shifted = shifted_by_round_constant(x * 1.44269504088896341f);
  const float nf = shifted - 12582912.f;
  const float r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  constexpr float kExpCoefficients[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                        4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
  const float e_r = horner(r, kExpCoefficients) * r * r + r + 1.f;
  return e_r * power_of_two(integer_of_shifted(shifted));
}

// 2^y for y ≤ 0 (softmax weights), in float32 within ~1.1 ulp of the exact value down to 2^−126 (Cephes' exp2f:
// y = n + f with |f| ≤ 1/2, 2^f by a degree-6 polynomial, 2^n into the exponent bits); n is floored at −127,
// whose exponent bits are those of 0, so the weight of y < −127 is 0 and y's only compare is its clamp at −150
// (which keeps the shift exact). Slightly positive y (a rounding above a row's max) is fine; NaN stays NaN.
inline float exp2_nonpositive(float y) {
  y = y < -150.f ? -150.f : y;
  const float shifted = shifted_by_round_constant(y);
  const float f = y - (shifted - 12582912.f);
  constexpr float kExp2Coefficients[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                         5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
  const float p = horner(f, kExp2Coefficients);
  int32_t n = integer_of_shifted(shifted);
  n = n < -127 ? -127 : n;
  return p * power_of_two(n);
}

// The largest of x[0, n), n ≥ 1, kept in 16 running maxima (lane j takes x[j], x[j + 16], …, the tail the first
// lanes), then one: a `reduction(max)` loop stays scalar here, one dependent max per element. A NaN is never
// taken (−∞ for a row of NaNs); callers' rows hold none.
inline float running_max(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  std::fill_n(lane, kLanes, -std::numeric_limits<float>::infinity());
  const int64_t full = n - n % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = lane[j] < x[i + j] ? x[i + j] : lane[j];
  for (int64_t i = full; i < n; ++i) lane[i - full] = lane[i - full] < x[i] ? x[i] : lane[i - full];
  return *std::max_element(lane, lane + kLanes);
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
