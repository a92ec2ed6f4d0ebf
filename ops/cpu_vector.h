// Helpers of kvbound's fused CPU kernels (ops/rms_norm_cpu.cpp, ops/rope.cpp, ops/gated_activation.cpp):
// bfloat16 <-> float32 conversions and exp written as plain arithmetic, so the compiler vectorizes the loops that
// use them, and the attribute that builds a kernel for AVX-512, for AVX2 and for any x86-64, the best of which
// the loader picks on the machine at hand (GCC's target_clones; one plain build elsewhere; the build's baseline
// is x86-64's SSE2).
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
// stays a normal float (e^−87 ≈ 1.6e−38, e^88 ≈ 1.7e38). NaN passes both comparisons and makes r, hence the
// result, NaN (whatever 2^n its integer conversion gives).
inline float exp_float(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float scaled = x * 1.44269504088896341f;
  const int n = static_cast<int>(scaled + (scaled < 0.f ? -0.5f : 0.5f));  // round half away from zero
  const float nf = static_cast<float>(n);
  const float r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return e_r * two_n;
}

}  // namespace kvbound::ops::cpu
