#include "checkpoints/safetensors_io.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/mapped_file.h"

// The format stores little-endian data; tensors are copied byte for byte.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace kvbound {

at::ScalarType st_torch_dtype(StDtype dtype) {
  switch (dtype) {
    case StDtype::F32: return at::kFloat;
    case StDtype::F16: return at::kHalf;
    case StDtype::BF16: return at::kBFloat16;
  }
  return at::kFloat;
}

namespace {

struct PendingTensor {
  const std::string* name;
  at::Tensor data;  // contiguous
  StDtype dtype;
};

StDtype st_dtype_of(const at::Tensor& t, const std::string& path, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return StDtype::F32;
    case at::kHalf: return StDtype::F16;
    case at::kBFloat16: return StDtype::BF16;
    default:
      fail(path, name, std::string("unsupported dtype ") + c10::toString(t.scalar_type()) +
                           " (float32, float16, bfloat16)");
  }
}

void append_u64_le(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

void write_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // Validate every tensor before writing anything (nothing half-way).
  std::vector<PendingTensor> pending;
  for (const auto& [name, tensor] : tensors) {
    if (name == "__metadata__") fail(path, name, "is reserved for the metadata map");
    if (!tensor.defined()) fail(path, name, "tensor is undefined");
    if (!tensor.device().is_cpu()) fail(path, name, "must be a CPU tensor, got " + tensor.device().str());
    const StDtype dtype = st_dtype_of(tensor, path, name);
    pending.push_back({&name, tensor.detach().contiguous(), dtype});
  }
  // Wider elements first: with the data section starting 8-byte aligned and no gaps (the format forbids
  // holes), every tensor then starts at a multiple of its element size, so readers can view it in place.
  std::stable_sort(pending.begin(), pending.end(), [](const PendingTensor& a, const PendingTensor& b) {
    return st_dtype_size(a.dtype) > st_dtype_size(b.dtype);
  });

  nlohmann::json header = nlohmann::json::object();  // std::map-backed: keys come out sorted
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const PendingTensor& t : pending) {
    const std::uint64_t nbytes = t.data.nbytes();
    header[*t.name] = {{"dtype", st_dtype_name(t.dtype)},
                       {"shape", t.data.sizes().vec()},
                       {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // a name or metadata string that is not valid UTF-8
    fail(path, "header", std::string("cannot encode: ") + e.what());
  }
  // The format allows trailing spaces in the header; they put the data at an 8-byte boundary.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  std::string bytes;
  bytes.reserve(8 + header_text.size() + offset);
  append_u64_le(bytes, header_text.size());
  bytes += header_text;
  for (const PendingTensor& t : pending)
    bytes.append(static_cast<const char*>(t.data.const_data_ptr()), t.data.nbytes());
  write_file_atomic(path, bytes);
}

SafetensorsFile read_safetensors(const std::string& path) {
  const auto file = MappedFile::open(path);
  SafetensorsHeader header = parse_safetensors(file->data(), file->size(), path);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  for (const auto& [name, info] : header.tensors) {
    // Copied, not viewed: the result must outlive the mapping and any later replacement of the file.
    at::Tensor tensor = at::empty(info.shape, at::TensorOptions().dtype(st_torch_dtype(info.dtype)));
    if (info.nbytes > 0) std::memcpy(tensor.mutable_data_ptr(), file->data() + info.begin, info.nbytes);
    out.tensors.emplace(name, std::move(tensor));
  }
  return out;
}

}  // namespace kvbound
