// Text files -> documents -> token ids in an HDF5 file, and back.
//
// Inputs: `.txt` files hold documents separated by a separator line (TinyStories' "<|endoftext|>");
// `.jsonl` files hold one JSON object per line with the document in a string member ("text").
//
// The token dataset (format "kvbound-tokens", version 1) is one HDF5 file:
//   /tokens       int32 [num_tokens]    every document's ids back to back, no BOS (readers add BOS when
//                                       they pack; whether an EOS ends each document is an attribute)
//   /doc_offsets  int64 [num_docs + 1]  document i is tokens[doc_offsets[i], doc_offsets[i+1]); strictly
//                                       increasing from 0 to num_tokens: no document is empty
//   root attributes: format, format_version, tokenizer_identity, tokenizer_path, vocab_size, bos_id,
//   eos_id, eos_appended, source_files (newline-joined), created_by.
// /tokens is chunked (65536 ids), shuffled and deflated, so a document is read without the whole file.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace kvbound {

// How input files split into documents.
struct DocumentFormat {
  std::string separator = "<|endoftext|>";  // .txt: a line equal to this (ignoring a trailing '\r') ends a document
  std::string jsonl_field = "text";          // .jsonl: the string member that holds each line's document
};

// Throws kvbound::Error "path: ..." unless `path` is a regular file named *.txt or *.jsonl (any case).
void check_document_file(const std::string& path);

// Calls visit(text) for each non-empty document of `path`, in file order, reading line by line (memory
// holds one document). .txt: the lines between separator lines, surrounding whitespace stripped (it is
// the file's layout, and llama2.c strips stories the same way); a file without separators is one
// document. .jsonl: the field's string as written; whitespace-only documents and blank lines are skipped.
// Throws kvbound::Error "path: line N: ..." for invalid JSON, a non-object line or a missing/non-string
// field; "path: ..." for an unreadable file or an extension other than .txt/.jsonl.
void for_each_document(const std::string& path, const DocumentFormat& format,
                       const std::function<void(std::string&& text)>& visit);
std::vector<std::string> read_documents(const std::string& path, const DocumentFormat& format);

// What a token dataset says about itself (the root attributes).
struct TokenDatasetInfo {
  std::string tokenizer_identity;  // Tokenizer::identity()
  std::string tokenizer_path;      // where that tokenizer was loaded from (informational)
  std::int64_t vocab_size = 0;     // every stored id is in [0, vocab_size)
  std::int64_t bos_id = -1;        // -1: the tokenizer has none
  std::int64_t eos_id = -1;
  bool eos_appended = false;  // each document already ends with eos_id
  std::vector<std::string> source_files;
  std::string created_by;

  // The tokenizer fields of a dataset made with `tokenizer`, loaded from `tokenizer_path`.
  static TokenDatasetInfo for_tokenizer(const Tokenizer& tokenizer, const std::string& tokenizer_path);
  bool operator==(const TokenDatasetInfo& other) const;
};

inline constexpr const char* kTokenDatasetFormat = "kvbound-tokens";
inline constexpr std::int64_t kTokenDatasetVersion = 1;

// Streams documents into a new token dataset. Nothing appears at `path` until commit(): the file is
// written as `path.tmp-<pid>` beside it, flushed, fsynced and renamed over `path` (replacing any file
// there). A writer destroyed without commit() — an error, an exception — removes its temporary file.
// Memory holds one chunk of ids plus one offset per document.
class TokenDatasetWriter {
 public:
  // Throws kvbound::Error naming `path` when info is unusable (vocab_size outside [1, 2^31], bos/eos
  // outside [-1, vocab_size)) or the temporary file cannot be created.
  TokenDatasetWriter(std::string path, TokenDatasetInfo info);
  ~TokenDatasetWriter();
  TokenDatasetWriter(const TokenDatasetWriter&) = delete;
  TokenDatasetWriter& operator=(const TokenDatasetWriter&) = delete;

  // Appends one document (ids as Tokenizer::encode returns them, without BOS). Throws for an empty
  // document or an id outside [0, vocab_size), so the writer never makes a file the reader would reject.
  void append_document(const std::vector<std::int64_t>& ids);
  // Writes the offsets and attributes, then publishes the file at `path`. Call once.
  void commit();

  std::int64_t num_docs() const { return static_cast<std::int64_t>(doc_offsets_.size()) - 1; }
  std::int64_t num_tokens() const { return doc_offsets_.back(); }

 private:
  struct Handles;
  void write_buffered_tokens();
  void discard() noexcept;

  std::string path_, temp_path_;
  TokenDatasetInfo info_;
  std::unique_ptr<Handles> h5_;
  std::vector<std::int32_t> buffer_;  // ids not yet written: less than one chunk
  std::vector<std::int64_t> doc_offsets_{0};
  std::int64_t tokens_written_ = 0;
  bool committed_ = false;
};

// All of `documents` into a new dataset at `path`, through TokenDatasetWriter.
void write_token_dataset(const std::string& path, const std::vector<std::vector<std::int64_t>>& documents,
                         const TokenDatasetInfo& info);

// A token dataset open for reading. Opening validates the structure (HDF5 file, format and version
// attributes, dataset types and ranks, doc_offsets strictly increasing from 0 to the number of tokens) and, when `expected` is given, that the file was made with that tokenizer. Token ids are
// range-checked as they are read (document(), tokens()) rather than at open: the check is one compare
// per id that was just decompressed anyway, while checking at open would read every chunk of a
// billion-token file before the first batch. Every failure is kvbound::Error "path: field: message".
// Reading from several threads relies on a thread-safe libhdf5 (Debian/Ubuntu's libhdf5-dev is built so,
// H5_HAVE_THREADSAFE; it serialises calls); with another build, keep HDF5 use to one thread.
class TokenDataset {
 public:
  // `expected_path` (where `expected` was loaded from) only makes a mismatch message clearer.
  static TokenDataset open(const std::string& path, const Tokenizer* expected = nullptr,
                           const std::string& expected_path = {});
  ~TokenDataset();
  TokenDataset(TokenDataset&&) noexcept;
  TokenDataset& operator=(TokenDataset&&) noexcept;

  std::int64_t num_docs() const { return static_cast<std::int64_t>(doc_offsets_.size()) - 1; }
  std::int64_t num_tokens() const { return doc_offsets_.back(); }
  const std::vector<std::int64_t>& doc_offsets() const { return doc_offsets_; }
  // Document i's ids (no BOS). Throws for i outside [0, num_docs) or an id outside [0, vocab_size).
  std::vector<std::int32_t> document(std::int64_t i) const;
  // ids [begin, begin + count) of /tokens, across document boundaries.
  std::vector<std::int32_t> tokens(std::int64_t begin, std::int64_t count) const;

  const std::string& path() const { return path_; }
  std::int64_t format_version() const { return format_version_; }
  const TokenDatasetInfo& info() const { return info_; }
  const std::string& tokenizer_identity() const { return info_.tokenizer_identity; }
  std::int64_t vocab_size() const { return info_.vocab_size; }
  std::int64_t bos_id() const { return info_.bos_id; }
  std::int64_t eos_id() const { return info_.eos_id; }

 private:
  struct Handles;
  TokenDataset() = default;

  std::string path_;
  std::int64_t format_version_ = 0;
  TokenDatasetInfo info_;
  std::vector<std::int64_t> doc_offsets_{0};
  std::unique_ptr<Handles> h5_;
};

}  // namespace kvbound
