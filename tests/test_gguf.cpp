// GGUF loader: dequantization against gguf-py, the SmolLM2 GGUF against transformers' reading of
// it, tiny hand-built GGUF models (mapping, q/k un-permutation, dtypes), and corrupt files.
#include <gtest/gtest.h>

#include <ATen/ops/arange.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/tensor.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <optional>

#include "base/errors.h"
#include "checkpoints/gguf.h"
#include "checkpoints/gguf_checkpoint.h"
#include "checkpoints/gguf_dequant.h"
#include "test_env.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<float> read_f32(const std::string& path) {
  const std::vector<std::uint8_t> bytes = read_bytes(path);
  std::vector<float> values(bytes.size() / sizeof(float));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(float));
  return values;
}

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::uint8_t> tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const std::uint8_t*>(c.data_ptr());
  return {p, p + c.nbytes()};
}

// Expects `body` to throw kvbound::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& body, const std::vector<std::string>& parts) {
  try {
    body();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    return;
  }
  ADD_FAILURE() << "no kvbound::Error thrown";
}

// --- a GGUF writer, with every field open to corruption ---

struct RawTensor {
  std::string name;
  std::vector<std::uint64_t> dims;  // ggml order (ne0 first)
  std::uint32_t type;
  std::vector<std::uint8_t> data;
  std::optional<std::uint64_t> offset;  // default: packed at the alignment
  bool write_data = true;               // false: the file ends before this tensor's data
};

class GgufBuilder {
 public:
  std::uint32_t magic = 0x46554747;
  std::uint32_t version = 3;
  std::uint64_t alignment = 32;
  std::vector<RawTensor> tensors;

  // A key/value whose type id and encoded payload are given verbatim.
  GgufBuilder& raw(const std::string& key, std::uint32_t type, const std::vector<std::uint8_t>& payload) {
    std::vector<std::uint8_t> kv;
    put_string(kv, key);
    put(kv, type);
    kv.insert(kv.end(), payload.begin(), payload.end());
    kvs_.push_back(std::move(kv));
    return *this;
  }
  GgufBuilder& u32(const std::string& key, std::uint32_t v) { return raw(key, 4, pod(v)); }
  GgufBuilder& f32(const std::string& key, float v) { return raw(key, 6, pod(v)); }
  GgufBuilder& str(const std::string& key, const std::string& v) {
    std::vector<std::uint8_t> payload;
    put_string(payload, v);
    return raw(key, 8, payload);
  }
  GgufBuilder& strings(const std::string& key, const std::vector<std::string>& values) {
    std::vector<std::uint8_t> payload;
    put(payload, std::uint32_t{8});
    put(payload, std::uint64_t{values.size()});
    for (const std::string& v : values) put_string(payload, v);
    return raw(key, 9, payload);
  }
  GgufBuilder& floats(const std::string& key, const std::vector<float>& values) {
    std::vector<std::uint8_t> payload;
    put(payload, std::uint32_t{6});
    put(payload, std::uint64_t{values.size()});
    for (float v : values) put(payload, v);
    return raw(key, 9, payload);
  }
  GgufBuilder& ints(const std::string& key, const std::vector<std::int32_t>& values) {
    std::vector<std::uint8_t> payload;
    put(payload, std::uint32_t{5});
    put(payload, std::uint64_t{values.size()});
    for (std::int32_t v : values) put(payload, v);
    return raw(key, 9, payload);
  }
  // A tensor from a torch tensor (F32/F16/BF16): ggml dims are the torch shape reversed.
  GgufBuilder& tensor(const std::string& name, const at::Tensor& t) {
    const std::uint32_t type = t.scalar_type() == at::kFloat ? 0 : t.scalar_type() == at::kHalf ? 1 : 30;
    std::vector<std::uint64_t> dims(t.sizes().rbegin(), t.sizes().rend());
    tensors.push_back({name, dims, type, tensor_bytes(t), std::nullopt});
    return *this;
  }
  RawTensor& find(const std::string& name) {
    for (RawTensor& t : tensors)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  }
  void remove(const std::string& name) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const RawTensor& t) { return t.name == name; }),
                  tensors.end());
  }

  std::vector<std::uint8_t> build() const {
    std::vector<std::uint8_t> out;
    put(out, magic);
    put(out, version);
    put(out, std::uint64_t{tensors.size()});
    put(out, std::uint64_t{kvs_.size()});
    for (const auto& kv : kvs_) out.insert(out.end(), kv.begin(), kv.end());
    std::vector<std::uint64_t> offsets;
    std::uint64_t packed = 0;
    for (const RawTensor& t : tensors) {
      offsets.push_back(t.offset.value_or(packed));
      packed = align(offsets.back() + t.data.size());
    }
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const RawTensor& t = tensors[i];
      put_string(out, t.name);
      put(out, static_cast<std::uint32_t>(t.dims.size()));
      for (std::uint64_t d : t.dims) put(out, d);
      put(out, t.type);
      put(out, offsets[i]);
    }
    out.resize(align(out.size()), 0);
    std::vector<std::uint8_t> data;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].write_data) continue;
      data.resize(std::max<std::size_t>(data.size(), align(offsets[i] + tensors[i].data.size())), 0);
      std::copy(tensors[i].data.begin(), tensors[i].data.end(), data.begin() + static_cast<std::ptrdiff_t>(offsets[i]));
    }
    out.insert(out.end(), data.begin(), data.end());
    return out;
  }

 private:
  template <typename T>
  static std::vector<std::uint8_t> pod(T v) {
    std::vector<std::uint8_t> b(sizeof v);
    std::memcpy(b.data(), &v, sizeof v);
    return b;
  }
  template <typename T>
  static void put(std::vector<std::uint8_t>& out, T v) {
    const auto b = pod(v);
    out.insert(out.end(), b.begin(), b.end());
  }
  static void put_string(std::vector<std::uint8_t>& out, const std::string& s) {
    put(out, std::uint64_t{s.size()});
    out.insert(out.end(), s.begin(), s.end());
  }
  std::uint64_t align(std::uint64_t n) const { return (n + alignment - 1) / alignment * alignment; }

  std::vector<std::vector<std::uint8_t>> kvs_;
};

