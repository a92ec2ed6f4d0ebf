// Tokenizers against their references: llama2.c's run.c on stories260K's tok512.bin, and transformers /
// tokenizers on SmolLM2's GGUF vocabulary and tokenizer.json (plus Llama-3, Qwen2 and Split variants of
// it); round trips; and one-line errors naming the file and field for malformed files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "data/bpe_tokenizer.h"
#include "data/llama2c_tokenizer.h"
#include "data/tokenizer.h"
#include "test_env.h"

using namespace kvbound;
namespace fs = std::filesystem;
using Ids = std::vector<std::int64_t>;

namespace {

std::string tok512() { return test::asset("stories260K/tok512.bin"); }
std::string golden(const std::string& rel) { return test::test_data("tokenizer/" + rel); }

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return nlohmann::json::parse(in);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A fresh folder for files a test writes.
fs::path scratch_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = fs::path(::testing::TempDir()) / ("kvbound_tokenizer_" + std::string(info->test_suite_name()) + "_" +
                                                   info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  return path.string();
}

// Expects `load` to throw a one-line kvbound::Error that starts with "FILE: FIELD" and mentions `words`.
template <typename Load>
void expect_error(Load load, const std::string& file, const std::string& field, const std::string& words) {
  try {
    load();
    ADD_FAILURE() << "accepted input that should fail on " << field;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(file + ": " + field, 0), 0u) << msg;
    EXPECT_NE(msg.find(words), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// --- llama2.c tokenizer.bin ------------------------------------------------------------------

TEST(Llama2cTokenizer, EncodesLikeRunC) {
  KVBOUND_REQUIRE_FILE(tok512());
  const auto tok = load_tokenizer(tok512());
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->identity().rfind("llama2c:", 0), 0u);
  EXPECT_EQ(tok->encode("Once upon a time", true), (Ids{1, 403, 407, 261, 378}));
  EXPECT_EQ(tok->encode("Once upon a time", false), (Ids{403, 407, 261, 378}));
  // From a line-by-line Python port of run.c's encode (full rescan per merge).
  EXPECT_EQ(tok->encode("Lily's mom said, \"Hi!\"\nThe end.", true),
            (Ids{1, 317, 439, 419, 357, 336, 432, 313, 440, 417, 443, 436, 13, 434, 260, 344, 264, 426}));
  EXPECT_EQ(tok->encode("caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x99\x82", true),
            (Ids{1, 280, 412, 431, 485, 410, 233, 154, 168, 233, 159, 175, 410, 243, 162, 156, 133}));
  EXPECT_EQ(tok->encode("  two  spaces\tand tab", true),
            (Ids{1, 410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419, 12, 412, 264, 259, 412, 430}));
  EXPECT_EQ(tok->encode("", true), (Ids{1}));
  EXPECT_EQ(tok->encode("", false), (Ids{}));
}

TEST(Llama2cTokenizer, RoundTripsThroughDecode) {
  KVBOUND_REQUIRE_FILE(tok512());
  const auto tok = load_tokenizer(tok512());
  for (const std::string text :
       {"Once upon a time, there was a little girl named Lily.", "line one\nline two\n\n", " leading and trailing ",
        "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x99\x82", "tabs\tand\r\nCRLF", "", "x"}) {
    EXPECT_EQ(tok->decode(tok->encode(text, true)), text) << text;
  }
  // run.c drops the leading space only right after BOS; without BOS the dummy prefix stays.
  EXPECT_EQ(tok->decode(tok->encode("Once", false)), " Once");
  EXPECT_EQ(tok->decode({1, 2}), "");  // BOS/EOS decode to nothing
}

TEST(Llama2cTokenizer, GgufVocabularyEncodesLikeTheBin) {
  KVBOUND_REQUIRE_FILE(tok512());
  KVBOUND_REQUIRE_FILE(golden("stories260K_tok512.gguf"));
  const auto bin = load_tokenizer(tok512());
  const auto gguf = load_tokenizer(golden("stories260K_tok512.gguf"));
  EXPECT_EQ(gguf->identity(), bin->identity());
  EXPECT_EQ(gguf->vocab_size(), 512);
  for (const std::string text : {"Once upon a time", "Lily's mom said, \"Hi!\"\nThe end.", "caf\xC3\xA9 \xF0\x9F\x99\x82",
                                 "  two  spaces\tand tab"}) {
    const Ids ids = gguf->encode(text, true);
    EXPECT_EQ(ids, bin->encode(text, true)) << text;
    EXPECT_EQ(gguf->decode(ids), text) << text;
  }
}

// --- SmolLM2: GGUF vocabulary and tokenizer.json against transformers ----------------------

struct Case {
  std::string text;
  Ids ids;
};

std::vector<Case> smollm2_cases() {
  std::vector<Case> cases;
  for (const auto& c : read_json(golden("cases.json"))) cases.push_back({c["text"], c["ids"].get<Ids>()});
  return cases;
}

// The text with SmolLM2's special tokens removed: what decode gives back for it.
std::string without_special_tokens(std::string text) {
  for (const char* special : {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>"}) {
    for (std::size_t at; (at = text.find(special)) != std::string::npos;) text.erase(at, std::strlen(special));
  }
  return text;
}

void expect_matches_reference(const Tokenizer& tok, const std::vector<Case>& cases) {
  ASSERT_GE(cases.size(), 50u);
  for (const Case& c : cases) {
    const Ids ids = tok.encode(c.text, false);
    EXPECT_EQ(ids, c.ids) << "text: \"" << c.text << "\"";
    EXPECT_EQ(tok.decode(ids), without_special_tokens(c.text)) << "text: \"" << c.text << "\"";
  }
}

TEST(BpeTokenizer, SmolLM2GgufMatchesTransformers) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  KVBOUND_REQUIRE_FILE(golden("cases.json"));
  const auto tok = load_tokenizer(test::default_model());
  EXPECT_EQ(tok->vocab_size(), 49152);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  expect_matches_reference(*tok, smollm2_cases());
}

TEST(BpeTokenizer, SmolLM2TokenizerJsonMatchesTransformers) {
  KVBOUND_REQUIRE_FILE(golden("tokenizer.json"));
  const auto tok = load_tokenizer(golden("tokenizer.json"));
  EXPECT_EQ(tok->vocab_size(), 49152);
  EXPECT_EQ(tok->bos_id(), 1);  // from tokenizer_config.json beside it
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->identity().rfind("bpe:", 0), 0u);
  expect_matches_reference(*tok, smollm2_cases());
  EXPECT_EQ(tok->encode("Hi", true), (Ids{1, tok->encode("Hi", false)[0]}));
}

TEST(BpeTokenizer, GgufAndTokenizerJsonShareOneIdentity) {
  KVBOUND_REQUIRE_FILE(test::default_model());
  KVBOUND_REQUIRE_FILE(golden("tokenizer.json"));
  EXPECT_EQ(load_tokenizer(test::default_model())->identity(), load_tokenizer(golden("tokenizer.json"))->identity());
  KVBOUND_REQUIRE_FILE(golden("variants/llama3/tokenizer.json"));
  EXPECT_NE(load_tokenizer(golden("variants/llama3/tokenizer.json"))->identity(),
            load_tokenizer(golden("tokenizer.json"))->identity());
}

// The same vocabulary under the Llama-3 / Qwen2 / hub-SmolLM2 pre-tokenizers, NFC/NFKC, a BOS
// template, added-token options and every Split behaviour, each checked against `tokenizers`.
TEST(BpeTokenizer, VariantsMatchHuggingFaceTokenizers) {
  KVBOUND_REQUIRE_FILE(golden("variants.json"));
  const std::vector<Case> cases = smollm2_cases();
  const nlohmann::json variants = read_json(golden("variants.json"));
  ASSERT_GE(variants.size(), 9u);
  for (const auto& v : variants) {
    SCOPED_TRACE(v["name"].get<std::string>());
    const auto tok = load_tokenizer(golden(v["file"]));
    const auto ids = v["ids"].get<std::vector<Ids>>();
    const auto ids_with_bos = v["ids_with_bos"].get<std::vector<Ids>>();
    ASSERT_EQ(ids.size(), cases.size());
    for (std::size_t i = 0; i < cases.size(); ++i) {
      EXPECT_EQ(tok->encode(cases[i].text, false), ids[i]) << "text: \"" << cases[i].text << "\"";
      EXPECT_EQ(tok->encode(cases[i].text, true), ids_with_bos[i]) << "text: \"" << cases[i].text << "\"";
      if (v["roundtrip"].get<bool>()) {
        EXPECT_EQ(tok->decode(ids[i]), without_special_tokens(cases[i].text)) << cases[i].text;
      }
    }
  }
}

// --- hand-made tokenizer.json: features and errors -------------------------------------------

// Bytes 'a', 'b', ' ' (spelled "Ġ") and the merges a+b, Ġ+ab.
nlohmann::json tiny_tokenizer_json() {
  return {
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 5}, {"content", "<eos>"}, {"special", true}, {"normalized", false}},
        {{"id", 6}, {"content", "<sep>"}, {"special", false}, {"normalized", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"\xC4\xA0", 2}, {"ab", 3}, {"\xC4\xA0" "ab", 4}}},
        {"merges", {"a b", "\xC4\xA0 ab"}}}},
  };
}

