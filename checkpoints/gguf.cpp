#include "checkpoints/gguf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "base/errors.h"

// Numbers are copied out of the buffer with memcpy into host integers, which is only a decode of
// GGUF's little-endian encoding on a little-endian host.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the GGUF reader assumes a little-endian host");

namespace kvbound {
namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" as a little-endian u32
constexpr std::uint64_t kDefaultAlignment = 32;
constexpr std::uint32_t kMaxDims = 4;  // GGML_MAX_DIMS
constexpr std::size_t kHeaderBytes = 4 + 4 + 8 + 8;
// Lower bounds on an entry's encoded size, used to reject counts the remaining bytes cannot hold
// before anything is reserved: a key/value is at least a key length, a type and one byte of value;
// a tensor info at least a name length and one byte of name, n_dims, one dim, a type and an offset.
constexpr std::uint64_t kMinKeyValueBytes = 8 + 4 + 1;
constexpr std::uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;

bool is_value_type(std::uint32_t t) { return t <= static_cast<std::uint32_t>(GgufValueType::F64); }

// Encoded size of one element of a fixed-size type; 0 for strings and arrays.
std::size_t element_bytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::U8:
    case GgufValueType::I8:
    case GgufValueType::Bool: return 1;
    case GgufValueType::U16:
    case GgufValueType::I16: return 2;
    case GgufValueType::U32:
    case GgufValueType::I32:
    case GgufValueType::F32: return 4;
    case GgufValueType::U64:
    case GgufValueType::I64:
    case GgufValueType::F64: return 8;
    case GgufValueType::String:
    case GgufValueType::Array: return 0;
  }
  return 0;
}

class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size, const std::string& path) : data_(data), size_(size), path_(path) {}

  std::size_t pos() const { return pos_; }
  std::size_t remaining() const { return size_ - pos_; }

  void need(std::uint64_t n, const std::string& field, const std::string& what) const {
    if (n > remaining())
      fail(path_, field,
           "truncated: " + what + " needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
               ", the file has " + std::to_string(remaining()) + " left");
  }

  template <typename T>
  T read(const std::string& field, const std::string& what) {
    need(sizeof(T), field, what);
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  std::string read_string(const std::string& field, const std::string& what) {
    const auto length = read<std::uint64_t>(field, what + " length");
    need(length, field, what + " of " + std::to_string(length) + " bytes");
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(length));
    pos_ += static_cast<std::size_t>(length);
    return s;
  }

  // Copies n bytes (already checked with need()) and advances past them.
  void copy_to(std::vector<std::uint8_t>& out, std::size_t n) {
    out.assign(data_ + pos_, data_ + pos_ + n);
    pos_ += n;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  const std::string& path_;
};

GgufValue read_value(Reader& r, const std::string& path, const std::string& key, std::uint32_t type_id) {
  if (!is_value_type(type_id)) fail(path, key, "unknown value type " + std::to_string(type_id));
  GgufValue value;
  value.type = static_cast<GgufValueType>(type_id);
  value.element_type = value.type;
  if (value.is_array()) {
    const auto element_id = r.read<std::uint32_t>(key, "array element type");
    if (!is_value_type(element_id)) fail(path, key, "unknown array element type " + std::to_string(element_id));
    value.element_type = static_cast<GgufValueType>(element_id);
    if (value.element_type == GgufValueType::Array) fail(path, key, "arrays of arrays are not supported");
    value.count = r.read<std::uint64_t>(key, "array length");
  }
  const std::string what = value.is_array() ? "array of " + std::to_string(value.count) + " " +
                                                  gguf_value_type_name(value.element_type) + " values"
                                            : std::string(gguf_value_type_name(value.element_type)) + " value";
  if (value.element_type == GgufValueType::String) {
    // Every string costs at least its 8-byte length.
    if (value.count > r.remaining() / 8)
      fail(path, key, what + " cannot fit in the " + std::to_string(r.remaining()) + " bytes left");
    value.strings.reserve(static_cast<std::size_t>(value.count));
    for (std::uint64_t i = 0; i < value.count; ++i) value.strings.push_back(r.read_string(key, "string"));
  } else {
    const std::size_t size = element_bytes(value.element_type);
    if (value.count > r.remaining() / size)
      fail(path, key, what + " cannot fit in the " + std::to_string(r.remaining()) + " bytes left");
    r.copy_to(value.numbers, static_cast<std::size_t>(value.count) * size);
  }
  return value;
}

