// Tokenizer loading by path, and the GGUF vocabulary (tokenizer.ggml.*) mapped onto the two
// tokenizer classes. All GGUF-specific knowledge lives here.
#include "data/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/build_options.h"
#include "base/errors.h"
#include "checkpoints/gguf.h"
#include "base/mapped_file.h"
#if KVBOUND_WITH_ICU
#include "data/bpe_tokenizer.h"
#endif
#include "data/llama2c_tokenizer.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

// llama.cpp's token types (enum llama_token_type).
constexpr std::int32_t kTypeUnknown = 2;
constexpr std::int32_t kTypeControl = 3;
constexpr std::int32_t kTypeUserDefined = 4;
constexpr std::int32_t kTypeUnused = 5;
constexpr std::int32_t kTypeByte = 6;

std::vector<std::int32_t> token_types(const GgufFile& gguf, std::size_t n_tokens) {
  if (!gguf.has("tokenizer.ggml.token_type")) return std::vector<std::int32_t>(n_tokens, 1);
  std::vector<std::int32_t> types = gguf.get_i32_array("tokenizer.ggml.token_type");
  if (types.size() != n_tokens)
    fail(gguf.path(), "tokenizer.ggml.token_type",
         std::to_string(types.size()) + " entries for " + std::to_string(n_tokens) + " tokens");
  return types;
}

std::int64_t optional_id(const GgufFile& gguf, const std::string& key) {
  const std::optional<std::uint32_t> id = gguf.find_u32(key);
  return id ? static_cast<std::int64_t>(*id) : -1;
}

#if KVBOUND_WITH_ICU
// Split regexes of the GGUF pre-tokenizer names, as transformers' GGUF loader maps them
// (integrations/gguf/gguf_tokenizer_mapping.py), which is also what the models' tokenizer.json use.
constexpr const char* kLlama3Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string split_then_byte_level(const char* regex) {
  nlohmann::json split = {{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}};
  nlohmann::json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  return nlohmann::json{{"type", "Sequence"}, {"pretokenizers", {split, byte_level}}}.dump();
}

// HF pre_tokenizer JSON for a tokenizer.ggml.pre name.
//
// "smollm": llama.cpp isolates every digit (\p{N}) before the GPT-2 regex, as the hub's SmolLM2
// tokenizer.json does (Digits(individual_digits) + ByteLevel), but transformers' GGUF loader, the
// reference here, knows no "smollm" and keeps GPT2Tokenizer's plain ByteLevel. SmolLM2's vocabulary
// has no token that joins a digit to anything, so the two differ only where whitespace runs into a
// digit: "a  1" is [a, Ġ, Ġ, 1] here and [a, ĠĠ, 1] in llama.cpp.
std::string gguf_pre_tokenizer(const std::string& pre, const std::string& path) {
  if (pre == "default" || pre == "gpt-2" || pre == "gpt2" || pre == "smollm")
    return R"({"type":"ByteLevel","add_prefix_space":false,"use_regex":true})";
  if (pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe" || pre == "smaug-bpe" || pre == "dbrx" ||
      pre == "falcon3" || pre == "pixtral")
    return split_then_byte_level(kLlama3Split);
  if (pre == "qwen2" || pre == "deepseek-r1-qwen" || pre == "megrez") return split_then_byte_level(kQwen2Split);
  fail(path, "tokenizer.ggml.pre", "pre-tokenizer '" + pre +
                                       "' is not supported (default, gpt-2, smollm, llama-bpe/llama3, qwen2)");
}

std::unique_ptr<Tokenizer> gguf_bpe(const GgufFile& gguf) {
  BpeTokenizer::Lists lists;
  lists.field_prefix = "tokenizer.ggml.";
  lists.tokens = gguf.get_string_array("tokenizer.ggml.tokens");
  lists.merges = gguf.get_string_array("tokenizer.ggml.merges");
  const std::vector<std::int32_t> types = token_types(gguf, lists.tokens.size());
  // As transformers does: control tokens become special added tokens (unless spelled outside the
  // byte alphabet, which llama.cpp only does by mislabelling), user-defined ones plain added tokens.
  for (std::size_t id = 0; id < lists.tokens.size(); ++id) {
    const std::string& token = lists.tokens[id];
    const bool spelled = BpeTokenizer::is_byte_level_spelling(token);
    if (!spelled || token.empty()) continue;
    if (types[id] == kTypeControl || types[id] == kTypeUserDefined) {
      BpeTokenizer::AddedToken added;
      added.content = token;
      added.id = static_cast<std::int64_t>(id);
      added.special = types[id] == kTypeControl;
      lists.added.push_back(std::move(added));
    }
  }
  lists.pre_tokenizer_json = gguf_pre_tokenizer(gguf.get_string("tokenizer.ggml.pre", "default"), gguf.path());
  lists.bos_id = optional_id(gguf, "tokenizer.ggml.bos_token_id");
  lists.eos_id = optional_id(gguf, "tokenizer.ggml.eos_token_id");
  return BpeTokenizer::from_lists(lists, gguf.path());
}
#else
// Byte-level BPE runs its pre-tokenizer regexes through ICU (data/bpe_tokenizer.cpp).
constexpr const char* kWithoutIcu =
    "byte-level BPE tokenizers need ICU, and this kvbound was built without it (KVBOUND_WITH_ICU=OFF): rebuild with "
    "libicu-dev, or use a model with a sentencepiece or llama2.c tokenizer";

