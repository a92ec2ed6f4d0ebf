// Text <-> token ids. Three formats behind one interface:
//  - Hugging Face tokenizer.json (byte-level BPE: GPT-2/SmolLM/Llama-3/Qwen style pre-tokenizers)
//  - the vocabulary embedded in a GGUF file (tokenizer.ggml.model = gpt2 or llama)
//  - llama2.c's tokenizer.bin (sentencepiece-like pieces with scores, byte fallback)
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvbound {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`; BOS first when add_bos (and the tokenizer has one).
  virtual std::vector<std::int64_t> encode(std::string_view text, bool add_bos) const = 0;
  // Bytes of a token sequence (special tokens such as BOS are dropped).
  virtual std::string decode(const std::vector<std::int64_t>& ids) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  virtual std::int64_t bos_id() const = 0;  // -1 when none
  virtual std::int64_t eos_id() const = 0;  // -1 when none
  // Stable identity (format + hash of the vocabulary) so datasets can refuse another tokenizer.
  virtual std::string identity() const = 0;

  // Whether this tokenizer's own convention starts every text with BOS (llama2.c: always; GGUF:
  // tokenizer.ggml.add_bos_token; tokenizer.json: a BOS in the post-processor template, or
  // add_bos_token in the tokenizer_config.json beside it). `generate` follows it.
  bool adds_bos() const { return adds_bos_; }
  void set_adds_bos(bool adds_bos) { adds_bos_ = adds_bos; }

 private:
  bool adds_bos_ = false;
};

// Loads by path: "*.json" -> HF tokenizer.json, "*.gguf" -> GGUF vocabulary, otherwise llama2.c .bin.
// Throws kvbound::Error naming the file and field on any malformed input.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// The tokenizer that sits beside a model: for a folder, tokenizer.json then tok*.bin/tokenizer.bin;
// for a .gguf file, its embedded vocabulary. Throws when none is found.
std::string find_tokenizer_beside(const std::string& model_path);

}  // namespace kvbound
