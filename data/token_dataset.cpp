// Document splitting and the HDF5 token dataset (see token_dataset.h for the layout).
#include "data/token_dataset.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "base/errors.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

constexpr hsize_t kTokenChunk = 1 << 16;    // ids per chunk: 256 KiB, a document or a batch reads few chunks
constexpr hsize_t kOffsetChunk = 1 << 14;   // doc_offsets are read whole at open; the chunk only enables deflate
constexpr unsigned kDeflateLevel = 4;      // near level 9's size at a fraction of its time on token ids
constexpr std::int64_t kMaxVocab = std::int64_t{1} << 31;  // ids are stored as int32

std::string lowercase_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  return ext;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

bool is_blank(const std::string& s) { return std::all_of(s.begin(), s.end(), is_space); }

std::string strip(const std::string& s) {
  std::size_t begin = 0, end = s.size();
  while (begin < end && is_space(s[begin])) ++begin;
  while (end > begin && is_space(s[end - 1])) --end;
  return s.substr(begin, end - begin);
}

std::ifstream open_input(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "", std::string("cannot open: ") + std::strerror(errno));
  return in;
}

void check_not_bad(const std::ifstream& in, const std::string& path) {
  if (in.bad()) fail(path, "", std::string("read error: ") + std::strerror(errno));
}

void text_documents(const std::string& path, const std::string& separator,
                    const std::function<void(std::string&&)>& visit) {
  std::ifstream in = open_input(path);
  std::string document, line;
  auto finish_document = [&] {
    std::string text = strip(document);
    document.clear();
    if (!text.empty()) visit(std::move(text));
  };
  while (std::getline(in, line)) {
    const std::size_t length = !line.empty() && line.back() == '\r' ? line.size() - 1 : line.size();
    if (std::string_view(line).substr(0, length) == separator) {
      finish_document();
    } else {
      document += line;
      document += '\n';
    }
  }
  check_not_bad(in, path);
  finish_document();
}

void jsonl_documents(const std::string& path, const std::string& field,
                     const std::function<void(std::string&&)>& visit) {
  std::ifstream in = open_input(path);
  std::string line;
  for (std::int64_t line_number = 1; std::getline(in, line); ++line_number) {
    if (is_blank(line)) continue;
    const std::string where = "line " + std::to_string(line_number);
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      // e.what() reads "[json.exception.parse_error.101] parse error at line 1, column 7: ..."; keep the column part.
      const std::string what = e.what();
      const std::size_t column = what.find("column");
      fail(path, where, "invalid JSON (" + (column == std::string::npos ? what : what.substr(column)) + ")");
    }
    if (!row.is_object()) fail(path, where, std::string("expected a JSON object, found ") + row.type_name());
    const auto member = row.find(field);
    if (member == row.end()) fail(path, where + ": " + field, "missing");
    if (!member->is_string())
      fail(path, where + ": " + field, std::string("expected a string, found ") + member->type_name());
    std::string text = member->get<std::string>();
    if (!is_blank(text)) visit(std::move(text));
  }
  check_not_bad(in, path);
}

// ---- HDF5 plumbing ----

// HDF5 prints its whole error stack to stderr by default; kvbound reports one line itself. The thread-safe
// library keeps this setting per thread, so every entry point calls this.
void silence_hdf5() {
  thread_local bool silenced = false;
  if (!silenced) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    silenced = true;
  }
}

// The innermost (most specific) message on this thread's HDF5 error stack, e.g. "file signature not found".
std::string hdf5_reason() {
  std::string reason;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* error, void* out) -> herr_t {
        if (n == 0 && error->desc != nullptr) *static_cast<std::string*>(out) = error->desc;
        return 0;
      },
      &reason);
  H5Eclear2(H5E_DEFAULT);
  return reason.empty() ? "unknown HDF5 error" : reason;
}