TEST(BpeTokenizer, TinyTokenizerJson) {
  const auto tok = BpeTokenizer::from_tokenizer_json(tiny_tokenizer_json().dump(), "tiny.json");
  EXPECT_EQ(tok->vocab_size(), 7);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->encode("ab ab<eos>ba<sep>", true), (Ids{3, 4, 5, 1, 0, 6}));
  EXPECT_EQ(tok->decode({3, 4, 5, 1, 0, 6}), "ab abba<sep>");  // the special <eos> is dropped
  EXPECT_EQ(tok->encode("axb", false), (Ids{3}));  // bytes outside the vocabulary drop, as in HF, then a+b merge
  expect_error([&] { tok->decode({7}); }, "tiny.json", "decode", "not in the vocabulary");
}

TEST(BpeTokenizer, RejectsMalformedTokenizerJson) {
  const fs::path dir = scratch_dir();
  auto rejects = [&](const std::string& name, const std::string& text, const std::string& field,
                     const std::string& words) {
    const std::string path = write_file(dir / name, text);
    expect_error([&] { load_tokenizer(path); }, path, field, words);
  };
  rejects("bad.json", "{\"model\": {\"vocab\": ", "", "invalid JSON");
  auto without = [](const char* key) {
    nlohmann::json j = tiny_tokenizer_json();
    j["model"].erase(key);
    return j.dump();
  };
  rejects("no_vocab.json", without("vocab"), "model.vocab", "missing");
  rejects("no_merges.json", without("merges"), "model.merges", "missing");
  nlohmann::json j = tiny_tokenizer_json();
  j["model"]["merges"].push_back("a q");
  rejects("unknown_merge.json", j.dump(), "model.merges[2]", "'q' is not in the vocabulary");
  j = tiny_tokenizer_json();
  j["model"]["merges"].push_back("b a");
  rejects("unknown_result.json", j.dump(), "model.merges[2]", "'ba' is not in the vocabulary");
  j = tiny_tokenizer_json();
  j["model"]["vocab"]["b"] = -1;
  rejects("negative_id.json", j.dump(), "model.vocab.'b'", "outside");
  j = tiny_tokenizer_json();
  j["model"]["vocab"]["b"] = "one";
  rejects("string_id.json", j.dump(), "model.vocab.'b'", "expected an integer");
  j = tiny_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  rejects("metaspace.json", j.dump(), "pre_tokenizer.type", "not supported");
  j = tiny_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
                                           {{"type", "ByteLevel"}}}}};
  rejects("bad_regex.json", j.dump(), "pre_tokenizer.pretokenizers[0].pattern.Regex", "invalid regex");
  j = tiny_tokenizer_json();
  j["pre_tokenizer"] = {{"type", "Digits"}};
  rejects("no_byte_level.json", j.dump(), "pre_tokenizer", "ByteLevel");
  j = tiny_tokenizer_json();
  j["added_tokens"][0]["id"] = 0;
  rejects("added_id.json", j.dump(), "added_tokens[0].id", "belongs to the vocabulary's 'a'");
  j = tiny_tokenizer_json();
  j["model"]["byte_fallback"] = true;
  rejects("byte_fallback.json", j.dump(), "model.byte_fallback", "not supported");
  j = tiny_tokenizer_json();
  j["decoder"] = {{"type", "WordPiece"}};
  rejects("decoder.json", j.dump(), "decoder.type", "not supported");
}