// A scratch directory for the files a test writes. POSIX calls rather than std::filesystem's
// remove_all: libtorch.so exports its own copy of that symbol, which crashes when it wins.
class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path().string() + "/kvbound_test_gguf_" + std::to_string(::getpid())) {
    ::mkdir(path_.c_str(), 0700);
  }
  ~TempDir() {
    for (const std::string& f : files_) std::remove(f.c_str());
    ::rmdir(path_.c_str());
  }
  std::string file(const std::string& name) {
    files_.push_back(path_ + "/" + name);
    return files_.back();
  }

 private:
  std::string path_;
  std::vector<std::string> files_;
};

// --- dequantization vs gguf-py ---

TEST(GgufDequant, MatchesGgufPyForEveryType) {
  const std::vector<std::pair<const char*, GgmlType>> types = {
      {"F32", GgmlType::F32},   {"F16", GgmlType::F16},   {"BF16", GgmlType::BF16}, {"Q4_0", GgmlType::Q4_0},
      {"Q4_1", GgmlType::Q4_1}, {"Q5_0", GgmlType::Q5_0}, {"Q5_1", GgmlType::Q5_1}, {"Q8_0", GgmlType::Q8_0},
      {"Q4_K", GgmlType::Q4_K}, {"Q5_K", GgmlType::Q5_K}, {"Q6_K", GgmlType::Q6_K},
  };
  for (const auto& [name, type] : types) {
    SCOPED_TRACE(name);
    const std::string base = test::test_data(std::string("gguf_quant/") + name);
    ASSERT_TRUE(fs::exists(base + ".raw")) << "missing " << base << ".raw (ctest fixture golden.gguf_quant)";
    const std::vector<std::uint8_t> raw = read_bytes(base + ".raw");
    const std::vector<float> expected = read_f32(base + ".f32");
    const auto n = static_cast<std::int64_t>(expected.size());
    ASSERT_GT(n, 0);
    ASSERT_EQ(ggml_row_bytes(type, n), static_cast<std::int64_t>(raw.size()));
    std::vector<float> got(expected.size());
    dequantize_row(type, raw.data(), n, got.data());
    double worst = 0;
    std::int64_t inexact = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const float e = expected[i], g = got[i];
      if (std::isinf(e)) {
        EXPECT_EQ(e, g) << "element " << i;
        continue;
      }
      if (g != e) ++inexact;
      worst = std::max(worst, std::fabs(double(g) - double(e)) / std::max(1e-30, std::fabs(double(e))));
    }
    EXPECT_LE(worst, 1e-6) << inexact << " of " << n << " elements differ";
  }
}