// An owned HDF5 identifier, closed by the matching H5*close.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Hid(Hid&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = H5I_INVALID_HID; }
  Hid& operator=(Hid&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = other.id_;
      closer_ = other.closer_;
      other.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  ~Hid() { reset(); }
  hid_t get() const { return id_; }
  void reset() noexcept {
    if (id_ >= 0) closer_(id_);
    id_ = H5I_INVALID_HID;
  }
  // Closes now and reports whether closing succeeded (a file's close writes its metadata).
  bool close() {
    const herr_t status = id_ >= 0 ? closer_(id_) : 0;
    id_ = H5I_INVALID_HID;
    return status >= 0;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Wraps a freshly returned id, or throws "file: field: what (reason)" when HDF5 returned an error.
Hid own(hid_t id, Hid::Closer closer, const std::string& file, const std::string& field, const std::string& what) {
  if (id < 0) fail(file, field, what + " (" + hdf5_reason() + ")");
  return Hid(id, closer);
}

void check(herr_t status, const std::string& file, const std::string& field, const std::string& what) {
  if (status < 0) fail(file, field, what + " (" + hdf5_reason() + ")");
}

// File access that still works on filesystems without flock (NFS, some Lustre setups), where HDF5 would
// otherwise refuse to open anything.
Hid file_access_plist(const std::string& file) {
  Hid fapl = own(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, file, "", "cannot create a file access list");
  check(H5Pset_file_locking(fapl.get(), true, true), file, "", "cannot set file locking");
  return fapl;
}

Hid scalar_space(const std::string& file, const std::string& field) {
  return own(H5Screate(H5S_SCALAR), H5Sclose, file, field, "cannot create a dataspace");
}

void write_string_attribute(hid_t root, const std::string& name, const std::string& value, const std::string& file) {
  Hid type = own(H5Tcopy(H5T_C_S1), H5Tclose, file, name, "cannot create a string type");
  check(H5Tset_size(type.get(), H5T_VARIABLE), file, name, "cannot create a string type");
  check(H5Tset_cset(type.get(), H5T_CSET_UTF8), file, name, "cannot create a string type");
  Hid space = scalar_space(file, name);
  Hid attribute = own(H5Acreate2(root, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose,
                      file, name, "cannot create the attribute");
  const char* text = value.c_str();
  check(H5Awrite(attribute.get(), type.get(), &text), file, name, "cannot write the attribute");
}

void write_int_attribute(hid_t root, const std::string& name, std::int64_t value, const std::string& file) {
  Hid space = scalar_space(file, name);
  Hid attribute = own(H5Acreate2(root, name.c_str(), H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                      H5Aclose, file, name, "cannot create the attribute");
  check(H5Awrite(attribute.get(), H5T_NATIVE_INT64, &value), file, name, "cannot write the attribute");
}

// Opens a root attribute that must exist and hold a single value of `expected_class`.
Hid open_scalar_attribute(hid_t root, const std::string& name, H5T_class_t expected_class, const char* expected,
                          const std::string& file, Hid& type) {
  const htri_t exists = H5Aexists(root, name.c_str());
  if (exists < 0) fail(file, name, "cannot look up the attribute (" + hdf5_reason() + ")");
  if (exists == 0) fail(file, name, "missing attribute");
  Hid attribute = own(H5Aopen(root, name.c_str(), H5P_DEFAULT), H5Aclose, file, name, "cannot open the attribute");
  type = own(H5Aget_type(attribute.get()), H5Tclose, file, name, "cannot read the attribute's type");
  Hid space = own(H5Aget_space(attribute.get()), H5Sclose, file, name, "cannot read the attribute's shape");
  if (H5Tget_class(type.get()) != expected_class || H5Sget_simple_extent_npoints(space.get()) != 1)
    fail(file, name, std::string("expected a single ") + expected);
  return attribute;
}

// Reads a string attribute stored either as a variable-length string (kvbound, h5py) or a fixed-length one.
std::string read_string_attribute(hid_t root, const std::string& name, const std::string& file) {
  Hid file_type;
  Hid attribute = open_scalar_attribute(root, name, H5T_STRING, "string", file, file_type);
  Hid memory_type = own(H5Tcopy(H5T_C_S1), H5Tclose, file, name, "cannot create a string type");
  check(H5Tset_cset(memory_type.get(), H5Tget_cset(file_type.get())), file, name, "cannot create a string type");
  const htri_t variable = H5Tis_variable_str(file_type.get());
  if (variable < 0) fail(file, name, "cannot read the string type (" + hdf5_reason() + ")");
  if (variable > 0) {
    check(H5Tset_size(memory_type.get(), H5T_VARIABLE), file, name, "cannot create a string type");
    char* text = nullptr;
    check(H5Aread(attribute.get(), memory_type.get(), &text), file, name, "cannot read the attribute");
    std::string value = text != nullptr ? text : "";
    H5free_memory(text);
    return value;
  }
  const std::size_t size = H5Tget_size(file_type.get());
  check(H5Tset_size(memory_type.get(), size), file, name, "cannot create a string type");
  std::string value(size, '\0');
  check(H5Aread(attribute.get(), memory_type.get(), value.data()), file, name, "cannot read the attribute");
  value.resize(std::strlen(value.c_str()));  // fixed-length strings are NUL-padded
  return value;
}

std::int64_t read_int_attribute(hid_t root, const std::string& name, const std::string& file) {
  Hid type;
  Hid attribute = open_scalar_attribute(root, name, H5T_INTEGER, "integer", file, type);
  std::int64_t value = 0;
  check(H5Aread(attribute.get(), H5T_NATIVE_INT64, &value), file, name, "cannot read the attribute");
  return value;
}

// Opens the 1-D integer dataset `name` whose type is at most `max_bytes` wide; returns it and its length.
Hid open_1d_integers(hid_t file_id, const std::string& name, std::size_t max_bytes, const std::string& file,
                     hsize_t& length) {
  const std::string field = "/" + name;
  const htri_t exists = H5Lexists(file_id, name.c_str(), H5P_DEFAULT);
  if (exists < 0) fail(file, field, "cannot look up the dataset (" + hdf5_reason() + ")");
  if (exists == 0) fail(file, field, "missing dataset");
  Hid dataset = own(H5Dopen2(file_id, name.c_str(), H5P_DEFAULT), H5Dclose, file, field, "not a readable dataset");
  Hid type = own(H5Dget_type(dataset.get()), H5Tclose, file, field, "cannot read the dataset's type");
  if (H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) > max_bytes)
    fail(file, field, "expected integers of at most " + std::to_string(8 * max_bytes) + " bits");
  Hid space = own(H5Dget_space(dataset.get()), H5Sclose, file, field, "cannot read the dataset's shape");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank != 1) fail(file, field, "expected 1 dimension, found " + std::to_string(rank));
  check(H5Sget_simple_extent_dims(space.get(), &length, nullptr), file, field, "cannot read the dataset's shape");
  return dataset;
}

// A chunked, shuffled, deflated 1-D dataset creation list.
Hid compressed_chunks(hsize_t chunk, const std::string& file, const std::string& field) {
  Hid dcpl = own(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, file, field, "cannot create a dataset creation list");
  check(H5Pset_chunk(dcpl.get(), 1, &chunk), file, field, "cannot set the chunk size");
  // Shuffle groups the ids' high bytes (mostly zero) together, which deflate then compresses well.
  check(H5Pset_shuffle(dcpl.get()), file, field, "the shuffle filter is unavailable");
  check(H5Pset_deflate(dcpl.get(), kDeflateLevel), file, field, "the deflate filter is unavailable");
  return dcpl;
}

void fsync_path(const std::string& path, int flags, const std::string& reported) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) fail(reported, "", std::string("cannot open for fsync: ") + std::strerror(errno));
  const int status = ::fsync(fd);
  const int fsync_errno = errno;
  ::close(fd);
  if (status != 0) fail(reported, "", std::string("fsync failed: ") + std::strerror(fsync_errno));
}

