// The safetensors reader rejects every malformed file with one line naming the file and the tensor,
// and views well-formed F32 data in place.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "checkpoints/model_loader.h"
#include "checkpoints/safetensors_format.h"
#include "modules/backbone.h"
#include "test_env.h"

using namespace kvbound;
namespace fs = std::filesystem;

namespace {

std::vector<std::uint8_t> make_file(const nlohmann::json& header, std::size_t data_bytes) {
  std::string h = header.dump();
  h.resize((h.size() + 7) / 8 * 8, ' ');  // writers pad the header so the data starts 8-byte aligned
  std::vector<std::uint8_t> out(8 + h.size() + data_bytes, 0);
  const std::uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  std::copy(h.begin(), h.end(), out.begin() + 8);
  return out;
}

// Expects parse_safetensors to throw an Error whose one-line message names the file and `field`.
void expect_rejected(const std::vector<std::uint8_t>& bytes, const std::string& field, const std::string& words) {
  try {
    parse_safetensors(bytes.data(), bytes.size(), "bad.safetensors");
    FAIL() << "accepted a file that should fail on " << field;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("bad.safetensors: " + field, 0), 0u) << msg;
    EXPECT_NE(msg.find(words), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

nlohmann::json entry(const std::string& dtype, std::vector<std::int64_t> shape, std::size_t begin, std::size_t end) {
  return {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {begin, end}}};
}

TEST(Safetensors, ParsesAWellFormedHeader) {
  auto bytes = make_file({{"__metadata__", {{"format", "pt"}}}, {"a", entry("F32", {2, 3}, 0, 24)},
                          {"b", entry("BF16", {4}, 24, 32)}},
                         32);
  const auto h = parse_safetensors(bytes.data(), bytes.size(), "ok.safetensors");
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors.at("a").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(h.tensors.at("b").nbytes, 8u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, RejectsMalformedFiles) {
  auto good = make_file({{"a", entry("F32", {2}, 0, 8)}}, 8);
  expect_rejected(std::vector<std::uint8_t>(good.begin(), good.begin() + 5), "header", "too short");
  auto long_header = good;
  long_header[0] = 0xff;
  long_header[1] = 0xff;
  expect_rejected(long_header, "header", "past the end");
  expect_rejected(std::vector<std::uint8_t>(good.begin(), good.end() - 4), "a", "past the end of the data");
  expect_rejected(make_file({{"a", entry("I8", {2}, 0, 2)}}, 2), "a", "unsupported dtype 'I8'");
  expect_rejected(make_file({{"a", entry("F32", {3}, 0, 8)}}, 8), "a", "need 12");
  expect_rejected(make_file({{"a", entry("F32", {2}, 0, 8)}, {"b", entry("F32", {2}, 4, 12)}}, 12), "b",
                  "overlaps tensor a");
  expect_rejected(make_file({{"a", entry("F32", {2}, 8, 0)}}, 8), "a", "begin 8 > end 0");
  expect_rejected(make_file({{"a", {{"dtype", "F32"}, {"shape", {-2}}, {"data_offsets", {0, 8}}}}}, 8), "a",
                  "negative");
  auto not_json = make_file({{"a", 1}}, 0);
  not_json[9] = '!';
  expect_rejected(not_json, "header", "invalid JSON");
}

// Copies a tiny golden model into a temp folder and rewrites its weights file.
class CorruptModel : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = test::test_data("tiny/llama_tied");
    KVBOUND_REQUIRE_FILE(src_ + "/model.safetensors");
    dir_ = fs::temp_directory_path() / ("kvbound_corrupt_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(src_ + "/config.json", dir_ / "config.json");
    std::ifstream in(src_ + "/model.safetensors", std::ios::binary);
    bytes_.assign(std::istreambuf_iterator<char>(in), {});
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | bytes_[static_cast<std::size_t>(i)];
    header_ = nlohmann::json::parse(bytes_.begin() + 8, bytes_.begin() + 8 + static_cast<long>(n));
    data_.assign(bytes_.begin() + 8 + static_cast<long>(n), bytes_.end());
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void write(const nlohmann::json& header, const std::vector<std::uint8_t>& data) {
    auto file = make_file(header, 0);
    file.insert(file.end(), data.begin(), data.end());
    std::ofstream out(dir_ / "model.safetensors", std::ios::binary);
    out.write(reinterpret_cast<const char*>(file.data()), static_cast<std::streamsize>(file.size()));
  }
  std::string expect_load_error() {
    try {
      Backbone::load(dir_.string(), at::kFloat);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "the corrupt model loaded";
    return "";
  }
  std::string src_;
  fs::path dir_;
  std::vector<std::uint8_t> bytes_, data_;
  nlohmann::json header_;
};

TEST_F(CorruptModel, MissingTensorIsNamed) {
  header_.erase("model.layers.1.mlp.up_proj.weight");
  write(header_, data_);
  const std::string msg = expect_load_error();
  EXPECT_NE(msg.find("model.layers.1.mlp.up_proj.weight: missing tensor"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir_.string()), std::string::npos) << msg;
}

TEST_F(CorruptModel, ShapeMismatchIsNamed) {
  auto& e = header_["model.layers.0.self_attn.k_proj.weight"];
  e["shape"] = {64, 16};  // same bytes, transposed shape
  write(header_, data_);
  const std::string msg = expect_load_error();
  EXPECT_NE(msg.find("model.layers.0.self_attn.k_proj.weight: shape [64, 16] expected [16, 64]"), std::string::npos)
      << msg;
}

TEST_F(CorruptModel, TruncatedDataIsNamed) {
  write(header_, std::vector<std::uint8_t>(data_.begin(), data_.begin() + static_cast<long>(data_.size() / 2)));
  const std::string msg = expect_load_error();
  EXPECT_NE(msg.find("model.safetensors: "), std::string::npos) << msg;
  EXPECT_NE(msg.find("past the end of the data"), std::string::npos) << msg;
}

TEST_F(CorruptModel, BadConfigFieldIsNamed) {
  std::ofstream(dir_ / "config.json") << R"({"model_type": "llama", "vocab_size": 160, "hidden_size": 64,
    "intermediate_size": 112, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 3})";
  write(header_, data_);
  const std::string msg = expect_load_error();
  EXPECT_NE(msg.find("config.json: num_key_value_heads: 3 does not divide"), std::string::npos) << msg;
}

}  // namespace
