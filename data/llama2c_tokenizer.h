// Sentencepiece-style BPE by piece scores, as llama2.c's run.c encodes and decodes: the llama2.c
// tokenizer.bin format, and the same kind of vocabulary listed in a GGUF (tokenizer.ggml.model = llama).
// Pure C++17: the tokenizer.bin fuzz target compiles this file alone.
//
// encode: a dummy-prefix space before non-empty text, one symbol per UTF-8 code point (a code point
// that is not a piece falls back to its bytes' <0xHH> pieces), then repeatedly merge the adjacent
// pair whose concatenation is the highest-scoring piece (leftmost on ties) until none is left.
// decode: pieces concatenated, <0xHH> pieces as their byte, control pieces dropped, and the leading
// space of the piece right after BOS dropped.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"

namespace kvbound {

class Llama2cTokenizer final : public Tokenizer {
 public:
  enum class PieceKind : std::uint8_t {
    Normal,   // text; takes part in merges
    Byte,     // "<0xHH>": byte fallback
    Control,  // BOS/EOS/unknown/unused: never produced by encode, dropped by decode
  };
  struct Piece {
    std::string text;  // spaces spelled ' ' (not sentencepiece's U+2581)
    float score = 0.0f;
    PieceKind kind = PieceKind::Normal;
  };

  // Parses llama2.c tokenizer.bin bytes (u32 max_token_length, then per piece f32 score, i32 length,
  // bytes). vocab_size <= 0 reads pieces to the end of the data; otherwise exactly vocab_size pieces
  // must fill it. Ids 0/1/2 are <unk>/BOS/EOS and byte b falls back to id b + 3, as run.c assumes.
  // `origin` names the file in errors (kvbound::Error "origin: field: message").
  static std::unique_ptr<Llama2cTokenizer> from_bin(const std::uint8_t* data, std::size_t size,
                                                    const std::string& origin, std::int64_t vocab_size = 0);
  // A vocabulary given as lists (GGUF). Every byte needs a Byte piece "<0xHH>" unless unk_id >= 0,
  // which then stands for bytes without one. `field` names the list in errors.
  static std::unique_ptr<Llama2cTokenizer> from_pieces(std::vector<Piece> pieces, std::int64_t bos_id,
                                                       std::int64_t eos_id, std::int64_t unk_id,
                                                       bool add_dummy_prefix, const std::string& origin,
                                                       const std::string& field);

  std::vector<std::int64_t> encode(std::string_view text, bool add_bos) const override;
  std::string decode(const std::vector<std::int64_t>& ids) const override;
  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(pieces_.size()); }
  std::int64_t bos_id() const override { return bos_id_; }
  std::int64_t eos_id() const override { return eos_id_; }
  // "llama2c:<fnv1a64>" over the pieces, scores, kinds, BOS/EOS and the dummy-prefix flag.
  std::string identity() const override { return identity_; }

 private:
  Llama2cTokenizer() = default;
  // Validates ids and byte pieces, builds the lookup tables and the identity.
  void finish(const std::string& field);

  std::string origin_;
  std::vector<Piece> pieces_;
  std::vector<std::string> decoded_;                         // bytes each id decodes to
  std::unordered_map<std::string, std::int32_t> id_of_text_; // Normal pieces only; first id wins
  std::array<std::int32_t, 256> byte_id_{};                  // fallback id of each byte
  std::int64_t bos_id_ = -1;
  std::int64_t eos_id_ = -1;
  std::int64_t unk_id_ = -1;
  bool add_dummy_prefix_ = true;
  std::string identity_;
};

}  // namespace kvbound