std::string join_lines(const std::vector<std::string>& lines) {
  std::string joined;
  for (std::size_t i = 0; i < lines.size(); ++i) joined += (i ? "\n" : "") + lines[i];
  return joined;
}

std::vector<std::string> split_lines(const std::string& joined) {
  std::vector<std::string> lines;
  std::size_t begin = 0;
  while (!joined.empty()) {
    const std::size_t end = joined.find('\n', begin);
    lines.push_back(joined.substr(begin, end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return lines;
}

}  // namespace

// ---- documents ----

void check_document_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) fail(path, "", "no such file");
  if (!fs::is_regular_file(status)) fail(path, "", "not a regular file");
  const std::string ext = lowercase_extension(path);
  if (ext != ".txt" && ext != ".jsonl") fail(path, "", "unknown input type '" + ext + "' (expected .txt or .jsonl)");
}

void for_each_document(const std::string& path, const DocumentFormat& format,
                       const std::function<void(std::string&& text)>& visit) {
  check_document_file(path);
  if (lowercase_extension(path) == ".jsonl") {
    jsonl_documents(path, format.jsonl_field, visit);
  } else {
    if (format.separator.empty()) fail(path, "separator", "an empty separator would split at every blank line");
    text_documents(path, format.separator, visit);
  }
}