TEST(BpeTokenizer, TokenizerConfigSuppliesBosAndEos) {
  const fs::path dir = scratch_dir();
  const std::string path = write_file(dir / "tokenizer.json", tiny_tokenizer_json().dump());
  write_file(dir / "tokenizer_config.json", R"({"bos_token": {"content": "<sep>"}, "eos_token": "<eos>"})");
  const auto tok = load_tokenizer(path);
  EXPECT_EQ(tok->bos_id(), 6);
  EXPECT_EQ(tok->eos_id(), 5);
  EXPECT_EQ(tok->encode("ab", true), (Ids{6, 3}));
  write_file(dir / "tokenizer_config.json", R"({"eos_token": "<nope>"})");
  expect_error([&] { load_tokenizer(path); }, path, "tokenizer_config.json: eos_token", "not in the vocabulary");
}

// --- malformed tokenizer.bin ---------------------------------------------------------------

std::string le32(std::uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

std::string record(float score, std::int32_t length, const std::string& text) {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof bits);
  return le32(bits) + le32(static_cast<std::uint32_t>(length)) + text;
}

TEST(Llama2cTokenizer, RejectsMalformedBin) {
  const fs::path dir = scratch_dir();
  auto rejects = [&](const std::string& name, const std::string& bytes, const std::string& field,
                     const std::string& words) {
    const std::string path = write_file(dir / name, bytes);
    expect_error([&] { load_tokenizer(path); }, path, field, words);
  };
  rejects("empty.bin", "", "max_token_length", "truncated");
  rejects("zero_max.bin", le32(0), "max_token_length", "plausible");
  rejects("negative.bin", le32(7) + record(0, -1, ""), "piece[0].length", "negative");
  rejects("huge.bin", le32(7) + record(0, 0x7fffffff, ""), "piece[0].length", "exceeds max_token_length 7");
  rejects("too_long.bin", le32(3) + record(0, 4, "abcd"), "piece[0].length", "exceeds max_token_length 3");
  rejects("short_text.bin", le32(7) + record(0, 5, "ab"), "piece[0].text", "truncated");
  rejects("short_record.bin", le32(7) + record(0, 1, "a") + "\x01\x02", "piece[1].score", "truncated");
  rejects("nan.bin", le32(7) + record(std::nanf(""), 1, "a"), "piece[0].score", "finite");
  rejects("few_pieces.bin", le32(7) + record(0, 1, "a"), "vocab_size", "at least 259");
  KVBOUND_REQUIRE_FILE(tok512());
  const std::string whole = read_bytes(tok512());
  rejects("truncated.bin", whole.substr(0, whole.size() - 3), "piece[511]", "truncated");
  expect_error([&] {
    Llama2cTokenizer::from_bin(reinterpret_cast<const std::uint8_t*>(whole.data()), whole.size(), "tok.bin", 500);
  }, "tok.bin", "vocab_size", "follow the last of 500 pieces");
  std::string swapped = whole;  // piece 3 must be <0x00>
  swapped.replace(swapped.find("<0x00>"), 6, "<0x01>");
  rejects("swapped.bin", swapped, "piece[3]", "byte piece");
  EXPECT_EQ(Llama2cTokenizer::from_bin(reinterpret_cast<const std::uint8_t*>(whole.data()), whole.size(), "tok.bin", 512)
                ->vocab_size(),
            512);
}

