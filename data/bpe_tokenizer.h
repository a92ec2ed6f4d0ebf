// Byte-level BPE with Hugging Face `tokenizers` semantics (GPT-2, SmolLM, Llama 3, Qwen2 styles).
// Pure C++17 + ICU + nlohmann-json: the tokenizer.json fuzz target compiles this file alone.
//
// encode: added tokens are cut out verbatim first (leftmost-longest, like HF's added vocabulary),
// the rest is normalized (NFC/NFD/NFKC/NFKD or nothing), pre-tokenized (Split / Digits / ByteLevel,
// regexes run by ICU) and every piece's bytes are merged by rank exactly as HF's BPE model does.
// decode: bytes of each token (ByteLevel decoder), special added tokens dropped.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace kvbound {

class BpeTokenizer final : public Tokenizer {
 public:
  // A token matched verbatim in the text before pre-tokenization (HF AddedToken).
  struct AddedToken {
    std::string content;
    std::int64_t id = 0;
    bool special = true;      // dropped by decode
    bool normalized = false;  // matched in the normalized text instead of the raw text
    bool lstrip = false;      // swallows the whitespace on its left
    bool rstrip = false;      // swallows the whitespace on its right
    bool single_word = false; // only matches when no word character touches it
  };

  // A vocabulary given as lists, the way a GGUF file (tokenizer.ggml.model = gpt2) stores it.
  struct Lists {
    std::vector<std::string> tokens;  // id = index; tokens not spelled in the byte alphabet are respelled
    std::vector<std::string> merges;  // "left right", best first
    std::vector<AddedToken> added;
    std::string pre_tokenizer_json;   // an HF tokenizer.json "pre_tokenizer" object
    std::int64_t bos_id = -1;
    std::int64_t eos_id = -1;
    std::string field_prefix;         // prepended to "tokens"/"merges" in error messages
  };

  // Parses the text of an HF tokenizer.json; `origin` names the file in errors. The optional text of
  // the tokenizer_config.json beside it supplies bos_token / eos_token when the post-processor has
  // no BOS. Throws kvbound::Error("origin: field: message") on anything malformed or unsupported.
  static std::unique_ptr<BpeTokenizer> from_tokenizer_json(std::string_view json_text, const std::string& origin,
                                                           std::string_view tokenizer_config_text = {});
  static std::unique_ptr<BpeTokenizer> from_lists(const Lists& lists, const std::string& origin);

  // True when every character of `token` is one of the 256 characters GPT-2 uses to spell bytes.
  static bool is_byte_level_spelling(std::string_view token);

  ~BpeTokenizer() override;
  std::vector<std::int64_t> encode(std::string_view text, bool add_bos) const override;
  std::string decode(const std::vector<std::int64_t>& ids) const override;
  std::int64_t vocab_size() const override;
  std::int64_t bos_id() const override;
  std::int64_t eos_id() const override;
  // "bpe:<fnv1a64>" over the vocabulary, merges, added tokens, normalizer, pre-tokenizer and BOS/EOS.
  std::string identity() const override;

  struct Impl;

 private:
  explicit BpeTokenizer(std::unique_ptr<const Impl> impl);
  std::unique_ptr<const Impl> impl_;
};

}  // namespace kvbound
