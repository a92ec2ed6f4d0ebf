#include "checkpoints/safetensors_format.h"

#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "base/errors.h"

namespace kvbound {

std::size_t st_dtype_size(StDtype dtype) { return dtype == StDtype::F32 ? 4 : 2; }

const char* st_dtype_name(StDtype dtype) {
  switch (dtype) {
    case StDtype::F32: return "F32";
    case StDtype::F16: return "F16";
    case StDtype::BF16: return "BF16";
  }
  return "?";
}

namespace {

StDtype parse_dtype(const std::string& s, const std::string& path, const std::string& name) {
  if (s == "F32") return StDtype::F32;
  if (s == "F16") return StDtype::F16;
  if (s == "BF16") return StDtype::BF16;
  fail(path, name, "unsupported dtype '" + s + "' (F32, F16, BF16)");
}

std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

SafetensorsHeader parse_safetensors(const std::uint8_t* data, std::size_t size, const std::string& path) {
  if (size < 8) fail(path, "header", "file is " + std::to_string(size) + " bytes, too short for a header length");
  const std::uint64_t header_len = read_u64_le(data);
  if (header_len > size - 8)
    fail(path, "header", "header length " + std::to_string(header_len) + " runs past the end of the " +
                             std::to_string(size) + "-byte file");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(data + 8, data + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(path, "header", std::string("invalid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path, "header", "JSON header is not an object");

  const std::size_t data_start = 8 + static_cast<std::size_t>(header_len);
  const std::size_t data_size = size - data_start;
  SafetensorsHeader out;
  std::vector<std::pair<std::size_t, std::string>> extents;  // (begin, name), to find overlaps
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& entry = it.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(path, name, "must be an object of strings");
      for (auto m = entry.begin(); m != entry.end(); ++m) {
        if (!m.value().is_string()) fail(path, "__metadata__." + m.key(), "must be a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!entry.is_object()) fail(path, name, "entry is not an object");
    if (!entry.contains("dtype") || !entry["dtype"].is_string()) fail(path, name, "missing string 'dtype'");
    if (!entry.contains("shape") || !entry["shape"].is_array()) fail(path, name, "missing array 'shape'");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() || entry["data_offsets"].size() != 2)
      fail(path, name, "missing 'data_offsets' [begin, end]");
    StTensorInfo info;
    info.dtype = parse_dtype(entry["dtype"].get<std::string>(), path, name);
    std::uint64_t numel = 1;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) fail(path, name, "shape holds a non-integer or negative dimension");
      const auto dim = d.get<std::uint64_t>();
      if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (dim != 0 && numel > std::numeric_limits<std::uint64_t>::max() / 8 / dim))
        fail(path, name, "shape is too large");
      numel *= dim;
      info.shape.push_back(static_cast<std::int64_t>(dim));
    }
    const auto& off = entry["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, name, "data_offsets must be non-negative integers");
    const auto begin = off[0].get<std::uint64_t>();
    const auto end = off[1].get<std::uint64_t>();
    if (begin > end) fail(path, name, "data_offsets begin " + std::to_string(begin) + " > end " + std::to_string(end));
    if (end > data_size)
      fail(path, name, "data_offsets end " + std::to_string(end) + " is past the end of the data (" +
                           std::to_string(data_size) + " bytes)");
    const std::uint64_t expected = numel * st_dtype_size(info.dtype);
    if (end - begin != expected)
      fail(path, name, "holds " + std::to_string(end - begin) + " bytes but its shape and dtype need " +
                           std::to_string(expected));
    info.begin = data_start + static_cast<std::size_t>(begin);
    info.nbytes = static_cast<std::size_t>(end - begin);
    if (info.nbytes > 0) extents.emplace_back(static_cast<std::size_t>(begin), name);
    out.tensors.emplace(name, std::move(info));
  }
  std::sort(extents.begin(), extents.end());
  for (std::size_t i = 1; i < extents.size(); ++i) {
    const auto& prev = out.tensors.at(extents[i - 1].second);
    if (extents[i].first < prev.begin - data_start + prev.nbytes)
      fail(path, extents[i].second, "data overlaps tensor " + extents[i - 1].second);
  }
  return out;
}

}  // namespace kvbound