std::vector<std::string> read_documents(const std::string& path, const DocumentFormat& format) {
  std::vector<std::string> documents;
  for_each_document(path, format, [&](std::string&& text) { documents.push_back(std::move(text)); });
  return documents;
}

// ---- metadata ----

TokenDatasetInfo TokenDatasetInfo::for_tokenizer(const Tokenizer& tokenizer, const std::string& tokenizer_path) {
  TokenDatasetInfo info;
  info.tokenizer_identity = tokenizer.identity();
  info.tokenizer_path = tokenizer_path;
  info.vocab_size = tokenizer.vocab_size();
  info.bos_id = tokenizer.bos_id();
  info.eos_id = tokenizer.eos_id();
  return info;
}

bool TokenDatasetInfo::operator==(const TokenDatasetInfo& other) const {
  return tokenizer_identity == other.tokenizer_identity && tokenizer_path == other.tokenizer_path &&
         vocab_size == other.vocab_size && bos_id == other.bos_id && eos_id == other.eos_id &&
         eos_appended == other.eos_appended && source_files == other.source_files && created_by == other.created_by;
}

// ---- writing ----

struct TokenDatasetWriter::Handles {
  Hid file, tokens;
};

TokenDatasetWriter::TokenDatasetWriter(std::string path, TokenDatasetInfo info)
    : path_(std::move(path)), info_(std::move(info)), h5_(std::make_unique<Handles>()) {
  silence_hdf5();
  if (info_.tokenizer_identity.empty()) fail(path_, "tokenizer_identity", "empty");
  if (info_.vocab_size < 1 || info_.vocab_size > kMaxVocab)
    fail(path_, "vocab_size", std::to_string(info_.vocab_size) + " is outside [1, 2^31]");
  for (const auto& [name, id] : {std::pair{"bos_id", info_.bos_id}, std::pair{"eos_id", info_.eos_id}})
    if (id < -1 || id >= info_.vocab_size)
      fail(path_, name, std::to_string(id) + " is outside [-1, " + std::to_string(info_.vocab_size) + ")");
  if (info_.eos_appended && info_.eos_id < 0) fail(path_, "eos_appended", "the tokenizer has no EOS token");
  for (const std::string& source : info_.source_files)
    if (source.find('\n') != std::string::npos) fail(path_, "source_files", "a file name contains a newline");

  std::error_code ec;
  const fs::path parent = fs::path(path_).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) fail(path_, "", "cannot create the folder: " + ec.message());
  temp_path_ = path_ + ".tmp-" + std::to_string(::getpid());
  Hid fapl = file_access_plist(path_);
  h5_->file = own(H5Fcreate(temp_path_.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose, path_, "",
                  "cannot create " + temp_path_);
  try {
    const hsize_t empty = 0, unlimited = H5S_UNLIMITED;
    Hid space = own(H5Screate_simple(1, &empty, &unlimited), H5Sclose, path_, "/tokens", "cannot create a dataspace");
    Hid dcpl = compressed_chunks(kTokenChunk, path_, "/tokens");
    h5_->tokens = own(H5Dcreate2(h5_->file.get(), "tokens", H5T_STD_I32LE, space.get(), H5P_DEFAULT, dcpl.get(),
                                 H5P_DEFAULT),
                      H5Dclose, path_, "/tokens", "cannot create the dataset");
  } catch (...) {
    discard();
    throw;
  }
  buffer_.reserve(kTokenChunk);
}