// One element of a numeric or bool value, widened without loss.
struct Number {
  enum Kind { Unsigned, Signed, Floating, Boolean } kind;
  std::uint64_t u = 0;
  std::int64_t s = 0;
  double f = 0;
};

template <typename T>
T load(const std::uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Element k of a numeric/bool value; nullopt for strings.
std::optional<Number> number_at(const GgufValue& v, std::uint64_t k) {
  const std::uint8_t* p = v.numbers.data() + k * element_bytes(v.element_type);
  Number n{Number::Unsigned};
  switch (v.element_type) {
    case GgufValueType::U8: n.u = load<std::uint8_t>(p); return n;
    case GgufValueType::U16: n.u = load<std::uint16_t>(p); return n;
    case GgufValueType::U32: n.u = load<std::uint32_t>(p); return n;
    case GgufValueType::U64: n.u = load<std::uint64_t>(p); return n;
    case GgufValueType::I8: n.kind = Number::Signed; n.s = load<std::int8_t>(p); return n;
    case GgufValueType::I16: n.kind = Number::Signed; n.s = load<std::int16_t>(p); return n;
    case GgufValueType::I32: n.kind = Number::Signed; n.s = load<std::int32_t>(p); return n;
    case GgufValueType::I64: n.kind = Number::Signed; n.s = load<std::int64_t>(p); return n;
    case GgufValueType::F32: n.kind = Number::Floating; n.f = load<float>(p); return n;
    case GgufValueType::F64: n.kind = Number::Floating; n.f = load<double>(p); return n;
    case GgufValueType::Bool: n.kind = Number::Boolean; n.u = load<std::uint8_t>(p) != 0; return n;
    case GgufValueType::String:
    case GgufValueType::Array: break;
  }
  return std::nullopt;
}

std::string number_text(const Number& n) {
  switch (n.kind) {
    case Number::Unsigned: return std::to_string(n.u);
    case Number::Signed: return std::to_string(n.s);
    case Number::Floating: return std::to_string(n.f);
    case Number::Boolean: return n.u ? "true" : "false";
  }
  return "";
}

// n as a T when T can hold it exactly (integers) or approximately (floats from any number in range).
template <typename T>
std::optional<T> number_as(const Number& n) {
  if constexpr (std::is_same_v<T, bool>) {
    if (n.kind == Number::Boolean) return n.u != 0;
    return std::nullopt;
  } else if constexpr (std::is_floating_point_v<T>) {
    switch (n.kind) {
      case Number::Unsigned: return static_cast<T>(n.u);
      case Number::Signed: return static_cast<T>(n.s);
      case Number::Floating:
        if (std::isfinite(n.f) && std::fabs(n.f) > static_cast<double>(std::numeric_limits<T>::max()))
          return std::nullopt;
        return static_cast<T>(n.f);
      case Number::Boolean: return std::nullopt;
    }
    return std::nullopt;
  } else {
    static_assert(std::is_integral_v<T>);
    std::uint64_t magnitude = 0;
    if (n.kind == Number::Signed && n.s < 0) {
      if constexpr (std::is_signed_v<T>) {
        if (n.s < static_cast<std::int64_t>(std::numeric_limits<T>::min())) return std::nullopt;
        return static_cast<T>(n.s);
      }
      return std::nullopt;
    }
    if (n.kind == Number::Signed) magnitude = static_cast<std::uint64_t>(n.s);
    else if (n.kind == Number::Unsigned) magnitude = n.u;
    else return std::nullopt;
    if (magnitude > static_cast<std::uint64_t>(std::numeric_limits<T>::max())) return std::nullopt;
    return static_cast<T>(magnitude);
  }
}

template <typename T>
const char* wanted_name() {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  else if constexpr (std::is_same_v<T, float>) return "float32";
  else if constexpr (std::is_same_v<T, std::uint32_t>) return "uint32";
  else if constexpr (std::is_same_v<T, std::uint64_t>) return "uint64";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "int64";
}

std::string describe(const GgufValue& v) {
  if (v.is_array())
    return "array of " + std::to_string(v.count) + " " + gguf_value_type_name(v.element_type);
  if (auto n = number_at(v, 0)) return std::string(gguf_value_type_name(v.type)) + " " + number_text(*n);
  return gguf_value_type_name(v.type);
}

}  // namespace