TEST(GgufDequant, TypeTable) {
  EXPECT_EQ(find_ggml_type(4), nullptr);  // retired Q4_2
  EXPECT_EQ(find_ggml_type(1000), nullptr);
  ASSERT_NE(find_ggml_type(14), nullptr);
  EXPECT_STREQ(find_ggml_type(14)->name, "Q6_K");
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q6_K, 512), 420);
  EXPECT_EQ(ggml_row_bytes(GgmlType::Q4_1, 576), 18 * 20);
  EXPECT_EQ(ggml_type_name(static_cast<GgmlType>(77)), "type 77");
  std::vector<float> out(256);
  const std::vector<std::uint8_t> zeros(1024, 0);
  EXPECT_THROW(dequantize_row(GgmlType::Q2_K, zeros.data(), 256, out.data()), Error);
  EXPECT_THROW(dequantize_row(GgmlType::Q8_0, zeros.data(), 48, out.data()), Error);
  EXPECT_THROW(ggml_row_bytes(GgmlType::Q4_K, 100), Error);
}

// --- metadata parsing ---

TEST(GgufFile, ReadsMetadataOfEveryKind) {
  GgufBuilder b;
  b.str("general.architecture", "llama")
      .u32("llama.block_count", 3)
      .f32("llama.rope.freq_base", 500000.0f)
      .strings("tokenizer.ggml.tokens", {"<s>", "a", "", "\xE2\x96\x81" "b"})
      .floats("tokenizer.ggml.scores", {0.0f, -1.5f, 2.0f, 3.0f})
      .ints("tokenizer.ggml.token_type", {3, 1, 1, 6})
      .raw("neg", 5, {0xFF, 0xFF, 0xFF, 0xFF})  // int32 -1
      .raw("flag", 7, {1})
      .raw("big", 10, {0, 0, 0, 0, 1, 0, 0, 0})  // uint64 2^32
      .raw("dbl", 12, {0, 0, 0, 0, 0, 0, 0xF0, 0x3F});  // float64 1.0
  b.tensor("w", at::arange(64, at::kFloat).reshape({2, 32}));
  const std::vector<std::uint8_t> bytes = b.build();
  const GgufFile f = GgufFile::parse(bytes.data(), bytes.size(), "mem.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_u32("llama.block_count"), 3u);
  EXPECT_EQ(f.get_i64("llama.block_count"), 3);
  EXPECT_FLOAT_EQ(f.get_f32("llama.rope.freq_base"), 500000.0f);
  EXPECT_FLOAT_EQ(f.get_f32("llama.block_count"), 3.0f);  // integers widen to float
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens"), (std::vector<std::string>{"<s>", "a", "", "\xE2\x96\x81" "b"}));
  EXPECT_EQ(f.get_f32_array("tokenizer.ggml.scores"), (std::vector<float>{0.0f, -1.5f, 2.0f, 3.0f}));
  EXPECT_EQ(f.get_i32_array("tokenizer.ggml.token_type"), (std::vector<std::int32_t>{3, 1, 1, 6}));
  EXPECT_EQ(f.array_size("tokenizer.ggml.tokens"), 4u);
  EXPECT_EQ(f.get_i64("neg"), -1);
  EXPECT_TRUE(f.get_bool("flag"));
  EXPECT_EQ(f.get_u64("big"), std::uint64_t{1} << 32);
  EXPECT_FLOAT_EQ(f.get_f32("dbl"), 1.0f);
  // Defaults and optionals for absent keys; type errors name the key.
  EXPECT_EQ(f.get_u32("absent", 7), 7u);
  EXPECT_EQ(f.get_string("absent", "x"), "x");
  EXPECT_FALSE(f.find_f32("absent").has_value());
  EXPECT_EQ(f.find_u32("llama.block_count"), std::optional<std::uint32_t>(3));
  expect_error([&] { f.get_u32("absent"); }, {"mem.gguf", "absent", "missing"});
  expect_error([&] { f.get_u32("neg"); }, {"mem.gguf", "neg", "expected uint32, got int32 -1"});
  expect_error([&] { f.get_u32("big"); }, {"big", "uint32"});
  expect_error([&] { f.get_string("llama.block_count"); }, {"llama.block_count", "expected string"});
  expect_error([&] { f.get_u32("tokenizer.ggml.tokens"); }, {"tokenizer.ggml.tokens", "array of 4 string"});
  expect_error([&] { f.get_i32_array("tokenizer.ggml.scores"); }, {"tokenizer.ggml.scores", "element 0"});
  expect_error([&] { f.get_string_array("tokenizer.ggml.scores"); }, {"tokenizer.ggml.scores", "array of string"});

  ASSERT_EQ(f.tensors().size(), 1u);
  const GgufTensorInfo* w = f.find_tensor("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dims, (std::vector<std::int64_t>{32, 2}));
  EXPECT_EQ(w->type, GgmlType::F32);
  EXPECT_EQ(w->n_elements, 64);
  EXPECT_EQ(w->n_bytes, 256u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  float second;
  std::memcpy(&second, f.tensor_data(*w) + 4, 4);
  EXPECT_EQ(second, 1.0f);
}

TEST(GgufFile, HonoursCustomAlignmentAndVersion2) {
  GgufBuilder b;
  b.version = 2;
  b.alignment = 64;
  b.u32("general.alignment", 64);
  b.tensor("a", at::ones({3}, at::kFloat)).tensor("b", at::ones({5}, at::kFloat));
  const std::vector<std::uint8_t> bytes = b.build();
  const GgufFile f = GgufFile::parse(bytes.data(), bytes.size(), "mem.gguf");
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.find_tensor("b")->offset, 64u);
}

// --- corrupt containers: each error names the file and the key or tensor ---

GgufBuilder small_valid_file() {
  GgufBuilder b;
  b.str("general.architecture", "llama").strings("tokenizer.ggml.tokens", {"a", "b"});
  b.tensor("first.weight", at::arange(32, at::kFloat)).tensor("second.weight", at::arange(64, at::kFloat));
  return b;
}

void expect_parse_error(const std::vector<std::uint8_t>& bytes, const std::vector<std::string>& parts) {
  std::vector<std::string> all = parts;
  all.push_back("bad.gguf");
  expect_error([&] { GgufFile::parse(bytes.data(), bytes.size(), "bad.gguf"); }, all);
}

TEST(GgufFile, RejectsEveryTruncation) {
  const std::vector<std::uint8_t> bytes = small_valid_file().build();
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    std::vector<std::uint8_t> prefix(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(n));
    SCOPED_TRACE("prefix of " + std::to_string(n) + " bytes");
    expect_parse_error(prefix, {});
  }
  // Cut inside the last tensor's data: the error names that tensor.
  std::vector<std::uint8_t> cut(bytes.begin(), bytes.end() - 4);
  expect_parse_error(cut, {"second.weight", "past the end"});
}

TEST(GgufFile, RejectsBadHeaders) {
  GgufBuilder b = small_valid_file();
  b.magic = 0x46554746;
  expect_parse_error(b.build(), {"header", "not a GGUF file"});
  b = small_valid_file();
  b.version = 1;
  expect_parse_error(b.build(), {"version", "unsupported GGUF version 1"});
  b.version = 4;
  expect_parse_error(b.build(), {"version", "4"});
  b.version = 0x03000000;
  expect_parse_error(b.build(), {"version", "big-endian"});
}

TEST(GgufFile, RejectsAbsurdCountsAndLengths) {
  // The key/value count is patched after the header: 2^60 entries cannot fit in the file.
  std::vector<std::uint8_t> bytes = small_valid_file().build();
  const std::uint64_t huge = std::uint64_t{1} << 60;
  std::memcpy(bytes.data() + 16, &huge, 8);
  expect_parse_error(bytes, {"metadata_kv_count"});
  bytes = small_valid_file().build();
  std::memcpy(bytes.data() + 8, &huge, 8);
  expect_parse_error(bytes, {"tensor_count"});

  GgufBuilder b;
  std::vector<std::uint8_t> payload(8);
  std::memcpy(payload.data(), &huge, 8);  // a string length of 2^60
  b.raw("general.name", 8, payload);
  expect_parse_error(b.build(), {"general.name", "truncated"});

  GgufBuilder arrays;
  std::vector<std::uint8_t> array_payload = {8, 0, 0, 0};  // array of strings
  array_payload.insert(array_payload.end(), payload.begin(), payload.end());
  arrays.raw("tokenizer.ggml.tokens", 9, array_payload);
  expect_parse_error(arrays.build(), {"tokenizer.ggml.tokens", "cannot fit"});

  GgufBuilder numbers;
  std::vector<std::uint8_t> number_payload = {6, 0, 0, 0};  // array of float32
  number_payload.insert(number_payload.end(), payload.begin(), payload.end());
  numbers.raw("tokenizer.ggml.scores", 9, number_payload);
  expect_parse_error(numbers.build(), {"tokenizer.ggml.scores", "cannot fit"});
}

TEST(GgufFile, RejectsBadValues) {
  GgufBuilder b;
  b.raw("weird", 13, {0, 0, 0, 0});
  expect_parse_error(b.build(), {"weird", "unknown value type 13"});
  GgufBuilder nested;
  nested.raw("nested", 9, {9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  expect_parse_error(nested.build(), {"nested", "arrays of arrays"});
  GgufBuilder dup;
  dup.u32("k", 1).u32("k", 2);
  expect_parse_error(dup.build(), {"k", "duplicate key"});
  GgufBuilder align;
  align.u32("general.alignment", 24);
  expect_parse_error(align.build(), {"general.alignment", "power of two"});
}

TEST(GgufFile, RejectsBadTensorInfos) {
  GgufBuilder b = small_valid_file();
  b.find("second.weight").offset = 4096;
  b.find("second.weight").write_data = false;
  expect_parse_error(b.build(), {"second.weight", "past the end"});

  b = small_valid_file();
  b.find("second.weight").offset = 0;
  expect_parse_error(b.build(), {"second.weight", "overlaps tensor first.weight"});

  b = small_valid_file();
  b.find("second.weight").offset = 136;  // 128 + 8: inside the file but not aligned
  expect_parse_error(b.build(), {"second.weight", "not a multiple of the alignment 32"});

  b = small_valid_file();
  b.find("second.weight").type = 99;
  expect_parse_error(b.build(), {"second.weight", "unknown ggml tensor type id 99"});
  b.find("second.weight").type = 5;  // retired Q4_3
  expect_parse_error(b.build(), {"second.weight", "unknown ggml tensor type id 5"});

  b = small_valid_file();
  b.find("second.weight").type = 8;  // Q8_0: 64 elements are 2 blocks of 34 bytes, not 256 bytes
  b.find("second.weight").dims = {48};
  expect_parse_error(b.build(), {"second.weight", "not a multiple of Q8_0's block size 32"});

  b = small_valid_file();
  b.find("second.weight").dims = {1, 1, 1, 1, 64};
  expect_parse_error(b.build(), {"second.weight", "n_dims is 5"});
  b.find("second.weight").dims = {64, 0};
  expect_parse_error(b.build(), {"second.weight", "dimension 1 is 0"});
  b.find("second.weight").dims = {std::uint64_t{1} << 63};
  expect_parse_error(b.build(), {"second.weight", "dimension 0"});
  b.find("second.weight").dims = {std::uint64_t{1} << 40, std::uint64_t{1} << 40};
  expect_parse_error(b.build(), {"second.weight", "overflows"});
  b.find("second.weight").dims = {std::uint64_t{1} << 40};
  expect_parse_error(b.build(), {"second.weight", "past the end"});

  b = small_valid_file();
  b.find("second.weight").name = "first.weight";
  expect_parse_error(b.build(), {"first.weight", "duplicate tensor name"});
}

// --- tiny llama-family models written as GGUF ---

struct TinyDims {
  std::int64_t vocab = 16, hidden = 32, inter = 64, layers = 2, heads = 4, kv_heads = 2, head_dim = 8;
};

// HF-layout tensors with distinct values, and the GGUF an HF->GGUF converter would write for them.
struct TinyModel {
  std::map<std::string, at::Tensor> hf;  // by HF name, rows in rotate-half order
  GgufBuilder gguf;
};

// convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs.
at::Tensor llama_cpp_permute(const at::Tensor& w, std::int64_t heads) {
  std::vector<std::int64_t> split = {heads, 2, w.size(0) / heads / 2};
  split.insert(split.end(), w.sizes().begin() + 1, w.sizes().end());
  return w.reshape(split).transpose(1, 2).reshape(w.sizes()).contiguous();
}

TinyModel tiny_model(const std::string& arch, bool tied, const TinyDims& d = {}) {
  TinyModel m;
  const bool permute = arch == "llama" || arch == "mistral";
  std::int64_t next = 0;
  auto add = [&](const std::string& gguf, const std::string& hf, std::vector<std::int64_t> shape,
                 std::int64_t heads = 0) {
    const std::int64_t n = std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
    at::Tensor t = (at::arange(n, at::kFloat) + static_cast<float>(next)).reshape(shape) * 0.25f;
    next += n;
    m.hf[hf] = t;
    m.gguf.tensor(gguf, permute && heads > 0 ? llama_cpp_permute(t, heads) : t);
  };
  m.gguf.str("general.architecture", arch)
      .u32(arch + ".block_count", static_cast<std::uint32_t>(d.layers))
      .u32(arch + ".context_length", 128)
      .u32(arch + ".embedding_length", static_cast<std::uint32_t>(d.hidden))
      .u32(arch + ".feed_forward_length", static_cast<std::uint32_t>(d.inter))
      .u32(arch + ".attention.head_count", static_cast<std::uint32_t>(d.heads))
      .u32(arch + ".attention.head_count_kv", static_cast<std::uint32_t>(d.kv_heads))
      .u32(arch + ".rope.dimension_count", static_cast<std::uint32_t>(d.head_dim))
      .f32(arch + ".rope.freq_base", 50000.0f)
      .f32(arch + ".attention.layer_norm_rms_epsilon", 1e-6f)
      .u32("tokenizer.ggml.bos_token_id", 1)
      .u32("tokenizer.ggml.eos_token_id", 2)
      .strings("tokenizer.ggml.tokens", std::vector<std::string>(static_cast<std::size_t>(d.vocab), "t"));
  add("token_embd.weight", "model.embed_tokens.weight", {d.vocab, d.hidden});
  for (std::int64_t l = 0; l < d.layers; ++l) {
    const std::string g = "blk." + std::to_string(l) + ".", h = "model.layers." + std::to_string(l) + ".";
    add(g + "attn_norm.weight", h + "input_layernorm.weight", {d.hidden});
    add(g + "attn_q.weight", h + "self_attn.q_proj.weight", {d.heads * d.head_dim, d.hidden}, d.heads);
    add(g + "attn_k.weight", h + "self_attn.k_proj.weight", {d.kv_heads * d.head_dim, d.hidden}, d.kv_heads);
    add(g + "attn_v.weight", h + "self_attn.v_proj.weight", {d.kv_heads * d.head_dim, d.hidden});
    add(g + "attn_output.weight", h + "self_attn.o_proj.weight", {d.hidden, d.heads * d.head_dim});
    if (arch == "qwen2") {
      add(g + "attn_q.bias", h + "self_attn.q_proj.bias", {d.heads * d.head_dim});
      add(g + "attn_k.bias", h + "self_attn.k_proj.bias", {d.kv_heads * d.head_dim});
      add(g + "attn_v.bias", h + "self_attn.v_proj.bias", {d.kv_heads * d.head_dim});
    }
    if (arch == "qwen3") {
      add(g + "attn_q_norm.weight", h + "self_attn.q_norm.weight", {d.head_dim});
      add(g + "attn_k_norm.weight", h + "self_attn.k_norm.weight", {d.head_dim});
    }
    add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight", {d.hidden});
    add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight", {d.inter, d.hidden});
    add(g + "ffn_up.weight", h + "mlp.up_proj.weight", {d.inter, d.hidden});
    add(g + "ffn_down.weight", h + "mlp.down_proj.weight", {d.hidden, d.inter});
  }
  add("output_norm.weight", "model.norm.weight", {d.hidden});
  if (!tied) add("output.weight", "lm_head.weight", {d.vocab, d.hidden});
  return m;
}

void expect_tensors_equal(const LoadedCheckpoint& loaded, const std::map<std::string, at::Tensor>& hf) {
  EXPECT_EQ(loaded.tensors.size(), hf.size());
  for (const auto& [name, want] : hf) {
    SCOPED_TRACE(name);
    auto it = loaded.tensors.find(name);
    ASSERT_NE(it, loaded.tensors.end());
    EXPECT_EQ(it->second.sizes(), want.sizes());
    EXPECT_TRUE(it->second.to(at::kFloat).equal(want.to(it->second.scalar_type()).to(at::kFloat)));
  }
}

TEST(GgufCheckpoint, TinyLlamaRoundTripsWithQkUnpermuted) {
  TempDir dir;
  TinyModel m = tiny_model("llama", /*tied=*/false);
  // Store one projection as F16 and the embedding as Q8_0 (d = 0.25, q = element index - 64).
  const std::string up = "blk.1.ffn_up.weight";
  m.gguf.find(up).data = tensor_bytes(m.hf["model.layers.1.mlp.up_proj.weight"].to(at::kHalf));
  m.gguf.find(up).type = 1;
  m.hf["model.layers.1.mlp.up_proj.weight"] = m.hf["model.layers.1.mlp.up_proj.weight"].to(at::kHalf).to(at::kFloat);
  RawTensor& embd = m.gguf.find("token_embd.weight");
  embd.type = 8;
  embd.data.clear();
  std::vector<float> embed_values;
  for (int block = 0; block < 16; ++block) {
    embd.data.push_back(0x00);  // f16 0.25 = 0x3400, little-endian
    embd.data.push_back(0x34);
    for (int j = 0; j < 32; ++j) {
      const int q = (block * 32 + j) % 256 - 128;
      embd.data.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(q)));
      embed_values.push_back(0.25f * static_cast<float>(q));
    }
  }
  m.hf["model.embed_tokens.weight"] = at::tensor(embed_values).reshape({16, 32});
  const std::string path = dir.file("tiny_llama.gguf");
  write_bytes(path, m.gguf.build());

  const LoadedCheckpoint loaded = load_gguf_checkpoint(path, at::kFloat);
  EXPECT_EQ(loaded.format, "gguf");
  EXPECT_EQ(loaded.source, path);
  const ModelConfig& c = loaded.config;
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.vocab_size, 16);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.intermediate_size, 64);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.max_position_embeddings, 128);
  EXPECT_DOUBLE_EQ(c.rope_theta, 50000.0);
  EXPECT_NEAR(c.rms_norm_eps, 1e-6, 1e-12);
  EXPECT_EQ(c.rope_scaling.type, "default");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  expect_tensors_equal(loaded, m.hf);
  for (const auto& [name, t] : loaded.tensors) {
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    EXPECT_TRUE(t.is_contiguous()) << name;
  }

  const LoadedCheckpoint half = load_gguf_checkpoint(path, at::kBFloat16);
  for (const auto& [name, t] : half.tensors) EXPECT_EQ(t.scalar_type(), at::kBFloat16) << name;
  expect_tensors_equal(half, m.hf);
}