TokenDatasetWriter::~TokenDatasetWriter() {
  if (!committed_) discard();
}

void TokenDatasetWriter::discard() noexcept {
  h5_->tokens.reset();
  h5_->file.reset();
  std::error_code ec;
  if (!temp_path_.empty()) fs::remove(temp_path_, ec);
}

void TokenDatasetWriter::append_document(const std::vector<std::int64_t>& ids) {
  if (committed_) fail(path_, "", "append_document after commit");
  if (ids.empty()) fail(path_, "/doc_offsets", "document " + std::to_string(num_docs()) + " has no ids");
  for (const std::int64_t id : ids) {
    if (id < 0 || id >= info_.vocab_size)
      fail(path_, "/tokens", "document " + std::to_string(num_docs()) + " has id " + std::to_string(id) +
                                 ", outside [0, vocab_size " + std::to_string(info_.vocab_size) + ")");
  }
  for (const std::int64_t id : ids) {
    buffer_.push_back(static_cast<std::int32_t>(id));
    if (buffer_.size() == kTokenChunk) write_buffered_tokens();
  }
  doc_offsets_.push_back(doc_offsets_.back() + static_cast<std::int64_t>(ids.size()));
}

// Appends the buffered ids to /tokens. Called with whole chunks (each chunk is compressed once) and at commit.
void TokenDatasetWriter::write_buffered_tokens() {
  if (buffer_.empty()) return;
  silence_hdf5();
  const hsize_t start = static_cast<hsize_t>(tokens_written_), count = buffer_.size(), size = start + count;
  check(H5Dset_extent(h5_->tokens.get(), &size), path_, "/tokens", "cannot extend the dataset");
  Hid file_space = own(H5Dget_space(h5_->tokens.get()), H5Sclose, path_, "/tokens", "cannot read the dataspace");
  check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &start, nullptr, &count, nullptr), path_, "/tokens",
        "cannot select the new ids");
  Hid memory_space = own(H5Screate_simple(1, &count, nullptr), H5Sclose, path_, "/tokens", "cannot create a dataspace");
  check(H5Dwrite(h5_->tokens.get(), H5T_NATIVE_INT32, memory_space.get(), file_space.get(), H5P_DEFAULT,
                 buffer_.data()),
        path_, "/tokens", "cannot write ids");
  tokens_written_ += static_cast<std::int64_t>(count);
  buffer_.clear();
}

void TokenDatasetWriter::commit() {
  if (committed_) fail(path_, "", "commit called twice");
  silence_hdf5();
  write_buffered_tokens();
  const hid_t root = h5_->file.get();
  {
    const hsize_t n = doc_offsets_.size();
    Hid space = own(H5Screate_simple(1, &n, nullptr), H5Sclose, path_, "/doc_offsets", "cannot create a dataspace");
    Hid dcpl = compressed_chunks(std::min(n, kOffsetChunk), path_, "/doc_offsets");
    Hid offsets = own(H5Dcreate2(root, "doc_offsets", H5T_STD_I64LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
                      H5Dclose, path_, "/doc_offsets", "cannot create the dataset");
    check(H5Dwrite(offsets.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, doc_offsets_.data()), path_,
          "/doc_offsets", "cannot write the offsets");
  }
  write_string_attribute(root, "format", kTokenDatasetFormat, path_);
  write_int_attribute(root, "format_version", kTokenDatasetVersion, path_);
  write_string_attribute(root, "tokenizer_identity", info_.tokenizer_identity, path_);
  write_string_attribute(root, "tokenizer_path", info_.tokenizer_path, path_);
  write_int_attribute(root, "vocab_size", info_.vocab_size, path_);
  write_int_attribute(root, "bos_id", info_.bos_id, path_);
  write_int_attribute(root, "eos_id", info_.eos_id, path_);
  write_int_attribute(root, "eos_appended", info_.eos_appended ? 1 : 0, path_);
  write_string_attribute(root, "source_files", join_lines(info_.source_files), path_);
  write_string_attribute(root, "created_by", info_.created_by, path_);

  check(H5Fflush(root, H5F_SCOPE_GLOBAL), path_, "", "cannot flush");
  if (!h5_->tokens.close()) fail(path_, "/tokens", "cannot close the dataset (" + hdf5_reason() + ")");
  if (!h5_->file.close()) fail(path_, "", "cannot close the file (" + hdf5_reason() + ")");
  fsync_path(temp_path_, O_RDONLY, path_);
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0)
    fail(path_, "", "cannot rename " + temp_path_ + " into place: " + std::strerror(errno));
  committed_ = true;
  // The rename itself is durable only once the folder's entry is.
  const fs::path parent = fs::path(path_).parent_path();
  fsync_path(parent.empty() ? "." : parent.string(), O_RDONLY | O_DIRECTORY, path_);
}