const char* gguf_value_type_name(GgufValueType type) {
  switch (type) {
    case GgufValueType::U8: return "uint8";
    case GgufValueType::I8: return "int8";
    case GgufValueType::U16: return "uint16";
    case GgufValueType::I16: return "int16";
    case GgufValueType::U32: return "uint32";
    case GgufValueType::I32: return "int32";
    case GgufValueType::F32: return "float32";
    case GgufValueType::Bool: return "bool";
    case GgufValueType::String: return "string";
    case GgufValueType::Array: return "array";
    case GgufValueType::U64: return "uint64";
    case GgufValueType::I64: return "int64";
    case GgufValueType::F64: return "float64";
  }
  return "unknown";
}

GgufFile GgufFile::parse(const std::uint8_t* data, std::size_t size, const std::string& path) {
  GgufFile file;
  file.path_ = path;
  file.data_ = data;
  Reader r(data, size, path);

  if (size < kHeaderBytes)
    fail(path, "header", "file is " + std::to_string(size) + " bytes, too short for a GGUF header (" +
                             std::to_string(kHeaderBytes) + ")");
  const auto magic = r.read<std::uint32_t>("header", "magic");
  if (magic != kMagic) fail(path, "header", "not a GGUF file (the first 4 bytes are not \"GGUF\")");
  const auto version = r.read<std::uint32_t>("version", "version");
  if (version == 0x02000000u || version == 0x03000000u) fail(path, "version", "big-endian GGUF is not supported");
  if (version != 2 && version != 3)
    fail(path, "version", "unsupported GGUF version " + std::to_string(version) + " (supported: 2, 3)");
  file.version_ = version;
  const auto tensor_count = r.read<std::uint64_t>("tensor_count", "tensor count");
  const auto kv_count = r.read<std::uint64_t>("metadata_kv_count", "metadata count");
  if (kv_count > r.remaining() / kMinKeyValueBytes)
    fail(path, "metadata_kv_count", std::to_string(kv_count) + " key/values cannot fit in the " +
                                        std::to_string(r.remaining()) + " bytes left");

  for (std::uint64_t i = 0; i < kv_count; ++i) {
    const std::string entry = "metadata[" + std::to_string(i) + "]";
    std::string key = r.read_string(entry, "key");
    if (key.empty()) fail(path, entry, "empty key");
    const auto type_id = r.read<std::uint32_t>(key, "value type");
    GgufValue value = read_value(r, path, key, type_id);
    if (!file.metadata_.emplace(key, std::move(value)).second) fail(path, key, "duplicate key");
  }

  if (tensor_count > r.remaining() / kMinTensorInfoBytes)
    fail(path, "tensor_count", std::to_string(tensor_count) + " tensor infos cannot fit in the " +
                                   std::to_string(r.remaining()) + " bytes left");
  file.tensors_.reserve(static_cast<std::size_t>(tensor_count));
  for (std::uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    t.name = r.read_string("tensor_info[" + std::to_string(i) + "]", "tensor name");
    if (t.name.empty()) fail(path, "tensor_info[" + std::to_string(i) + "]", "empty tensor name");
    const auto n_dims = r.read<std::uint32_t>(t.name, "n_dims");
    if (n_dims == 0 || n_dims > kMaxDims)
      fail(path, t.name, "n_dims is " + std::to_string(n_dims) + ", expected 1.." + std::to_string(kMaxDims));
    t.n_elements = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const auto dim = r.read<std::uint64_t>(t.name, "dimension");
      if (dim == 0 || dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail(path, t.name, "dimension " + std::to_string(d) + " is " + std::to_string(dim) + ", expected 1..2^63-1");
      const auto dim64 = static_cast<std::int64_t>(dim);
      if (t.n_elements > std::numeric_limits<std::int64_t>::max() / dim64)
        fail(path, t.name, "element count overflows 64 bits");
      t.n_elements *= dim64;
      t.dims.push_back(dim64);
    }
    const auto type_id = r.read<std::uint32_t>(t.name, "tensor type");
    const GgmlTypeInfo* type = find_ggml_type(type_id);
    if (type == nullptr) fail(path, t.name, "unknown ggml tensor type id " + std::to_string(type_id));
    t.type = type->type;
    if (t.dims[0] % type->block_size != 0)
      fail(path, t.name, "row length " + std::to_string(t.dims[0]) + " is not a multiple of " + type->name +
                             "'s block size " + std::to_string(type->block_size));
    const auto blocks = static_cast<std::uint64_t>(t.n_elements / type->block_size);
    const auto block_bytes = static_cast<std::uint64_t>(type->block_bytes);
    if (blocks > std::numeric_limits<std::uint64_t>::max() / block_bytes) fail(path, t.name, "byte size overflows 64 bits");
    t.n_bytes = blocks * block_bytes;
    t.offset = r.read<std::uint64_t>(t.name, "data offset");
    if (!file.tensor_index_.emplace(t.name, file.tensors_.size()).second) fail(path, t.name, "duplicate tensor name");
    file.tensors_.push_back(std::move(t));
  }

  const std::uint64_t alignment = file.get_u32("general.alignment", static_cast<std::uint32_t>(kDefaultAlignment));
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    fail(path, "general.alignment", "must be a power of two, got " + std::to_string(alignment));
  file.alignment_ = alignment;
  // The data section starts at the next multiple of the alignment after the tensor infos.
  file.data_offset_ = (r.pos() + alignment - 1) / alignment * alignment;
  if (file.tensors_.empty()) return file;
  if (file.data_offset_ > size)
    fail(path, "tensor data", "the data section would start at offset " + std::to_string(file.data_offset_) +
                                  ", past the end of the file (" + std::to_string(size) + " bytes)");
  const std::uint64_t data_bytes = size - file.data_offset_;
  for (const GgufTensorInfo& t : file.tensors_) {
    if (t.offset % alignment != 0)
      fail(path, t.name, "data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
                             std::to_string(alignment));
    if (t.offset > data_bytes || t.n_bytes > data_bytes - t.offset)
      fail(path, t.name, "data [" + std::to_string(t.offset) + ", +" + std::to_string(t.n_bytes) +
                             ") runs past the end of the data section (" + std::to_string(data_bytes) + " bytes)");
  }
  std::vector<const GgufTensorInfo*> by_offset;
  by_offset.reserve(file.tensors_.size());
  for (const GgufTensorInfo& t : file.tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensorInfo& prev = *by_offset[i - 1];
    const GgufTensorInfo& cur = *by_offset[i];
    if (prev.offset + prev.n_bytes > cur.offset)
      fail(path, cur.name, "data at offset " + std::to_string(cur.offset) + " overlaps tensor " + prev.name + " [" +
                               std::to_string(prev.offset) + ", +" + std::to_string(prev.n_bytes) + ")");
  }
  return file;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufValue& GgufFile::require(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) fail(path_, key, "missing");
  return *v;
}

