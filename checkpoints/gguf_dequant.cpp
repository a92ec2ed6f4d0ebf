#include "checkpoints/gguf_dequant.h"

#include <cstring>

#include "base/errors.h"

namespace kvbound {
namespace {

// Block sizes and byte counts from ggml (ggml.c type_traits); QK_K = 256 for the K-quants.
constexpr std::int64_t kQK = 32;
constexpr std::int64_t kQK_K = 256;

constexpr GgmlTypeInfo kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true},
    {GgmlType::F16, "F16", 1, 2, true},
    {GgmlType::Q4_0, "Q4_0", kQK, 18, true},
    {GgmlType::Q4_1, "Q4_1", kQK, 20, true},
    {GgmlType::Q5_0, "Q5_0", kQK, 22, true},
    {GgmlType::Q5_1, "Q5_1", kQK, 24, true},
    {GgmlType::Q8_0, "Q8_0", kQK, 34, true},
    {GgmlType::Q8_1, "Q8_1", kQK, 40, false},
    {GgmlType::Q2_K, "Q2_K", kQK_K, 84, false},
    {GgmlType::Q3_K, "Q3_K", kQK_K, 110, false},
    {GgmlType::Q4_K, "Q4_K", kQK_K, 144, true},
    {GgmlType::Q5_K, "Q5_K", kQK_K, 176, true},
    {GgmlType::Q6_K, "Q6_K", kQK_K, 210, true},
    {GgmlType::Q8_K, "Q8_K", kQK_K, 292, false},
    {GgmlType::IQ2_XXS, "IQ2_XXS", kQK_K, 66, false},
    {GgmlType::IQ2_XS, "IQ2_XS", kQK_K, 74, false},
    {GgmlType::IQ3_XXS, "IQ3_XXS", kQK_K, 98, false},
    {GgmlType::IQ1_S, "IQ1_S", kQK_K, 50, false},
    {GgmlType::IQ4_NL, "IQ4_NL", kQK, 18, false},
    {GgmlType::IQ3_S, "IQ3_S", kQK_K, 110, false},
    {GgmlType::IQ2_S, "IQ2_S", kQK_K, 82, false},
    {GgmlType::IQ4_XS, "IQ4_XS", kQK_K, 136, false},
    {GgmlType::I8, "I8", 1, 1, false},
    {GgmlType::I16, "I16", 1, 2, false},
    {GgmlType::I32, "I32", 1, 4, false},
    {GgmlType::I64, "I64", 1, 8, false},
    {GgmlType::F64, "F64", 1, 8, false},
    {GgmlType::IQ1_M, "IQ1_M", kQK_K, 56, false},
    {GgmlType::BF16, "BF16", 1, 2, true},
    {GgmlType::TQ1_0, "TQ1_0", kQK_K, 54, false},
    {GgmlType::TQ2_0, "TQ2_0", kQK_K, 66, false},
    {GgmlType::MXFP4, "MXFP4", 32, 17, false},
    {GgmlType::NVFP4, "NVFP4", 64, 36, false},
    {GgmlType::Q1_0, "Q1_0", 128, 18, false},
};

float float_from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

std::uint32_t bits_from_float(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

std::uint16_t load_u16(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }

std::uint32_t load_u32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}

// IEEE half -> float, exact for every input, without subnormal float intermediates (so it stays
// exact under flush-to-zero) and without a branch on the value class beyond one select.
float half_to_float(std::uint16_t h) {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;  // exponent and mantissa, sign shifted out
  // Normal, inf and NaN halves: move exponent+mantissa into float position with the exponent
  // raised by 224, then scale by 2^-112 to land on the float bias (127 = 15 + 224 - 112).
  const float normalized = float_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
  // Subnormal halves (m * 2^-24): write m into the low mantissa bits of 0.5f and subtract 0.5f.
  const float denormalized = float_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const bool is_subnormal = two_w < (1u << 27);
  return float_from_bits(sign | bits_from_float(is_subnormal ? denormalized : normalized));
}

float load_half(const std::uint8_t* p) { return half_to_float(load_u16(p)); }