void write_token_dataset(const std::string& path, const std::vector<std::vector<std::int64_t>>& documents,
                         const TokenDatasetInfo& info) {
  TokenDatasetWriter writer(path, info);
  for (const auto& document : documents) writer.append_document(document);
  writer.commit();
}

// ---- reading ----

struct TokenDataset::Handles {
  Hid file, tokens;
};

TokenDataset::~TokenDataset() = default;
TokenDataset::TokenDataset(TokenDataset&&) noexcept = default;
TokenDataset& TokenDataset::operator=(TokenDataset&&) noexcept = default;

TokenDataset TokenDataset::open(const std::string& path, const Tokenizer* expected, const std::string& expected_path) {
  silence_hdf5();
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status)) fail(path, "", "no such file (token datasets are written by `kvbound prepare`)");
  if (!fs::is_regular_file(status)) fail(path, "", "not a regular file");

  TokenDataset dataset;
  dataset.path_ = path;
  dataset.h5_ = std::make_unique<Handles>();
  Hid fapl = file_access_plist(path);
  dataset.h5_->file = own(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose, path, "",
                          "not a readable HDF5 file");
  const hid_t root = dataset.h5_->file.get();

  const std::string format = read_string_attribute(root, "format", path);
  if (format != kTokenDatasetFormat)
    fail(path, "format", "'" + format + "' is not a token dataset (expected '" + kTokenDatasetFormat + "')");
  dataset.format_version_ = read_int_attribute(root, "format_version", path);
  if (dataset.format_version_ < 1 || dataset.format_version_ > kTokenDatasetVersion)
    fail(path, "format_version", "version " + std::to_string(dataset.format_version_) +
                                     " is not supported (this kvbound reads version " +
                                     std::to_string(kTokenDatasetVersion) + ")");

  TokenDatasetInfo& info = dataset.info_;
  info.tokenizer_identity = read_string_attribute(root, "tokenizer_identity", path);
  info.tokenizer_path = read_string_attribute(root, "tokenizer_path", path);
  if (info.tokenizer_identity.empty()) fail(path, "tokenizer_identity", "empty");
  if (expected != nullptr && expected->identity() != info.tokenizer_identity) {
    const std::string in_use = expected->identity() + (expected_path.empty() ? "" : " (" + expected_path + ")");
    fail(path, "tokenizer_identity", "made with " + info.tokenizer_identity + " (" + info.tokenizer_path +
                                         ") but the tokenizer in use is " + in_use);
  }
  info.vocab_size = read_int_attribute(root, "vocab_size", path);
  if (info.vocab_size < 1 || info.vocab_size > kMaxVocab)
    fail(path, "vocab_size", std::to_string(info.vocab_size) + " is outside [1, 2^31]");
  info.bos_id = read_int_attribute(root, "bos_id", path);
  info.eos_id = read_int_attribute(root, "eos_id", path);
  for (const auto& [name, id] : {std::pair{"bos_id", info.bos_id}, std::pair{"eos_id", info.eos_id}})
    if (id < -1 || id >= info.vocab_size)
      fail(path, name, std::to_string(id) + " is outside [-1, vocab_size " + std::to_string(info.vocab_size) + ")");
  const std::int64_t eos_appended = read_int_attribute(root, "eos_appended", path);
  if (eos_appended != 0 && eos_appended != 1) fail(path, "eos_appended", "expected 0 or 1");
  info.eos_appended = eos_appended == 1;
  info.source_files = split_lines(read_string_attribute(root, "source_files", path));
  info.created_by = read_string_attribute(root, "created_by", path);

  hsize_t num_tokens = 0, num_offsets = 0;
  dataset.h5_->tokens = open_1d_integers(root, "tokens", 4, path, num_tokens);
  Hid offsets = open_1d_integers(root, "doc_offsets", 8, path, num_offsets);
  if (num_offsets == 0) fail(path, "/doc_offsets", "empty (needs num_docs + 1 entries, starting at 0)");
  // Documents are never empty, so a longer list is damage (and must not become a huge allocation).
  if (num_offsets > num_tokens + 1)
    fail(path, "/doc_offsets", std::to_string(num_offsets) + " entries for " + std::to_string(num_tokens) +
                                   " ids (at most one more entry than ids)");
  dataset.doc_offsets_.resize(num_offsets);
  check(H5Dread(offsets.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, dataset.doc_offsets_.data()), path,
        "/doc_offsets", "cannot read the offsets");
  const std::vector<std::int64_t>& o = dataset.doc_offsets_;
  if (o[0] != 0) fail(path, "/doc_offsets", "starts at " + std::to_string(o[0]) + ", expected 0");
  for (std::size_t i = 1; i < o.size(); ++i)
    if (o[i] <= o[i - 1])
      fail(path, "/doc_offsets", "does not increase at entry " + std::to_string(i) + " (" +
                                     std::to_string(o[i - 1]) + " then " + std::to_string(o[i]) +
                                     "; documents are never empty)");
  if (static_cast<hsize_t>(o.back()) != num_tokens)
    fail(path, "/doc_offsets", "ends at " + std::to_string(o.back()) + " but /tokens holds " +
                                   std::to_string(num_tokens) + " ids");
  return dataset;
}