TEST(GgufCheckpoint, TiedQwen2WithBiasIsNotPermuted) {
  TempDir dir;
  const TinyModel m = tiny_model("qwen2", /*tied=*/true);
  const std::string path = dir.file("tiny_qwen2.gguf");
  write_bytes(path, m.gguf.build());
  const LoadedCheckpoint loaded = load_gguf_checkpoint(path, at::kHalf);
  EXPECT_EQ(loaded.config.architecture, "qwen2");
  EXPECT_TRUE(loaded.config.tie_word_embeddings);
  EXPECT_TRUE(loaded.config.attention_bias);
  EXPECT_EQ(loaded.tensors.count("lm_head.weight"), 0u);
  expect_tensors_equal(loaded, m.hf);
}

TEST(GgufCheckpoint, Qwen3HasQkNorm) {
  TempDir dir;
  const TinyModel m = tiny_model("qwen3", /*tied=*/true);
  const std::string path = dir.file("tiny_qwen3.gguf");
  write_bytes(path, m.gguf.build());
  const LoadedCheckpoint loaded = load_gguf_checkpoint(path, at::kFloat);
  EXPECT_TRUE(loaded.config.qk_norm);
  EXPECT_FALSE(loaded.config.attention_bias);
  expect_tensors_equal(loaded, m.hf);
}