void dequantize_f32(const std::uint8_t* x, std::int64_t n, float* y) {
  if (n > 0) std::memcpy(y, x, static_cast<std::size_t>(n) * sizeof(float));
}

void dequantize_f16(const std::uint8_t* x, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = load_half(x + 2 * i);
}

void dequantize_bf16(const std::uint8_t* x, std::int64_t n, float* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = float_from_bits(static_cast<std::uint32_t>(load_u16(x + 2 * i)) << 16);
}

// Q4_0: f16 d, 16 bytes of nibbles; element j is the low nibble of byte j, element j+16 the high
// nibble; value = (q - 8) * d.
void dequantize_q4_0(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 18, y += kQK) {
    const float d = load_half(x);
    const std::uint8_t* qs = x + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
      y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; value = q * d + m.
void dequantize_q4_1(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 20, y += kQK) {
    const float d = load_half(x);
    const float m = load_half(x + 2);
    const std::uint8_t* qs = x + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

// Q5_0: f16 d, u32 of fifth bits (bit i for element i), 16 bytes of nibbles; value = (q - 16) * d.
void dequantize_q5_0(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 22, y += kQK) {
    const float d = load_half(x);
    const std::uint32_t qh = load_u32(x + 2);
    const std::uint8_t* qs = x + 6;
    for (int j = 0; j < 16; ++j) {
      const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
      const int hi1 = static_cast<int>((qh >> (j + 16)) & 1u) << 4;
      y[j] = static_cast<float>(((qs[j] & 0x0F) | hi0) - 16) * d;
      y[j + 16] = static_cast<float>(((qs[j] >> 4) | hi1) - 16) * d;
    }
  }
}

// Q5_1: f16 d, f16 m, u32 of fifth bits, 16 bytes of nibbles; value = q * d + m.
void dequantize_q5_1(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 24, y += kQK) {
    const float d = load_half(x);
    const float m = load_half(x + 2);
    const std::uint32_t qh = load_u32(x + 4);
    const std::uint8_t* qs = x + 8;
    for (int j = 0; j < 16; ++j) {
      const int hi0 = static_cast<int>((qh >> j) & 1u) << 4;
      const int hi1 = static_cast<int>((qh >> (j + 16)) & 1u) << 4;
      y[j] = static_cast<float>((qs[j] & 0x0F) | hi0) * d + m;
      y[j + 16] = static_cast<float>((qs[j] >> 4) | hi1) * d + m;
    }
  }
}

// Q8_0: f16 d, 32 signed bytes; value = q * d.
void dequantize_q8_0(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 34, y += kQK) {
    const float d = load_half(x);
    for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(x[2 + j])) * d;
  }
}

