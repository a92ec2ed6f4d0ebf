// ggml tensor element types as GGUF files store them: their block layouts (so the parser can size
// any tensor) and dequantization to float32 for the types the loader supports.
// Torch-free: also compiled into the GGUF fuzz target.
#pragma once
#include <cstdint>
#include <string>

namespace kvbound {

// ggml's type ids (enum ggml_type in ggml.h). Ids 4, 5, 31-33 and 36-38 are retired in ggml.
enum class GgmlType : std::uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
};

struct GgmlTypeInfo {
  GgmlType type;
  const char* name;          // ggml's spelling: "Q4_K", "BF16"
  std::int64_t block_size;   // elements per block; a row holds a whole number of blocks
  std::int64_t block_bytes;  // bytes per block
  bool dequantizable;        // dequantize_row() handles it
};

// The layout of type id `id`, or nullptr when it is not a ggml type (unknown or retired id).
const GgmlTypeInfo* find_ggml_type(std::uint32_t id);

// ggml's name of `type`, or "type <id>" for an id find_ggml_type() does not know.
std::string ggml_type_name(GgmlType type);

// "F32, F16, BF16, Q4_0, ...": the types dequantize_row() supports, for error messages.
std::string dequantizable_ggml_types();

// Bytes of a row of `n_elements` elements of `type`. Throws kvbound::Error when the type is unknown
// or n_elements is negative or not a multiple of its block size.
std::int64_t ggml_row_bytes(GgmlType type, std::int64_t n_elements);

// Decodes `n_elements` consecutive elements (whole blocks) of `type` at `src` into `dst`, exactly as
// ggml's dequantize_row_* functions do. `src` needs no alignment. Throws kvbound::Error when the
// type is not dequantizable or n_elements is not a multiple of its block size.
void dequantize_row(GgmlType type, const std::uint8_t* src, std::int64_t n_elements, float* dst);

}  // namespace kvbound