TEST(GgufCheckpoint, DerivesLlama3RopeScalingFromRopeFreqs) {
  TempDir dir;
  TinyDims d;
  d.head_dim = 64;  // enough frequencies to span all three Llama-3 bands
  d.hidden = 64;
  d.heads = 1;
  d.kv_heads = 1;
  TinyModel m = tiny_model("llama", /*tied=*/true, d);
  // convert_hf_to_gguf.py's Llama-3 divisors for factor 8, theta 50000.
  std::vector<float> divisors;
  for (int i = 0; i < 32; ++i) {
    const double wavelen = 2 * 3.14159265358979323846 * std::pow(50000.0, 2.0 * i / 64);
    const double smooth = (8192 / wavelen - 1) / 3;
    divisors.push_back(wavelen < 2048 ? 1.0f : wavelen > 8192 ? 8.0f : static_cast<float>(1 / ((1 - smooth) / 8 + smooth)));
  }
  m.gguf.tensor("rope_freqs.weight", at::tensor(divisors));
  const std::string path = dir.file("tiny_llama3.gguf");
  write_bytes(path, m.gguf.build());
  const LoadedCheckpoint loaded = load_gguf_checkpoint(path, at::kFloat);
  EXPECT_EQ(loaded.config.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(loaded.config.rope_scaling.factor, 8.0);
  EXPECT_EQ(loaded.tensors.count("rope_freqs.weight"), 0u);

  divisors[5] *= 1.5f;
  m.gguf.find("rope_freqs.weight").data = tensor_bytes(at::tensor(divisors));
  write_bytes(path, m.gguf.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); }, {path, "rope_freqs.weight", "divisor 5"});
}

