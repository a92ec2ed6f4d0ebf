// libFuzzer: GgufFile::parse on arbitrary bytes must either succeed with every tensor inside the
// buffer or throw kvbound::Error; never crash, never read out of bounds, never allocate from an
// unchecked count. Accepted files then go through every metadata getter and have the first rows
// of each dequantizable tensor decoded.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/errors.h"
#include "checkpoints/gguf.h"
#include "checkpoints/gguf_dequant.h"

namespace {

template <typename F>
void allow_error(F&& f) {
  try {
    f();
  } catch (const kvbound::Error&) {
  }
}

void read_metadata(const kvbound::GgufFile& file) {
  for (const auto& entry : file.metadata()) {
    const std::string& key = entry.first;
    allow_error([&] { file.get_u32(key); });
    allow_error([&] { file.get_u64(key); });
    allow_error([&] { file.get_i64(key); });
    allow_error([&] { file.get_f32(key); });
    allow_error([&] { file.get_bool(key); });
    allow_error([&] { file.get_string(key); });
    allow_error([&] { file.get_string_array(key); });
    allow_error([&] { file.get_f32_array(key); });
    allow_error([&] { file.get_i32_array(key); });
    allow_error([&] { file.array_size(key); });
  }
}

void decode_first_rows(const kvbound::GgufFile& file, const std::uint8_t* data, std::size_t size) {
  std::vector<float> row;
  for (const kvbound::GgufTensorInfo& t : file.tensors()) {
    const std::uint8_t* begin = file.tensor_data(t);
    if (begin < data || t.n_bytes > size || begin - data > static_cast<std::ptrdiff_t>(size - t.n_bytes))
      __builtin_trap();  // parse() let a tensor outside the buffer through
    if (!kvbound::find_ggml_type(static_cast<std::uint32_t>(t.type))->dequantizable) continue;
    const std::int64_t row_elements = t.dims[0];
    const std::int64_t row_bytes = kvbound::ggml_row_bytes(t.type, row_elements);
    row.resize(static_cast<std::size_t>(row_elements));
    const std::int64_t rows = std::min<std::int64_t>(t.n_elements / row_elements, 2);
    for (std::int64_t r = 0; r < rows; ++r)
      kvbound::dequantize_row(t.type, begin + r * row_bytes, row_elements, row.data());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const kvbound::GgufFile file = kvbound::GgufFile::parse(data, size, "fuzz.gguf");
    read_metadata(file);
    decode_first_rows(file, data, size);
  } catch (const kvbound::Error&) {
  }
  return 0;
}