template <typename T>
std::optional<T> GgufFile::find_number(const std::string& key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_array()) {
    if (auto n = number_at(*v, 0)) {
      if (auto x = number_as<T>(*n)) return x;
    }
  }
  fail(path_, key, std::string("expected ") + wanted_name<T>() + ", got " + describe(*v));
}

template <typename T>
std::vector<T> GgufFile::number_array(const std::string& key, const char* wanted) const {
  const GgufValue& v = require(key);
  if (!v.is_array() || v.element_type == GgufValueType::String)
    fail(path_, key, std::string("expected ") + wanted + ", got " + describe(v));
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(v.count));
  for (std::uint64_t i = 0; i < v.count; ++i) {
    const std::optional<Number> n = number_at(v, i);
    const std::optional<T> x = n ? number_as<T>(*n) : std::nullopt;
    if (!x)
      fail(path_, key, "element " + std::to_string(i) + ": expected " + wanted_name<T>() + ", got " +
                           gguf_value_type_name(v.element_type) + (n ? " " + number_text(*n) : ""));
    out.push_back(*x);
  }
  return out;
}

std::uint32_t GgufFile::get_u32(const std::string& key) const {
  require(key);
  return *find_number<std::uint32_t>(key);
}
std::uint32_t GgufFile::get_u32(const std::string& key, std::uint32_t fallback) const {
  return find_number<std::uint32_t>(key).value_or(fallback);
}
std::optional<std::uint32_t> GgufFile::find_u32(const std::string& key) const {
  return find_number<std::uint32_t>(key);
}