TEST(GgufCheckpoint, RejectsMissingMisshapenAndExtraTensors) {
  TempDir dir;
  const std::string path = dir.file("broken.gguf");

  TinyModel m = tiny_model("llama", true);
  m.gguf.remove("blk.1.attn_v.weight");
  write_bytes(path, m.gguf.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); }, {path, "blk.1.attn_v.weight", "missing"});

  m = tiny_model("llama", true);
  m.gguf.find("blk.1.attn_k.weight").dims = {32, 32};  // [kv_heads * head_dim = 16, 32] expected
  m.gguf.find("blk.1.attn_k.weight").data.resize(32 * 32 * 4);
  write_bytes(path, m.gguf.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); },
               {path, "blk.1.attn_k.weight", "shape [32, 32] expected [16, 32]"});

  m = tiny_model("llama", true);
  m.gguf.tensor("blk.2.attn_q.weight", at::ones({32, 32}, at::kFloat));
  write_bytes(path, m.gguf.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); }, {path, "blk.2.attn_q.weight", "unexpected tensor"});

  GgufBuilder gpt2;
  gpt2.str("general.architecture", "gpt2");
  write_bytes(path, gpt2.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); }, {path, "general.architecture", "gpt2"});

  GgufBuilder no_dims;
  no_dims.str("general.architecture", "llama");
  write_bytes(path, no_dims.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); }, {path, "llama.embedding_length", "missing"});

  expect_error([&] { load_gguf_checkpoint(dir.file("absent.gguf"), at::kFloat); }, {"absent.gguf"});
}

