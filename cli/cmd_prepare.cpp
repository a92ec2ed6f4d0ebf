// `kvbound prepare`: text/jsonl files -> one HDF5 token dataset (layout in data/token_dataset.h).
// Documents stream through in batches that are tokenised on several threads and appended in input order,
// so memory holds one batch whatever the corpus size, and the output is the same for any thread count.
#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cxxopts.hpp>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "cli/parse_arguments.h"
#include "base/errors.h"
#include "base/usable_cores.h"
#include "data/token_dataset.h"
#include "data/tokenizer.h"
#include "cli/commands.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kBatchBytes = std::size_t{8} << 20;  // text per tokenisation batch

// The tokenizer file that --tokenizer names: the file itself, or the one beside a model (a folder or .gguf).
std::string resolve_tokenizer(const std::string& given) {
  std::error_code ec;
  std::string ext = fs::path(given).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  if (fs::is_directory(given, ec) || ext == ".gguf") return find_tokenizer_beside(given);
  return given;
}

// Every --input value and positional argument, verbatim: cxxopts splits vector values at commas, and a
// file name may contain one.
std::vector<std::string> input_paths(const cxxopts::ParseResult& parsed) {
  std::vector<std::string> paths;
  for (const auto& argument : parsed.arguments())
    if (argument.key() == "input") paths.push_back(argument.value());
  return paths;
}

std::string absolute(const std::string& path) { return fs::absolute(path).lexically_normal().string(); }

struct EncodeJob {
  const Tokenizer& tokenizer;
  std::int64_t appended_eos;  // -1: none
  int threads;
};

// ids[i] = texts[i] encoded without BOS (plus EOS when asked). An error names the input file and the
// document's index in it; with several failures, the first document's.
std::vector<std::vector<std::int64_t>> encode_batch(const EncodeJob& job, const std::vector<std::string>& texts,
                                                    const std::string& file, std::int64_t first_index) {
  std::vector<std::vector<std::int64_t>> ids(texts.size());
  std::vector<std::exception_ptr> errors(texts.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next++; i < texts.size(); i = next++) {
      try {
        ids[i] = job.tokenizer.encode(texts[i], /*add_bos=*/false);
        if (job.appended_eos >= 0) ids[i].push_back(job.appended_eos);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  };
  const std::size_t helpers = std::min<std::size_t>(std::max(job.threads, 1) - 1, texts.size());
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  for (std::size_t i = 0; i < texts.size(); ++i) {
    if (!errors[i]) continue;
    const std::string where = "document " + std::to_string(first_index + static_cast<std::int64_t>(i));
    try {
      std::rethrow_exception(errors[i]);
    } catch (const std::exception& e) {
      fail(file, where, e.what());
    }
  }
  return ids;
}

}  // namespace