std::uint64_t GgufFile::get_u64(const std::string& key) const {
  require(key);
  return *find_number<std::uint64_t>(key);
}
std::uint64_t GgufFile::get_u64(const std::string& key, std::uint64_t fallback) const {
  return find_number<std::uint64_t>(key).value_or(fallback);
}
std::optional<std::uint64_t> GgufFile::find_u64(const std::string& key) const {
  return find_number<std::uint64_t>(key);
}

std::int64_t GgufFile::get_i64(const std::string& key) const {
  require(key);
  return *find_number<std::int64_t>(key);
}
std::int64_t GgufFile::get_i64(const std::string& key, std::int64_t fallback) const {
  return find_number<std::int64_t>(key).value_or(fallback);
}
std::optional<std::int64_t> GgufFile::find_i64(const std::string& key) const {
  return find_number<std::int64_t>(key);
}

float GgufFile::get_f32(const std::string& key) const {
  require(key);
  return *find_number<float>(key);
}
float GgufFile::get_f32(const std::string& key, float fallback) const {
  return find_number<float>(key).value_or(fallback);
}
std::optional<float> GgufFile::find_f32(const std::string& key) const { return find_number<float>(key); }

bool GgufFile::get_bool(const std::string& key) const {
  require(key);
  return *find_number<bool>(key);
}
bool GgufFile::get_bool(const std::string& key, bool fallback) const {
  return find_number<bool>(key).value_or(fallback);
}
std::optional<bool> GgufFile::find_bool(const std::string& key) const { return find_number<bool>(key); }

const std::string& GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(key);
  if (v.type != GgufValueType::String) fail(path_, key, "expected string, got " + describe(v));
  return v.strings[0];
}
std::string GgufFile::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}
std::optional<std::string> GgufFile::find_string(const std::string& key) const {
  if (!has(key)) return std::nullopt;
  return get_string(key);
}

const std::vector<std::string>& GgufFile::get_string_array(const std::string& key) const {
  const GgufValue& v = require(key);
  if (!v.is_array() || v.element_type != GgufValueType::String)
    fail(path_, key, "expected array of string, got " + describe(v));
  return v.strings;
}

std::vector<float> GgufFile::get_f32_array(const std::string& key) const {
  return number_array<float>(key, "array of float32");
}

std::vector<std::int32_t> GgufFile::get_i32_array(const std::string& key) const {
  return number_array<std::int32_t>(key, "array of int32");
}

std::uint64_t GgufFile::array_size(const std::string& key) const {
  const GgufValue& v = require(key);
  if (!v.is_array()) fail(path_, key, "expected an array, got " + describe(v));
  return v.count;
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace kvbound