TEST(GgufCheckpoint, RejectsUnsupportedTensorType) {
  TempDir dir;
  const std::string path = dir.file("q2k.gguf");
  TinyDims d;
  d.hidden = 256;
  d.heads = 32;
  d.kv_heads = 32;
  TinyModel m = tiny_model("llama", true, d);
  RawTensor& up = m.gguf.find("blk.0.ffn_up.weight");  // [64, 256]: one Q2_K block per row
  up.type = 10;
  up.data.assign(64 * 84, 0);
  write_bytes(path, m.gguf.build());
  expect_error([&] { load_gguf_checkpoint(path, at::kFloat); },
               {path, "blk.0.ffn_up.weight", "Q2_K is not supported", "Q6_K"});
}

// --- the default SmolLM2 GGUF vs transformers' reading of it ---

TEST(GgufCheckpoint, SmolLM2MatchesTransformers) {
  const std::string model = test::default_model();
  KVBOUND_REQUIRE_FILE(model);
  const LoadedCheckpoint loaded = load_gguf_checkpoint(model, at::kFloat);
  const ModelConfig& c = loaded.config;
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_theta, 100000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);
  EXPECT_EQ(loaded.tensors.size(), 2u + 30u * 9u);
  for (const char* proj : {"q", "k", "v"}) {
    SCOPED_TRACE(proj);
    const std::string golden = test::test_data(std::string("gguf_quant/smollm2_layer0_") + proj + "_proj.f32");
    ASSERT_TRUE(fs::exists(golden)) << "missing " << golden << " (ctest fixture golden.gguf_quant)";
    const std::vector<float> want = read_f32(golden);
    const at::Tensor got = loaded.tensors.at(std::string("model.layers.0.self_attn.") + proj + "_proj.weight");
    ASSERT_EQ(got.numel(), static_cast<std::int64_t>(want.size()));
    const at::Tensor expected = at::from_blob(const_cast<float*>(want.data()), got.sizes(), at::kFloat);
    EXPECT_EQ((got - expected).abs().max().item<float>(), 0.0f);
  }
}

}  // namespace
}  // namespace kvbound