// --- finding the tokenizer beside a model ----------------------------------------------------

TEST(Tokenizer, FindsTheTokenizerBesideAModel) {
  const fs::path dir = scratch_dir();
  expect_error([&] { find_tokenizer_beside((dir / "missing").string()); }, (dir / "missing").string(), "",
               "no such file");
  expect_error([&] { find_tokenizer_beside(dir.string()); }, dir.string(), "", "no tokenizer found");
  write_file(dir / "model.safetensors", "");
  expect_error([&] { find_tokenizer_beside((dir / "model.safetensors").string()); }, dir.string(), "",
               "no tokenizer found");
  write_file(dir / "tok512.bin", "");
  EXPECT_EQ(find_tokenizer_beside(dir.string()), (dir / "tok512.bin").string());
  write_file(dir / "tok32000.bin", "");
  expect_error([&] { find_tokenizer_beside(dir.string()); }, dir.string(), "", "several tok*.bin");
  write_file(dir / "tokenizer.bin", "");
  EXPECT_EQ(find_tokenizer_beside(dir.string()), (dir / "tokenizer.bin").string());
  write_file(dir / "tokenizer.json", "");
  EXPECT_EQ(find_tokenizer_beside(dir.string()), (dir / "tokenizer.json").string());
  EXPECT_EQ(find_tokenizer_beside((dir / "model.safetensors").string()), (dir / "tokenizer.json").string());
  const std::string gguf = write_file(dir / "model.gguf", "");
  EXPECT_EQ(find_tokenizer_beside(gguf), gguf);
}

}  // namespace

TEST(Tokenizer, FollowsEachFormatsBosConvention) {
  const std::string tok512 = kvbound::test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok512);
  EXPECT_TRUE(kvbound::load_tokenizer(tok512)->adds_bos());  // run.c always starts with BOS
  KVBOUND_REQUIRE_FILE(kvbound::test::default_model());
  EXPECT_FALSE(kvbound::load_tokenizer(kvbound::test::default_model())->adds_bos());  // add_bos_token = false
}
