// GGUF (v2/v3, little-endian) container parser: metadata key/values and tensor infos, every count,
// length and offset checked against the buffer before it is used. Torch-free: the fuzz target
// compiles parse() alone. Layout: magic "GGUF", u32 version, u64 tensor count, u64 key/value
// count, the key/values, the tensor infos, padding to general.alignment, then the tensor data.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoints/gguf_dequant.h"
#include "base/mapped_file.h"

namespace kvbound {

enum class GgufValueType : std::uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};

// "uint32", "string", ...
const char* gguf_value_type_name(GgufValueType type);

// One metadata value. A scalar is held like a one-element array of its own type, so the getters
// share one path. Arrays of arrays are rejected at parse time (llama.cpp rejects them too).
struct GgufValue {
  GgufValueType type = GgufValueType::U8;          // Array for arrays
  GgufValueType element_type = GgufValueType::U8;  // the scalar's type, or the array's element type
  std::uint64_t count = 1;                         // number of elements (1 for a scalar)
  std::vector<std::uint8_t> numbers;               // numeric and bool elements, little-endian as in the file
  std::vector<std::string> strings;                // string elements

  bool is_array() const { return type == GgufValueType::Array; }
};

struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> dims;  // ggml order: dims[0] (ne0) is the contiguous one; torch shape is reversed
  GgmlType type = GgmlType::F32;
  std::uint64_t offset = 0;        // from the start of the data section, a multiple of the alignment
  std::uint64_t n_bytes = 0;
  std::int64_t n_elements = 0;
};

class GgufFile {
 public:
  // Parses `size` bytes at `data`; `path` only names the file in errors. The result points into
  // `data` (tensor_data()), which must outlive it. Throws kvbound::Error("path: key or tensor: ...")
  // on any malformed or out-of-bounds content.
  static GgufFile parse(const std::uint8_t* data, std::size_t size, const std::string& path);
  // Memory-maps `path` and parses it; the GgufFile (and whoever copies mapping()) keeps the map alive.
  // Defined inline below so that code using only parse() (the fuzz target) need not link mapped_file.cpp.
  static GgufFile open(const std::string& path);

  const std::string& path() const { return path_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  // Null when parse() was given the bytes directly.
  const std::shared_ptr<const MappedFile>& mapping() const { return mapping_; }

  // --- metadata ---
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  bool has(const std::string& key) const { return metadata_.count(key) != 0; }
  const GgufValue* find(const std::string& key) const;

  // Scalars. get_X(key) throws when the key is missing, get_X(key, fallback) returns the fallback
  // then, find_X(key) returns nullopt then; all three throw when the value is present but has the
  // wrong type or does not fit. Integer getters accept any integer type whose value fits; float
  // getters accept floats and integers; no getter converts between strings, bools and numbers.
  std::uint32_t get_u32(const std::string& key) const;
  std::uint32_t get_u32(const std::string& key, std::uint32_t fallback) const;
  std::optional<std::uint32_t> find_u32(const std::string& key) const;
  std::uint64_t get_u64(const std::string& key) const;
  std::uint64_t get_u64(const std::string& key, std::uint64_t fallback) const;
  std::optional<std::uint64_t> find_u64(const std::string& key) const;
  std::int64_t get_i64(const std::string& key) const;
  std::int64_t get_i64(const std::string& key, std::int64_t fallback) const;
  std::optional<std::int64_t> find_i64(const std::string& key) const;
  float get_f32(const std::string& key) const;
  float get_f32(const std::string& key, float fallback) const;
  std::optional<float> find_f32(const std::string& key) const;
  bool get_bool(const std::string& key) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::optional<bool> find_bool(const std::string& key) const;
  const std::string& get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::optional<std::string> find_string(const std::string& key) const;

  // Arrays (e.g. tokenizer.ggml.tokens / merges / scores / token_type); throw when the key is
  // missing or is not an array of a matching element type (same conversions as above).
  const std::vector<std::string>& get_string_array(const std::string& key) const;
  std::vector<float> get_f32_array(const std::string& key) const;
  std::vector<std::int32_t> get_i32_array(const std::string& key) const;
  // Number of elements of an array value; throws when missing or not an array.
  std::uint64_t array_size(const std::string& key) const;

  // --- tensors ---
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(const std::string& name) const;
  // First byte of a tensor's data (inside the parsed buffer).
  const std::uint8_t* tensor_data(const GgufTensorInfo& info) const { return data_ + data_offset_ + info.offset; }
  // Absolute file offset of the data section.
  std::uint64_t data_offset() const { return data_offset_; }

 private:
  GgufFile() = default;
  const GgufValue& require(const std::string& key) const;
  template <typename T>
  std::optional<T> find_number(const std::string& key) const;
  template <typename T>
  std::vector<T> number_array(const std::string& key, const char* wanted) const;

  std::string path_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
  const std::uint8_t* data_ = nullptr;
  std::uint64_t data_offset_ = 0;
  std::shared_ptr<const MappedFile> mapping_;
};

inline GgufFile GgufFile::open(const std::string& path) {
  std::shared_ptr<const MappedFile> mapping = MappedFile::open(path);
  GgufFile file = parse(mapping->data(), mapping->size(), path);
  file.mapping_ = std::move(mapping);
  return file;
}

}  // namespace kvbound