std::vector<std::int32_t> TokenDataset::tokens(std::int64_t begin, std::int64_t count) const {
  if (begin < 0 || count < 0 || begin > num_tokens() - count)
    fail(path_, "/tokens", "cannot read " + std::to_string(count) + " ids from position " + std::to_string(begin) +
                               ": the dataset holds " + std::to_string(num_tokens()));
  std::vector<std::int32_t> ids(static_cast<std::size_t>(count));
  if (count == 0) return ids;
  silence_hdf5();
  const hsize_t start = static_cast<hsize_t>(begin), n = static_cast<hsize_t>(count);
  const std::string range = "[" + std::to_string(begin) + ", " + std::to_string(begin + count) + ")";
  Hid file_space = own(H5Dget_space(h5_->tokens.get()), H5Sclose, path_, "/tokens", "cannot read the dataspace");
  check(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, &start, nullptr, &n, nullptr), path_, "/tokens",
        "cannot select ids " + range);
  Hid memory_space = own(H5Screate_simple(1, &n, nullptr), H5Sclose, path_, "/tokens", "cannot create a dataspace");
  check(H5Dread(h5_->tokens.get(), H5T_NATIVE_INT32, memory_space.get(), file_space.get(), H5P_DEFAULT, ids.data()),
        path_, "/tokens", "cannot read ids " + range);
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= info_.vocab_size)
      fail(path_, "/tokens", "id " + std::to_string(ids[i]) + " at position " + std::to_string(begin + i) +
                                 " is outside [0, vocab_size " + std::to_string(info_.vocab_size) + ")");
  return ids;
}

std::vector<std::int32_t> TokenDataset::document(std::int64_t i) const {
  if (i < 0 || i >= num_docs())
    fail(path_, "/doc_offsets", "document " + std::to_string(i) + " is outside [0, " + std::to_string(num_docs()) + ")");
  const auto index = static_cast<std::size_t>(i);
  return tokens(doc_offsets_[index], doc_offsets_[index + 1] - doc_offsets_[index]);
}

}  // namespace kvbound
