// Token datasets: splitting .txt/.jsonl into documents, the HDF5 round trip (ids, offsets, attributes,
// across chunk boundaries), atomic writes, refusing another tokenizer, one-line errors naming the file and
// field for every kind of damaged file, and `kvbound prepare` run as a user would.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "base/errors.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "test_env.h"

using namespace kvbound;
namespace fs = std::filesystem;
using Ids = std::vector<std::int64_t>;

namespace {

// A tokenizer that only has to differ in identity: the dataset never calls encode.
class NamedTokenizer : public Tokenizer {
 public:
  explicit NamedTokenizer(std::string identity) : identity_(std::move(identity)) {}
  std::vector<std::int64_t> encode(std::string_view, bool) const override { return {}; }
  std::string decode(const std::vector<std::int64_t>&) const override { return {}; }
  std::int64_t vocab_size() const override { return 512; }
  std::int64_t bos_id() const override { return 1; }
  std::int64_t eos_id() const override { return 2; }
  std::string identity() const override { return identity_; }

 private:
  std::string identity_;
};

fs::path scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(::testing::TempDir()) /
                       ("kvbound_token_dataset_" + std::string(info->test_suite_name()) + "_" + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  return path.string();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> folder_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Expects `action` to throw a one-line kvbound::Error starting "FILE: FIELD" and mentioning `words`.
template <typename Action>
void expect_error(Action action, const std::string& file, const std::string& field, const std::string& words) {
  try {
    action();
    ADD_FAILURE() << "no error; expected one on " << file << ": " << field;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.rfind(field.empty() ? file + ": " : file + ": " + field + ": ", 0), 0u) << message;
    EXPECT_NE(message.find(words), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TokenDatasetInfo sample_info() {
  TokenDatasetInfo info = TokenDatasetInfo::for_tokenizer(NamedTokenizer("fake:a"), "/models/a/tok.bin");
  info.source_files = {"/data/one.txt", "/data/two.jsonl"};
  info.created_by = "test_token_dataset";
  return info;
}

// Two documents around a one-id document (the largest id), across the 65536-id chunk boundary twice.
std::vector<Ids> sample_documents() {
  std::vector<Ids> documents = {Ids(70000), Ids(1), Ids(65536 * 2 - 70000 + 5)};
  for (std::size_t d = 0; d < documents.size(); ++d)
    for (std::size_t i = 0; i < documents[d].size(); ++i) documents[d][i] = static_cast<std::int64_t>((i * 7 + d) % 512);
  documents[1][0] = 511;
  return documents;
}

std::string write_sample(const fs::path& dir, const std::string& name = "data.h5") {
  const std::string path = (dir / name).string();
  write_token_dataset(path, sample_documents(), sample_info());
  return path;
}

Ids widen(const std::vector<std::int32_t>& ids) { return Ids(ids.begin(), ids.end()); }

// ---- direct HDF5 edits that damage a valid file ----

struct H5Id {
  hid_t id;
  herr_t (*close)(hid_t);
  ~H5Id() {
    if (id >= 0) close(id);
  }
};

void overwrite_ids(const std::string& path, const char* dataset, hsize_t at, const std::vector<std::int64_t>& values) {
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
  ASSERT_GE(file.id, 0);
  H5Id data{H5Dopen2(file.id, dataset, H5P_DEFAULT), H5Dclose};
  H5Id file_space{H5Dget_space(data.id), H5Sclose};
  const hsize_t count = values.size();
  ASSERT_GE(H5Sselect_hyperslab(file_space.id, H5S_SELECT_SET, &at, nullptr, &count, nullptr), 0);
  H5Id memory_space{H5Screate_simple(1, &count, nullptr), H5Sclose};
  ASSERT_GE(H5Dwrite(data.id, H5T_NATIVE_INT64, memory_space.id, file_space.id, H5P_DEFAULT, values.data()), 0);
}

void delete_link(const std::string& path, const char* name) {
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
  ASSERT_GE(H5Ldelete(file.id, name, H5P_DEFAULT), 0);
}

void replace_string_attribute(const std::string& path, const char* name, const std::string& value) {
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
  ASSERT_GE(H5Adelete(file.id, name), 0);
  H5Id type{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(type.id, value.size());  // fixed-length, as other writers (h5py's np.bytes_) store strings
  H5Id space{H5Screate(H5S_SCALAR), H5Sclose};
  H5Id attribute{H5Acreate2(file.id, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose};
  ASSERT_GE(H5Awrite(attribute.id, type.id, value.data()), 0);
}

void replace_int_attribute(const std::string& path, const char* name, std::int64_t value) {
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
  H5Id attribute{H5Aopen(file.id, name, H5P_DEFAULT), H5Aclose};
  ASSERT_GE(H5Awrite(attribute.id, H5T_NATIVE_INT64, &value), 0);
}

// Replaces dataset `name` by one of `type` and `dims` (zeros).
void replace_dataset(const std::string& path, const char* name, hid_t type, const std::vector<hsize_t>& dims) {
  delete_link(path, name);
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
  H5Id space{H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose};
  H5Id data{H5Dcreate2(file.id, name, type, space.id, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose};
  ASSERT_GE(data.id, 0);
}

// File offset of the first stored chunk of /tokens.
haddr_t first_chunk_address(const std::string& path) {
  H5Id file{H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose};
  H5Id data{H5Dopen2(file.id, "tokens", H5P_DEFAULT), H5Dclose};
  H5Id space{H5Dget_space(data.id), H5Sclose};
  hsize_t offset = 0, size = 0;
  unsigned filters = 0;
  haddr_t address = HADDR_UNDEF;
  H5Dget_chunk_info(data.id, space.id, 0, &offset, &filters, &address, &size);
  return address;
}

// ---- documents ----

TEST(Documents, TxtSplitsOnSeparatorLines) {
  const fs::path dir = scratch_dir();
  const std::string path = write_file(dir / "stories.txt",
                                      "One day, Lily.\nShe smiled.\n<|endoftext|>\n"
                                      "\n  \n<|endoftext|>\r\n"                      // blank document: skipped
                                      "Tom ran. <|endoftext|> stays\n<|endoftext|> \n"  // not separator lines
                                      "<|endoftext|>\n  The end.  ");
  EXPECT_EQ(read_documents(path, {}), (std::vector<std::string>{"One day, Lily.\nShe smiled.",
                                                                 "Tom ran. <|endoftext|> stays\n<|endoftext|>",
                                                                 "The end."}));
  const std::string book = write_file(dir / "Book.TXT", "\nChapter 1\n\nIt was a dark night.\n");
  EXPECT_EQ(read_documents(book, {}), (std::vector<std::string>{"Chapter 1\n\nIt was a dark night."}));
  DocumentFormat chapters;
  chapters.separator = "***";
  EXPECT_EQ(read_documents(write_file(dir / "c.txt", "a\n***\nb\n"), chapters), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(read_documents(write_file(dir / "empty.txt", "\n<|endoftext|>\n"), {}).empty());
  chapters.separator = "";
  expect_error([&] { read_documents(book, chapters); }, book, "separator", "empty separator");
}

TEST(Documents, JsonlIsOneDocumentPerLine) {
  const fs::path dir = scratch_dir();
  const std::string path = write_file(dir / "rows.jsonl",
                                      "{\"text\": \"  first\\nrow \", \"id\": 1}\n"
                                      "\n"                                 // blank line: skipped
                                      "{\"text\": \"   \"}\n"              // whitespace-only: skipped
                                      "{\"text\": \"caf\\u00e9\", \"story\": \"other\"}\r\n");
  EXPECT_EQ(read_documents(path, {}), (std::vector<std::string>{"  first\nrow ", "caf\xc3\xa9"}));
  DocumentFormat story;
  story.jsonl_field = "story";
  const std::string stories = write_file(dir / "s.jsonl", "{\"story\": \"a\"}\n{\"story\": \"b\"}");
  EXPECT_EQ(read_documents(stories, story), (std::vector<std::string>{"a", "b"}));
}

TEST(Documents, BadJsonlLinesNameTheLine) {
  const fs::path dir = scratch_dir();
  const std::string broken = write_file(dir / "broken.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"unterminated}\n");
  expect_error([&] { read_documents(broken, {}); }, broken, "line 3", "invalid JSON");
  const std::string missing = write_file(dir / "missing.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  expect_error([&] { read_documents(missing, {}); }, missing, "line 2: text", "missing");
  const std::string number = write_file(dir / "number.jsonl", "{\"text\": 7}\n");
  expect_error([&] { read_documents(number, {}); }, number, "line 1: text", "expected a string, found number");
  const std::string array = write_file(dir / "array.jsonl", "[\"text\"]\n");
  expect_error([&] { read_documents(array, {}); }, array, "line 1", "expected a JSON object");
}

TEST(Documents, OnlyExistingTxtAndJsonlFiles) {
  const fs::path dir = scratch_dir();
  const std::string csv = write_file(dir / "table.csv", "a,b\n");
  expect_error([&] { read_documents(csv, {}); }, csv, "", "unknown input type '.csv'");
  const std::string nothing = (dir / "nothing.txt").string();
  expect_error([&] { read_documents(nothing, {}); }, nothing, "", "no such file");
  fs::create_directories(dir / "folder.txt");
  expect_error([&] { read_documents((dir / "folder.txt").string(), {}); }, (dir / "folder.txt").string(), "",
               "not a regular file");
}

// ---- round trip ----

TEST(TokenDataset, RoundTripsIdsOffsetsAndAttributes) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  const std::vector<Ids> documents = sample_documents();
  const TokenDataset data = TokenDataset::open(path, nullptr);
  ASSERT_EQ(data.num_docs(), 3);
  EXPECT_EQ(data.num_tokens(), 65536 * 2 + 6);
  EXPECT_EQ(data.doc_offsets(), (std::vector<std::int64_t>{0, 70000, 70001, 65536 * 2 + 6}));
  for (std::int64_t d = 0; d < 3; ++d) EXPECT_EQ(widen(data.document(d)), documents[d]) << "document " << d;
  // A read across both document boundaries and the chunk boundary at 65536.
  const Ids across = widen(data.tokens(65530, 4480));
  Ids expected(documents[0].begin() + 65530, documents[0].end());
  expected.insert(expected.end(), documents[1].begin(), documents[1].end());
  expected.insert(expected.end(), documents[2].begin(), documents[2].begin() + 9);
  EXPECT_EQ(across, expected);
  EXPECT_TRUE(data.tokens(data.num_tokens(), 0).empty());

  EXPECT_EQ(data.format_version(), 1);
  EXPECT_EQ(data.info(), sample_info());
  EXPECT_EQ(data.tokenizer_identity(), "fake:a");
  EXPECT_EQ(data.vocab_size(), 512);
  EXPECT_EQ(data.bos_id(), 1);
  EXPECT_EQ(data.eos_id(), 2);
  EXPECT_EQ(data.info().source_files, (std::vector<std::string>{"/data/one.txt", "/data/two.jsonl"}));
  EXPECT_EQ(folder_entries(dir), std::vector<std::string>{"data.h5"});  // no temporary file left

  expect_error([&] { data.document(3); }, path, "/doc_offsets", "document 3 is outside [0, 3)");
  expect_error([&] { data.tokens(131070, 10); }, path, "/tokens", "cannot read 10 ids from position 131070");
}

TEST(TokenDataset, EmptyDatasetAndMovedReader) {
  const fs::path dir = scratch_dir();
  const std::string path = (dir / "empty.h5").string();
  write_token_dataset(path, {}, sample_info());
  TokenDataset data = TokenDataset::open(path, nullptr);
  EXPECT_EQ(data.num_docs(), 0);
  EXPECT_EQ(data.num_tokens(), 0);
  data = TokenDataset::open(write_sample(dir), nullptr);
  EXPECT_EQ(data.document(1), std::vector<std::int32_t>{511});
}

TEST(TokenDataset, ReplacesAtomicallyAndLeavesNothingOnFailure) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  const std::string before = read_bytes(path);
  {
    TokenDatasetWriter writer(path, sample_info());
    writer.append_document({1, 2, 3});
    EXPECT_EQ(read_bytes(path), before);  // readers see the old file until commit
    EXPECT_EQ(folder_entries(dir).size(), 2u);
    writer.commit();
  }
  EXPECT_EQ(TokenDataset::open(path, nullptr).num_tokens(), 3);
  EXPECT_EQ(folder_entries(dir), std::vector<std::string>{"data.h5"});

  {
    TokenDatasetWriter writer((dir / "never.h5").string(), sample_info());
    writer.append_document({5, 6});
    expect_error([&] { writer.append_document({7, 512}); }, (dir / "never.h5").string(), "/tokens",
                 "document 1 has id 512, outside [0, vocab_size 512)");
    expect_error([&] { writer.append_document({}); }, (dir / "never.h5").string(), "/doc_offsets",
                 "document 1 has no ids");
  }  // destroyed without commit
  EXPECT_EQ(folder_entries(dir), std::vector<std::string>{"data.h5"});

  TokenDatasetInfo bad = sample_info();
  bad.eos_id = 512;
  expect_error([&] { TokenDatasetWriter writer((dir / "bad.h5").string(), bad); }, (dir / "bad.h5").string(), "eos_id",
               "outside [-1, 512)");
  EXPECT_EQ(folder_entries(dir), std::vector<std::string>{"data.h5"});
}

TEST(TokenDataset, RefusesAnotherTokenizer) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  const NamedTokenizer same("fake:a"), other("fake:b");
  EXPECT_NO_THROW(TokenDataset::open(path, &same));
  expect_error([&] { TokenDataset::open(path, &other, "/models/b/tok.bin"); }, path, "tokenizer_identity",
               "made with fake:a (/models/a/tok.bin) but the tokenizer in use is fake:b (/models/b/tok.bin)");
}

// ---- damaged files ----

TEST(TokenDatasetErrors, NotAnHdf5File) {
  const fs::path dir = scratch_dir();
  const std::string text = write_file(dir / "data.h5", "this is plain text, not HDF5\n");
  expect_error([&] { TokenDataset::open(text, nullptr); }, text, "", "not a readable HDF5 file");
  const std::string empty = write_file(dir / "empty.h5", "");
  expect_error([&] { TokenDataset::open(empty, nullptr); }, empty, "", "not a readable HDF5 file");
  expect_error([&] { TokenDataset::open((dir / "absent.h5").string(), nullptr); }, (dir / "absent.h5").string(), "",
               "no such file (token datasets are written by `kvbound prepare`)");
}

TEST(TokenDatasetErrors, TruncatedFile) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  for (const double keep : {0.5, 0.99}) {
    const std::string bytes = read_bytes(path);
    const std::string truncated =
        write_file(dir / "truncated.h5", bytes.substr(0, static_cast<std::size_t>(keep * bytes.size())));
    expect_error([&] { TokenDataset::open(truncated, nullptr); }, truncated, "", "not a readable HDF5 file");
  }
}

TEST(TokenDatasetErrors, CorruptedChunkIsAnErrorNotGarbage) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  const haddr_t chunk = first_chunk_address(path);
  ASSERT_NE(chunk, HADDR_UNDEF);
  std::string bytes = read_bytes(path);
  for (std::size_t i = chunk + 16; i < chunk + 48; ++i) bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
  write_file(path, bytes);
  const TokenDataset data = TokenDataset::open(path, nullptr);  // metadata intact
  expect_error([&] { data.document(0); }, path, "/tokens", "cannot read ids [0, 70000)");
}

TEST(TokenDatasetErrors, MissingDatasets) {
  const fs::path dir = scratch_dir();
  const std::string no_tokens = write_sample(dir, "no_tokens.h5");
  delete_link(no_tokens, "tokens");
  expect_error([&] { TokenDataset::open(no_tokens, nullptr); }, no_tokens, "/tokens", "missing dataset");
  const std::string no_offsets = write_sample(dir, "no_offsets.h5");
  delete_link(no_offsets, "doc_offsets");
  expect_error([&] { TokenDataset::open(no_offsets, nullptr); }, no_offsets, "/doc_offsets", "missing dataset");
}

TEST(TokenDatasetErrors, WrongTokenTypeOrRank) {
  const fs::path dir = scratch_dir();
  const std::string floats = write_sample(dir, "floats.h5");
  replace_dataset(floats, "tokens", H5T_IEEE_F32LE, {131078});
  expect_error([&] { TokenDataset::open(floats, nullptr); }, floats, "/tokens", "expected integers of at most 32 bits");
  const std::string wide = write_sample(dir, "wide.h5");
  replace_dataset(wide, "tokens", H5T_STD_I64LE, {131078});
  expect_error([&] { TokenDataset::open(wide, nullptr); }, wide, "/tokens", "expected integers of at most 32 bits");
  const std::string matrix = write_sample(dir, "matrix.h5");
  replace_dataset(matrix, "tokens", H5T_STD_I32LE, {2, 65539});
  expect_error([&] { TokenDataset::open(matrix, nullptr); }, matrix, "/tokens", "expected 1 dimension, found 2");
}

TEST(TokenDatasetErrors, DocOffsetsMustStartAtZeroRiseAndEndAtTheTokenCount) {
  const fs::path dir = scratch_dir();
  const std::string decreasing = write_sample(dir, "decreasing.h5");
  overwrite_ids(decreasing, "doc_offsets", 1, {70002});  // 0, 70002, 70001, ...
  expect_error([&] { TokenDataset::open(decreasing, nullptr); }, decreasing, "/doc_offsets",
               "does not increase at entry 2 (70002 then 70001; documents are never empty)");
  const std::string empty_document = write_sample(dir, "empty_document.h5");
  overwrite_ids(empty_document, "doc_offsets", 2, {70000});  // 0, 70000, 70000, ...
  expect_error([&] { TokenDataset::open(empty_document, nullptr); }, empty_document, "/doc_offsets",
               "does not increase at entry 2 (70000 then 70000");
  const std::string short_end = write_sample(dir, "short_end.h5");
  overwrite_ids(short_end, "doc_offsets", 3, {131077});
  expect_error([&] { TokenDataset::open(short_end, nullptr); }, short_end, "/doc_offsets",
               "ends at 131077 but /tokens holds 131078 ids");
  const std::string too_many = write_sample(dir, "too_many.h5");
  replace_dataset(too_many, "doc_offsets", H5T_STD_I64LE, {131080});
  expect_error([&] { TokenDataset::open(too_many, nullptr); }, too_many, "/doc_offsets",
               "131080 entries for 131078 ids");
  const std::string late_start = write_sample(dir, "late_start.h5");
  overwrite_ids(late_start, "doc_offsets", 0, {5});
  expect_error([&] { TokenDataset::open(late_start, nullptr); }, late_start, "/doc_offsets", "starts at 5, expected 0");
}

TEST(TokenDatasetErrors, TokenIdOutOfRangeIsCaughtWhenRead) {
  const fs::path dir = scratch_dir();
  const std::string path = write_sample(dir);
  overwrite_ids(path, "tokens", 70000, {9999});  // document 1
  {
    const TokenDataset data = TokenDataset::open(path, nullptr);
    EXPECT_NO_THROW(data.document(0));
    expect_error([&] { data.document(1); }, path, "/tokens",
                 "id 9999 at position 70000 is outside [0, vocab_size 512)");
  }
  overwrite_ids(path, "tokens", 70000, {-3});
  expect_error([&] { TokenDataset::open(path, nullptr).tokens(69999, 2); }, path, "/tokens", "id -3 at position 70000");
}

TEST(TokenDatasetErrors, WrongOrMissingAttributes) {
  const fs::path dir = scratch_dir();
  const std::string format = write_sample(dir, "format.h5");
  replace_string_attribute(format, "format", "kvbound-checkpoint");
  expect_error([&] { TokenDataset::open(format, nullptr); }, format, "format",
               "'kvbound-checkpoint' is not a token dataset (expected 'kvbound-tokens')");
  const std::string version = write_sample(dir, "version.h5");
  replace_int_attribute(version, "format_version", 2);
  expect_error([&] { TokenDataset::open(version, nullptr); }, version, "format_version", "version 2 is not supported");
  const std::string vocab = write_sample(dir, "vocab.h5");
  replace_int_attribute(vocab, "vocab_size", 0);
  expect_error([&] { TokenDataset::open(vocab, nullptr); }, vocab, "vocab_size", "0 is outside [1, 2^31]");
  const std::string typed = write_sample(dir, "typed.h5");
  replace_string_attribute(typed, "vocab_size", "512");
  expect_error([&] { TokenDataset::open(typed, nullptr); }, typed, "vocab_size", "expected a single integer");
  const std::string identity = write_sample(dir, "identity.h5");
  {
    H5Id file{H5Fopen(identity.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose};
    ASSERT_GE(H5Adelete(file.id, "tokenizer_identity"), 0);
  }
  expect_error([&] { TokenDataset::open(identity, nullptr); }, identity, "tokenizer_identity", "missing attribute");

  // Some other HDF5 file: no format attribute at all.
  const std::string other = (dir / "other.h5").string();
  H5Fclose(H5Fcreate(other.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  expect_error([&] { TokenDataset::open(other, nullptr); }, other, "format", "missing attribute");
}

// ---- the CLI ----

struct CliRun {
  int code;
  std::string out, err;
};

CliRun run_kvbound(const std::string& args, const fs::path& dir) {
  const fs::path err_file = dir / "stderr.log";
  const std::string command = test::kvbound_bin() + " " + args + " 2>'" + err_file.string() + "'";
  CliRun r{};
  FILE* pipe = ::popen(command.c_str(), "r");
  char buffer[4096];
  std::size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) r.out.append(buffer, n);
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_bytes(err_file.string());
  fs::remove(err_file);
  return r;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

const char* kStories =
    "Once upon a time, there was a cat.\nThe cat was happy.\n<|endoftext|>\n"
    "Tom had a red ball.\n<|endoftext|>\n"
    "The sun was big and warm. Lily smiled.";

TEST(PrepareCli, TokenisesTextIntoADatasetTheTokenizerAccepts) {
  const std::string tok512 = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok512);
  const fs::path dir = scratch_dir();
  const std::string input = write_file(dir / "stories,1.txt", kStories);  // a comma must not split the name
  const std::string output = (dir / "out" / "stories.h5").string();
  const CliRun r = run_kvbound("prepare --tokenizer " + quote(tok512) + " --output " + quote(output) + " " +
                                   quote(input) + " --threads 2",
                               dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("3 documents"), std::string::npos) << r.err;

  const auto tokenizer = load_tokenizer(tok512);
  const TokenDataset data = TokenDataset::open(output, tokenizer.get(), tok512);
  ASSERT_EQ(data.num_docs(), 3);
  const Ids first = tokenizer->encode("Once upon a time, there was a cat.\nThe cat was happy.", false);
  const Ids second = tokenizer->encode("Tom had a red ball.", false);
  const Ids third = tokenizer->encode("The sun was big and warm. Lily smiled.", false);
  EXPECT_EQ(widen(data.document(0)), first);
  EXPECT_EQ(widen(data.document(1)), second);
  EXPECT_EQ(widen(data.document(2)), third);
  EXPECT_EQ(data.num_tokens(), static_cast<std::int64_t>(first.size() + second.size() + third.size()));
  EXPECT_EQ(data.tokenizer_identity(), tokenizer->identity());
  EXPECT_EQ(data.info().tokenizer_path, tok512);
  EXPECT_EQ(data.info().source_files, std::vector<std::string>{input});
  EXPECT_FALSE(data.info().eos_appended);

  // A model folder names its tokenizer; --add-eos ends every document with EOS.
  const std::string with_eos = (dir / "eos.h5").string();
  const CliRun eos = run_kvbound("prepare --add-eos --tokenizer " + quote(test::asset("stories260K")) +
                                     " --output " + quote(with_eos) + " --input " + quote(input),
                                 dir);
  ASSERT_EQ(eos.code, 0) << eos.err;
  const TokenDataset ended = TokenDataset::open(with_eos, tokenizer.get());
  EXPECT_TRUE(ended.info().eos_appended);
  Ids second_with_eos = second;
  second_with_eos.push_back(tokenizer->eos_id());
  EXPECT_EQ(widen(ended.document(1)), second_with_eos);
  EXPECT_EQ(ended.num_tokens(), data.num_tokens() + 3);
}

TEST(PrepareCli, RefusesToOverwriteUnlessForced) {
  const std::string tok512 = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok512);
  const fs::path dir = scratch_dir();
  const std::string input = write_file(dir / "in.txt", kStories);
  const std::string output = write_file(dir / "data.h5", "precious");
  const std::string args = "prepare --tokenizer " + quote(tok512) + " --output " + quote(output) + " " + quote(input);
  const CliRun refused = run_kvbound(args, dir);
  EXPECT_NE(refused.code, 0);
  EXPECT_EQ(refused.err, "kvbound prepare: error: " + output + ": already exists (pass --force to replace it)\n");
  EXPECT_EQ(read_bytes(output), "precious");
  const CliRun forced = run_kvbound(args + " --force", dir);
  ASSERT_EQ(forced.code, 0) << forced.err;
  EXPECT_EQ(TokenDataset::open(output, nullptr).num_docs(), 3);
}

TEST(PrepareCli, AFailedRunLeavesNoOutput) {
  const std::string tok512 = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok512);
  const fs::path dir = scratch_dir();
  const std::string good = write_file(dir / "good.txt", kStories);
  const std::string bad = write_file(dir / "bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": oops}\n");
  const std::string output = (dir / "data.h5").string();
  const auto files_before = folder_entries(dir);
  const CliRun r = run_kvbound("prepare --tokenizer " + quote(tok512) + " --output " + quote(output) + " " +
                                   quote(good) + " " + quote(bad),
                               dir);
  EXPECT_NE(r.code, 0);
  // Progress lines for good.txt come first; the error is the last line.
  EXPECT_NE(r.err.find("\nkvbound prepare: error: " + bad + ": line 2: invalid JSON (column 10"), std::string::npos)
      << r.err;
  EXPECT_EQ(folder_entries(dir), files_before);  // neither data.h5 nor a temporary file

  for (const std::string& args :
       {"prepare --output " + quote(output) + " " + quote(good),                              // no --tokenizer
        "prepare --tokenizer " + quote(tok512) + " " + quote(good),                           // no --output
        "prepare --tokenizer " + quote(tok512) + " --output " + quote(output),                // no input
        "prepare --tokenizer " + quote(tok512) + " --output " + quote(output) + " missing.txt",
        "prepare --tokenizer " + quote(good) + " --output " + quote(output) + " " + quote(good)}) {
    const CliRun failed = run_kvbound(args, dir);
    EXPECT_NE(failed.code, 0) << args;
    EXPECT_EQ(failed.err.find('\n'), failed.err.size() - 1) << args << ": " << failed.err;
    EXPECT_EQ(folder_entries(dir), files_before) << args;
  }
}

}  // namespace