int cmd_prepare(int argc, char** argv) {
  cxxopts::Options o("kvbound prepare",
                     "Tokenise text files into an HDF5 token dataset for training and evaluation.\n"
                     ".txt: documents separated by a separator line; .jsonl: one document per line.\n"
                     "Documents are stored without BOS (readers add it when they pack).");
  cxxopts::OptionAdder add = o.add_options();
  add("tokenizer", "tokenizer file, or a model (folder or .gguf) whose tokenizer to use", cxxopts::value<std::string>());
  add("input", "input .txt/.jsonl files (also accepted as positional arguments)",
      cxxopts::value<std::vector<std::string>>());
  add("output", "the HDF5 file to write", cxxopts::value<std::string>());
  add("doc-separator", ".txt: the line that separates documents",
      cxxopts::value<std::string>()->default_value("<|endoftext|>"));
  add("jsonl-field", ".jsonl: the string field that holds each document",
      cxxopts::value<std::string>()->default_value("text"));
  add("add-eos", "append the EOS token to every document");
  add("force", "replace an existing output file");
  add("threads", "tokenising threads (0 = every core this process may use)", cxxopts::value<int>()->default_value("0"));
  add("h,help", "show this help");
  o.parse_positional({"input"});
  o.positional_help("FILE...");
  o.show_positional_help();
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  if (!r.count("tokenizer")) fail("--tokenizer", "", "required (a tokenizer file or a model)");
  if (!r.count("output")) fail("--output", "", "required (the .h5 file to write)");
  const std::vector<std::string> inputs = input_paths(r);
  if (inputs.empty()) fail("--input", "", "no input files");
  const int threads = r["threads"].as<int>();
  if (threads < 0) fail("--threads", "", "must be >= 0");
  const std::string output = r["output"].as<std::string>();
  std::error_code ec;
  if (fs::is_directory(output, ec)) fail(output, "", "is a folder, expected the .h5 file to write");
  if (fs::exists(output, ec) && !r.count("force")) fail(output, "", "already exists (pass --force to replace it)");
  for (const std::string& input : inputs) check_document_file(input);

  const std::string tokenizer_path = resolve_tokenizer(r["tokenizer"].as<std::string>());
  const auto tokenizer = load_tokenizer(tokenizer_path);
  const bool add_eos = r.count("add-eos") > 0;
  if (add_eos && tokenizer->eos_id() < 0)
    fail(tokenizer_path, "eos", "--add-eos needs an EOS token and this tokenizer has none");
  DocumentFormat format;
  format.separator = r["doc-separator"].as<std::string>();
  format.jsonl_field = r["jsonl-field"].as<std::string>();

  TokenDatasetInfo info = TokenDatasetInfo::for_tokenizer(*tokenizer, absolute(tokenizer_path));
  info.eos_appended = add_eos;
  for (const std::string& input : inputs) info.source_files.push_back(absolute(input));
  info.created_by = "kvbound";
  for (int i = 0; i < argc; ++i) info.created_by += std::string(" ") + argv[i];

  const EncodeJob job{*tokenizer, add_eos ? tokenizer->eos_id() : -1,
                      threads > 0 ? threads : usable_cores()};
  std::cerr << "[prepare] tokenizer " << tokenizer_path << " (" << tokenizer->identity() << ", vocab "
            << tokenizer->vocab_size() << "), " << job.threads << " threads\n";
  const auto start = std::chrono::steady_clock::now();
  TokenDatasetWriter writer(output, info);
  for (const std::string& input : inputs) {
    const std::int64_t docs_before = writer.num_docs(), tokens_before = writer.num_tokens();
    std::int64_t documents_read = 0, documents_without_ids = 0;
    std::vector<std::string> batch;
    std::size_t batch_bytes = 0;
    auto flush = [&] {
      for (const auto& ids : encode_batch(job, batch, input, documents_read)) {
        // Only text that a tokenizer normalises away entirely gets here; the dataset holds no empty documents.
        if (ids.empty())
          ++documents_without_ids;
        else
          writer.append_document(ids);
      }
      documents_read += static_cast<std::int64_t>(batch.size());
      batch.clear();
      batch_bytes = 0;
    };
    for_each_document(input, format, [&](std::string&& text) {
      batch_bytes += text.size();
      batch.push_back(std::move(text));
      if (batch_bytes >= kBatchBytes) flush();
    });
    flush();
    std::cerr << "[prepare] " << input << ": " << writer.num_docs() - docs_before << " documents, "
              << writer.num_tokens() - tokens_before << " tokens";
    if (documents_without_ids > 0) std::cerr << " (" << documents_without_ids << " encoded to no tokens, skipped)";
    std::cerr << "\n";
  }
  if (writer.num_docs() == 0) fail("--input", "", "no non-empty documents in the input files");
  writer.commit();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto bytes = fs::file_size(output, ec);
  std::cerr << "[prepare] wrote " << output << ": " << writer.num_docs() << " documents, " << writer.num_tokens()
            << " tokens, " << bytes << " bytes ("
            << static_cast<double>(bytes) / static_cast<double>(std::max<std::int64_t>(writer.num_tokens(), 1))
            << " bytes/token) in " << seconds << " s ("
            << static_cast<std::int64_t>(static_cast<double>(writer.num_tokens()) / std::max(seconds, 1e-9))
            << " tokens/s)\n";
  return 0;
}

}  // namespace kvbound
