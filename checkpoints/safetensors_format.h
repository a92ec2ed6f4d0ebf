// The safetensors container: 8-byte little-endian header length, a JSON header mapping tensor names to
// {dtype, shape, data_offsets}, then raw little-endian data. Parsing is torch-free (it is fuzzed on its
// own); every structural rule of the format is checked against the buffer before anything is viewed.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvbound {

enum class StDtype { F32, F16, BF16 };

struct StTensorInfo {
  StDtype dtype;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0;  // byte offset from the start of the buffer (header included)
  std::size_t nbytes = 0;
};

struct SafetensorsHeader {
  std::map<std::string, StTensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map
};

std::size_t st_dtype_size(StDtype dtype);
const char* st_dtype_name(StDtype dtype);

// Parses and validates the header of a safetensors file held in [data, data + size).
// Throws kvbound::Error "path: tensor: what" on any violation.
SafetensorsHeader parse_safetensors(const std::uint8_t* data, std::size_t size, const std::string& path);

}  // namespace kvbound
