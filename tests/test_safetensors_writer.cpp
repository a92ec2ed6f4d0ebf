// Safetensors writer and owned-tensor reader (checkpoints/safetensors_io.h): round trips of every supported
// dtype (0-d, empty and strided tensors, metadata), the layout the format asks for, readers rejecting a
// truncated file by name, and failed writes leaving nothing behind.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/scalar_tensor.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "base/errors.h"
#include "checkpoints/safetensors_format.h"
#include "checkpoints/safetensors_io.h"

using namespace kvbound;
namespace fs = std::filesystem;

namespace {

class SafetensorsWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string name_template = (fs::temp_directory_path() / "kvbound_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(name_template.data()), nullptr);
    dir_ = name_template;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& rel) const { return (dir_ / rel).string(); }

  std::size_t entries(const fs::path& folder) const {
    return static_cast<std::size_t>(std::distance(fs::directory_iterator(folder), fs::directory_iterator()));
  }

  fs::path dir_;
};

std::vector<std::uint8_t> read_bytes(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& file, const std::vector<std::uint8_t>& bytes, std::size_t count) {
  std::ofstream out(file, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(count));
}

// Every supported dtype; odd 2-byte element counts (which would misalign a following float32 tensor if the
// data were in name order), a transposed view, a 0-d and an empty tensor.
std::map<std::string, at::Tensor> sample_tensors() {
  return {
      {"a.bf16_odd", at::randn({3}).to(at::kBFloat16)},
      {"b.f32", at::randn({4, 5})},
      {"c.f16_odd", at::randn({1, 5}).to(at::kHalf)},
      {"d.f32_transposed", at::arange(12, at::kFloat).view({3, 4}).t()},
      {"e.scalar", at::scalar_tensor(2.5, at::kFloat)},
      {"f.empty", at::empty({0, 4}, at::kHalf)},
      {"layers.0.gate.w1", at::randn({8, 2}).to(at::kBFloat16)},
  };
}

}  // namespace

TEST_F(SafetensorsWriterTest, RoundTripsTensorsAndMetadata) {
  const auto tensors = sample_tensors();
  const std::map<std::string, std::string> metadata = {
      {"method", "trimkv"}, {"budget", "128"}, {"config_hash", "9f2c"}, {"note", "κβ \"quoted\""}};
  const std::string file = path("gates.safetensors");
  write_safetensors(file, tensors, metadata);
  const SafetensorsFile back = read_safetensors(file);
  EXPECT_EQ(back.metadata, metadata);
  ASSERT_EQ(back.tensors.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor& read = back.tensors.at(name);
    EXPECT_EQ(read.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_EQ(read.sizes(), tensor.sizes()) << name;
    EXPECT_TRUE(read.is_contiguous()) << name;
    EXPECT_TRUE(at::equal(read, tensor)) << name;
  }
  // No metadata: the header has no "__metadata__" entry and reads back empty.
  write_safetensors(file, {{"x", at::randn({2})}});
  EXPECT_TRUE(read_safetensors(file).metadata.empty());
  EXPECT_EQ(entries(dir_), 1u);  // only the published file: no temporary left behind
}

TEST_F(SafetensorsWriterTest, LayoutIsAlignedWithoutGaps) {
  const std::string file = path("layout.safetensors");
  write_safetensors(file, sample_tensors(), {{"k", "v"}});
  const std::vector<std::uint8_t> bytes = read_bytes(file);
  const SafetensorsHeader header = parse_safetensors(bytes.data(), bytes.size(), file);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  const std::size_t data_start = 8 + header_len;
  EXPECT_EQ(data_start % 8, 0u);
  std::vector<std::pair<std::size_t, std::size_t>> extents;
  for (const auto& [name, info] : header.tensors) {
    EXPECT_EQ((info.begin - data_start) % st_dtype_size(info.dtype), 0u) << name << " is misaligned";
    extents.emplace_back(info.begin, info.begin + info.nbytes);
  }
  // The data is covered exactly: from the end of the header to the end of the file, no holes.
  std::sort(extents.begin(), extents.end());
  std::size_t next = data_start;
  for (const auto& [begin, end] : extents) {
    EXPECT_EQ(begin, next);
    next = end;
  }
  EXPECT_EQ(next, bytes.size());
}

TEST_F(SafetensorsWriterTest, ReadTensorsOutliveTheFile) {
  const std::string file = path("owned.safetensors");
  const at::Tensor original = at::randn({16});
  write_safetensors(file, {{"w", original}});
  const at::Tensor read = read_safetensors(file).tensors.at("w");
  write_safetensors(file, {{"w", original + 1}});  // replaced atomically while `read` is alive
  fs::remove(file);
  EXPECT_TRUE(at::equal(read, original));
}

TEST_F(SafetensorsWriterTest, TruncatedFileIsRejectedByName) {
  const std::string file = path("full.safetensors");
  write_safetensors(file, {{"w", at::randn({4, 4})}}, {{"k", "v"}});
  const std::vector<std::uint8_t> bytes = read_bytes(file);
  const std::string truncated = path("truncated.safetensors");
  // Inside the last tensor's data, inside the JSON header, inside the header length.
  for (const std::size_t keep : {bytes.size() - 1, std::size_t{20}, std::size_t{5}}) {
    write_bytes(truncated, bytes, keep);
    try {
      read_safetensors(truncated);
      ADD_FAILURE() << "accepted a file truncated to " << keep << " bytes";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(truncated + ": ", 0), 0u) << e.what();
    }
  }
  try {
    read_safetensors(path("missing.safetensors"));
    ADD_FAILURE() << "read a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos) << e.what();
  }
}

TEST_F(SafetensorsWriterTest, FailedWritesLeaveNothingBehind) {
  // An unsupported dtype is refused before anything is written, naming the file and the tensor.
  const std::string file = path("gates.safetensors");
  try {
    write_safetensors(file, {{"ok", at::randn({2})}, {"steps", at::arange(3)}});
    ADD_FAILURE() << "wrote an int64 tensor";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(file + ": steps: unsupported dtype", 0), 0u) << e.what();
  }
  EXPECT_THROW(write_safetensors(file, {{"__metadata__", at::randn({2})}}), Error);
  EXPECT_THROW(write_safetensors(file, {{"undefined", at::Tensor()}}), Error);
  EXPECT_EQ(entries(dir_), 0u);

  // The rename cannot replace a folder: the temporary file is removed and the folder left as it was.
  fs::create_directory(path("taken"));
  EXPECT_THROW(write_safetensors(path("taken"), {{"w", at::randn({2})}}), Error);
  EXPECT_EQ(entries(dir_), 1u);
  EXPECT_EQ(entries(path("taken")), 0u);

  // A parent that is a regular file cannot become a folder.
  write_bytes(path("plain"), {}, 0);
  EXPECT_THROW(write_safetensors(path("plain/gates.safetensors"), {{"w", at::randn({2})}}), Error);
  EXPECT_EQ(entries(dir_), 2u);
}