std::unique_ptr<Tokenizer> gguf_bpe(const GgufFile& gguf) { fail(gguf.path(), "tokenizer.ggml.model", kWithoutIcu); }
#endif

// Sentencepiece pieces spell a space as U+2581; the llama2.c-style tokenizer wants ' '.
std::string unescape_spaces(const std::string& piece) {
  static const std::string kSpaceMark = "\xE2\x96\x81";
  std::string out;
  for (std::size_t i = 0; i < piece.size();) {
    if (piece.compare(i, kSpaceMark.size(), kSpaceMark) == 0) {
      out += ' ';
      i += kSpaceMark.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

std::unique_ptr<Tokenizer> gguf_sentencepiece(const GgufFile& gguf) {
  const std::vector<std::string>& tokens = gguf.get_string_array("tokenizer.ggml.tokens");
  const std::vector<float> scores = gguf.get_f32_array("tokenizer.ggml.scores");
  if (scores.size() != tokens.size())
    fail(gguf.path(), "tokenizer.ggml.scores",
         std::to_string(scores.size()) + " entries for " + std::to_string(tokens.size()) + " tokens");
  const std::vector<std::int32_t> types = token_types(gguf, tokens.size());
  std::vector<Llama2cTokenizer::Piece> pieces(tokens.size());
  for (std::size_t id = 0; id < tokens.size(); ++id) {
    pieces[id].text = unescape_spaces(tokens[id]);
    pieces[id].score = scores[id];
    const std::int32_t type = types[id];
    pieces[id].kind = type == kTypeByte ? Llama2cTokenizer::PieceKind::Byte
                      : type == kTypeControl || type == kTypeUnknown || type == kTypeUnused
                          ? Llama2cTokenizer::PieceKind::Control
                          : Llama2cTokenizer::PieceKind::Normal;
  }
  return Llama2cTokenizer::from_pieces(std::move(pieces), optional_id(gguf, "tokenizer.ggml.bos_token_id"),
                                       optional_id(gguf, "tokenizer.ggml.eos_token_id"),
                                       optional_id(gguf, "tokenizer.ggml.unknown_token_id"),
                                       gguf.get_bool("tokenizer.ggml.add_space_prefix", true), gguf.path(),
                                       "tokenizer.ggml.tokens");
}

std::unique_ptr<Tokenizer> load_gguf(const std::string& path) {
  const GgufFile gguf = GgufFile::open(path);
  const std::string& model = gguf.get_string("tokenizer.ggml.model");
  std::unique_ptr<Tokenizer> tokenizer;
  if (model == "gpt2") tokenizer = gguf_bpe(gguf);
  else if (model == "llama") tokenizer = gguf_sentencepiece(gguf);
  else fail(path, "tokenizer.ggml.model", "'" + model + "' is not supported (gpt2, llama)");
  // llama.cpp's default: sentencepiece vocabularies add BOS, byte-level BPE ones do not.
  tokenizer->set_adds_bos(gguf.get_bool("tokenizer.ggml.add_bos_token", model == "llama"));
  return tokenizer;
}

#if KVBOUND_WITH_ICU
std::string read_text(const std::string& path) {
  const std::shared_ptr<const MappedFile> file = MappedFile::open(path);
  return std::string(reinterpret_cast<const char*>(file->data()), file->size());
}

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path) {
  const std::string text = read_text(path);
  // bos_token / eos_token live in the tokenizer_config.json that transformers writes beside it.
  const fs::path config = fs::path(path).parent_path() / "tokenizer_config.json";
  const std::string config_text = fs::is_regular_file(config) ? read_text(config.string()) : std::string();
  return BpeTokenizer::from_tokenizer_json(text, path, config_text);
}
#else
std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path) { fail(path, "", kWithoutIcu); }
#endif

std::string lowercase_extension(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext;
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  const std::string ext = lowercase_extension(path);
  if (ext == ".json") return load_tokenizer_json(path);
  if (ext == ".gguf") return load_gguf(path);
  const std::shared_ptr<const MappedFile> file = MappedFile::open(path);
  auto tokenizer = Llama2cTokenizer::from_bin(file->data(), file->size(), path);
  tokenizer->set_adds_bos(true);  // run.c always encodes with BOS
  return tokenizer;
}

std::string find_tokenizer_beside(const std::string& model_path) {
  std::error_code ec;
  const fs::file_status status = fs::status(model_path, ec);
  if (!fs::exists(status)) fail(model_path, "", "no such file or folder");
  if (fs::is_regular_file(status) && lowercase_extension(model_path) == ".gguf") return model_path;
  fs::path folder = fs::is_directory(status) ? fs::path(model_path) : fs::path(model_path).parent_path();
  if (folder.empty()) folder = ".";
  for (const char* name : {"tokenizer.json", "tokenizer.bin"})
    if (fs::is_regular_file(folder / name)) return (folder / name).string();
  std::vector<std::string> candidates;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.rfind("tok", 0) == 0 && lowercase_extension(name) == ".bin")
      candidates.push_back(entry.path().string());
  }
  if (ec) fail(folder.string(), "", "cannot list the folder: " + ec.message());
  std::sort(candidates.begin(), candidates.end());
  if (candidates.size() == 1) return candidates[0];
  if (candidates.size() > 1)
    fail(folder.string(), "", "several tok*.bin tokenizers (" + candidates[0] + ", " + candidates[1] +
                                  ", ...); pass one with --tokenizer");
  fail(folder.string(), "", "no tokenizer found (looked for tokenizer.json, tokenizer.bin, tok*.bin)");
}

}  // namespace kvbound