// The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of a Q4_K/Q5_K block:
// bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
// the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
void k_scale_min(int j, const std::uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_K: f16 d, f16 dmin, 12 bytes of packed scales/mins, 128 bytes of nibbles. Each 64 elements
// share 32 bytes: low nibbles form sub-block 2i, high nibbles sub-block 2i+1.
void dequantize_q4_k(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 144) {
    const float d = load_half(x);
    const float dmin = load_half(x + 2);
    const std::uint8_t* scales = x + 4;
    const std::uint8_t* q = x + 16;
    for (int sub = 0; sub < 8; sub += 2, q += 32) {
      int sc, m;
      k_scale_min(sub, scales, &sc, &m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      k_scale_min(sub + 1, scales, &sc, &m);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

// Q5_K: Q4_K plus 32 bytes of fifth bits: bit s of byte l belongs to element l of sub-block s.
void dequantize_q5_k(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 176) {
    const float d = load_half(x);
    const float dmin = load_half(x + 2);
    const std::uint8_t* scales = x + 4;
    const std::uint8_t* qh = x + 16;
    const std::uint8_t* ql = x + 48;
    for (int sub = 0; sub < 8; sub += 2, ql += 32) {
      int sc, m;
      k_scale_min(sub, scales, &sc, &m);
      const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
      k_scale_min(sub + 1, scales, &sc, &m);
      const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
      for (int l = 0; l < 32; ++l)
        *y++ = d1 * static_cast<float>((ql[l] & 0x0F) | (((qh[l] >> sub) & 1) << 4)) - m1;
      for (int l = 0; l < 32; ++l)
        *y++ = d2 * static_cast<float>((ql[l] >> 4) | (((qh[l] >> (sub + 1)) & 1) << 4)) - m2;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed 8-bit scales (one per
// 16 elements), f16 d; value = d * scale * (q - 32). Each half-block of 128 elements uses 64 low
// bytes and 32 high bytes, in four 32-element runs.
void dequantize_q6_k(const std::uint8_t* x, std::int64_t n_blocks, float* y) {
  for (std::int64_t b = 0; b < n_blocks; ++b, x += 210) {
    const std::uint8_t* ql = x;
    const std::uint8_t* qh = x + 128;
    const std::uint8_t* sc = x + 192;
    const float d = load_half(x + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * static_cast<float>(static_cast<std::int8_t>(sc[is])) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(static_cast<std::int8_t>(sc[is + 2])) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(static_cast<std::int8_t>(sc[is + 4])) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(static_cast<std::int8_t>(sc[is + 6])) * static_cast<float>(q4);
      }
    }
  }
}

const GgmlTypeInfo& known_type(GgmlType type) {
  const GgmlTypeInfo* info = find_ggml_type(static_cast<std::uint32_t>(type));
  if (info == nullptr) throw Error("unknown ggml tensor " + ggml_type_name(type));
  return *info;
}

}  // namespace

const GgmlTypeInfo* find_ggml_type(std::uint32_t id) {
  for (const GgmlTypeInfo& info : kTypes)
    if (static_cast<std::uint32_t>(info.type) == id) return &info;
  return nullptr;
}

std::string ggml_type_name(GgmlType type) {
  const GgmlTypeInfo* info = find_ggml_type(static_cast<std::uint32_t>(type));
  return info != nullptr ? info->name : "type " + std::to_string(static_cast<std::uint32_t>(type));
}

std::string dequantizable_ggml_types() {
  std::string names;
  for (const GgmlTypeInfo& info : kTypes) {
    if (!info.dequantizable) continue;
    if (!names.empty()) names += ", ";
    names += info.name;
  }
  return names;
}

std::int64_t ggml_row_bytes(GgmlType type, std::int64_t n_elements) {
  const GgmlTypeInfo& info = known_type(type);
  if (n_elements < 0 || n_elements % info.block_size != 0)
    throw Error(std::string("a row of ") + info.name + " needs a multiple of " + std::to_string(info.block_size) +
                " elements, got " + std::to_string(n_elements));
  return n_elements / info.block_size * info.block_bytes;
}

void dequantize_row(GgmlType type, const std::uint8_t* src, std::int64_t n_elements, float* dst) {
  const GgmlTypeInfo& info = known_type(type);
  if (!info.dequantizable)
    throw Error(std::string("cannot dequantize ") + info.name + " (supported: " + dequantizable_ggml_types() + ")");
  ggml_row_bytes(type, n_elements);  // validates n_elements against the block size
  const std::int64_t n_blocks = n_elements / info.block_size;
  switch (type) {
    case GgmlType::F32: return dequantize_f32(src, n_elements, dst);
    case GgmlType::F16: return dequantize_f16(src, n_elements, dst);
    case GgmlType::BF16: return dequantize_bf16(src, n_elements, dst);
    case GgmlType::Q4_0: return dequantize_q4_0(src, n_blocks, dst);
    case GgmlType::Q4_1: return dequantize_q4_1(src, n_blocks, dst);
    case GgmlType::Q5_0: return dequantize_q5_0(src, n_blocks, dst);
    case GgmlType::Q5_1: return dequantize_q5_1(src, n_blocks, dst);
    case GgmlType::Q8_0: return dequantize_q8_0(src, n_blocks, dst);
    case GgmlType::Q4_K: return dequantize_q4_k(src, n_blocks, dst);
    case GgmlType::Q5_K: return dequantize_q5_k(src, n_blocks, dst);
    case GgmlType::Q6_K: return dequantize_q6_k(src, n_blocks, dst);
    default: break;
  }
  // kTypes marks a type dequantizable that the switch lacks: a bug here, not a bad file.
  throw Error(std::string("dequantize_row: no decoder for ") + info.name);
}

}  // namespace kvbound
