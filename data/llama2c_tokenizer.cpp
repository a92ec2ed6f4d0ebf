#include "data/llama2c_tokenizer.h"
#include "base/fnv1a.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "base/errors.h"

namespace kvbound {
namespace {

constexpr std::uint32_t kMaxTokenLengthLimit = 1u << 20;  // far above any real vocabulary
// run.c starts its best-score search at -1e10, so a pair scoring that low or lower never merges.
constexpr float kNoMergeScore = -1e10f;

// The byte of a "<0xHH>" piece, or -1.
int fallback_byte(std::string_view text) {
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return -1;
  int value = 0;
  for (char c : text.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') value |= c - '0';
    else if (c >= 'A' && c <= 'F') value |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') value |= c - 'a' + 10;
    else return -1;
  }
  return value;
}

// Little-endian reads with bounds checks that name the field.
class BinReader {
 public:
  BinReader(const std::uint8_t* data, std::size_t size, const std::string& origin)
      : data_(data), size_(size), origin_(origin) {}
  std::size_t left() const { return size_ - pos_; }
  void need(std::size_t n, const std::string& field) const {
    if (left() < n)
      fail(origin_, field, "truncated: needs " + std::to_string(n) + " bytes, " + std::to_string(left()) + " left");
  }
  std::uint32_t u32(const std::string& field) {
    need(4, field);
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(data_[pos_ + i]) << (8 * i);
    pos_ += 4;
    return v;
  }
  float f32(const std::string& field) {
    const std::uint32_t bits = u32(field);
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  std::string bytes(std::size_t n, const std::string& field) {
    need(n, field);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  const std::string& origin_;
};

}  // namespace

std::unique_ptr<Llama2cTokenizer> Llama2cTokenizer::from_bin(const std::uint8_t* data, std::size_t size,
                                                             const std::string& origin, std::int64_t vocab_size) {
  BinReader in(data, size, origin);
  const std::uint32_t max_token_length = in.u32("max_token_length");
  if (max_token_length == 0 || max_token_length > kMaxTokenLengthLimit)
    fail(origin, "max_token_length", std::to_string(max_token_length) + " is not a plausible piece length");
  std::unique_ptr<Llama2cTokenizer> t(new Llama2cTokenizer());
  t->origin_ = origin;
  for (std::int64_t i = 0; vocab_size > 0 ? i < vocab_size : in.left() > 0; ++i) {
    const std::string field = "piece[" + std::to_string(i) + "]";
    Piece piece;
    piece.score = in.f32(field + ".score");
    if (!std::isfinite(piece.score)) fail(origin, field + ".score", "not a finite number");
    const auto length = static_cast<std::int32_t>(in.u32(field + ".length"));
    if (length < 0) fail(origin, field + ".length", "negative (" + std::to_string(length) + ")");
    if (static_cast<std::uint32_t>(length) > max_token_length)
      fail(origin, field + ".length",
           std::to_string(length) + " exceeds max_token_length " + std::to_string(max_token_length));
    piece.text = in.bytes(static_cast<std::size_t>(length), field + ".text");
    t->pieces_.push_back(std::move(piece));
  }
  if (in.left() > 0)
    fail(origin, "vocab_size", std::to_string(in.left()) + " bytes follow the last of " + std::to_string(vocab_size) +
                                   " pieces (wrong vocabulary size?)");
  // llama2.c's exporter writes sentencepiece's <unk>, <s>, </s> first and the 256 byte pieces next.
  if (t->pieces_.size() < 259)
    fail(origin, "vocab_size", std::to_string(t->pieces_.size()) + " pieces; a llama2.c vocabulary has at least 259 "
                               "(<unk>, BOS, EOS and 256 byte pieces)");
  for (std::size_t id = 0; id < 3; ++id) t->pieces_[id].kind = PieceKind::Control;
  for (std::size_t id = 3; id < t->pieces_.size(); ++id)
    if (fallback_byte(t->pieces_[id].text) >= 0) t->pieces_[id].kind = PieceKind::Byte;
  for (int b = 0; b < 256; ++b) {
    const std::size_t id = static_cast<std::size_t>(b) + 3;
    if (fallback_byte(t->pieces_[id].text) != b)
      fail(origin, "piece[" + std::to_string(id) + "]", "expected the byte piece for 0x" + std::to_string(b) +
                                                          " (run.c falls back to byte + 3)");
    t->byte_id_[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(id);
  }
  t->bos_id_ = 1;
  t->eos_id_ = 2;
  t->unk_id_ = 0;
  t->add_dummy_prefix_ = true;
  t->finish("piece");
  return t;
}

std::unique_ptr<Llama2cTokenizer> Llama2cTokenizer::from_pieces(std::vector<Piece> pieces, std::int64_t bos_id,
                                                                std::int64_t eos_id, std::int64_t unk_id,
                                                                bool add_dummy_prefix, const std::string& origin,
                                                                const std::string& field) {
  std::unique_ptr<Llama2cTokenizer> t(new Llama2cTokenizer());
  t->origin_ = origin;
  t->pieces_ = std::move(pieces);
  t->bos_id_ = bos_id;
  t->eos_id_ = eos_id;
  t->unk_id_ = unk_id;
  t->add_dummy_prefix_ = add_dummy_prefix;
  t->byte_id_.fill(-1);
  for (std::size_t id = 0; id < t->pieces_.size(); ++id) {
    const Piece& piece = t->pieces_[id];
    if (!std::isfinite(piece.score)) fail(origin, field + "[" + std::to_string(id) + "]", "score is not finite");
    if (piece.kind != PieceKind::Byte) continue;
    const int b = fallback_byte(piece.text);
    if (b < 0) fail(origin, field + "[" + std::to_string(id) + "]", "a byte piece must read <0xHH>");
    if (t->byte_id_[static_cast<std::size_t>(b)] < 0) t->byte_id_[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    if (t->byte_id_[static_cast<std::size_t>(b)] >= 0) continue;
    if (unk_id < 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      fail(origin, field, std::string("no byte piece ") + hex + " and no unknown token to stand for it");
    }
    t->byte_id_[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(unk_id);
  }
  t->finish(field);
  return t;
}

void Llama2cTokenizer::finish(const std::string& field) {
  const auto size = static_cast<std::int64_t>(pieces_.size());
  if (size > std::numeric_limits<std::int32_t>::max()) fail(origin_, field, "too many pieces");
  for (auto [id, name] : {std::pair{bos_id_, "bos"}, std::pair{eos_id_, "eos"}, std::pair{unk_id_, "unknown"}})
    if (id < -1 || id >= size)
      fail(origin_, field, std::string(name) + " id " + std::to_string(id) + " is outside the " +
                               std::to_string(size) + " pieces");
  Fnv1a hash;
  decoded_.resize(pieces_.size());
  id_of_text_.reserve(pieces_.size());
  for (std::size_t id = 0; id < pieces_.size(); ++id) {
    const Piece& piece = pieces_[id];
    switch (piece.kind) {
      case PieceKind::Normal:
        decoded_[id] = piece.text;
        if (!piece.text.empty()) id_of_text_.emplace(piece.text, static_cast<std::int32_t>(id));
        break;
      case PieceKind::Byte:
        decoded_[id] = std::string(1, static_cast<char>(fallback_byte(piece.text)));
        break;
      case PieceKind::Control:
        break;
    }
    std::uint32_t score_bits;
    std::memcpy(&score_bits, &piece.score, sizeof score_bits);
    hash.add(piece.text);
    hash.add_u64(score_bits);
    hash.add_u64(static_cast<std::uint64_t>(piece.kind));
  }
  hash.add_u64(static_cast<std::uint64_t>(bos_id_));
  hash.add_u64(static_cast<std::uint64_t>(eos_id_));
  hash.add_u64(static_cast<std::uint64_t>(unk_id_));
  hash.add_u64(add_dummy_prefix_ ? 1 : 0);
  identity_ = "llama2c:" + hash.hex();
}

std::vector<std::int64_t> Llama2cTokenizer::encode(std::string_view text, bool add_bos) const {
  if (text.size() >= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max() - 1))
    fail(origin_, "encode", "text of " + std::to_string(text.size()) + " bytes is too long to encode at once");
  std::string prefixed;
  if (add_dummy_prefix_ && !text.empty()) {
    prefixed.reserve(text.size() + 1);
    prefixed += ' ';
    prefixed += text;
    text = prefixed;
  }

  struct Symbol {
    std::int32_t id, prev, next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  auto push = [&](std::int32_t id) {
    const auto index = static_cast<std::int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  };
  // run.c's grouping: a lead byte starts a code point, up to 3 continuation bytes join it.
  std::string code_point;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if ((c & 0xC0) != 0x80) code_point.clear();
    code_point += static_cast<char>(c);
    if (i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80 && code_point.size() < 4)
      continue;
    auto it = id_of_text_.find(code_point);
    if (it != id_of_text_.end()) {
      push(it->second);
    } else {
      for (unsigned char b : code_point) push(byte_id_[b]);
    }
    code_point.clear();
  }
  if (!symbols.empty()) symbols.back().next = -1;

  // The pair merged next is the best-scoring one, leftmost on ties: run.c's full rescan per merge,
  // done with a priority queue. Entries whose pair changed since they were queued are skipped.
  struct Candidate {
    float score;
    std::int32_t left, left_id, right_id, merged_id;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.score != b.score ? a.score < b.score : a.left > b.left;
  };
  std::vector<Candidate> queue;
  std::string joined;
  auto consider = [&](std::int32_t left) {
    const std::int32_t right = symbols[static_cast<std::size_t>(left)].next;
    if (right < 0) return;
    const std::int32_t left_id = symbols[static_cast<std::size_t>(left)].id;
    const std::int32_t right_id = symbols[static_cast<std::size_t>(right)].id;
    joined = pieces_[static_cast<std::size_t>(left_id)].text;
    joined += pieces_[static_cast<std::size_t>(right_id)].text;
    auto it = id_of_text_.find(joined);
    if (it == id_of_text_.end()) return;
    const float score = pieces_[static_cast<std::size_t>(it->second)].score;
    if (!(score > kNoMergeScore)) return;
    queue.push_back({score, left, left_id, right_id, it->second});
    std::push_heap(queue.begin(), queue.end(), worse);
  };
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i) consider(static_cast<std::int32_t>(i));
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), worse);
    const Candidate top = queue.back();
    queue.pop_back();
    Symbol& left = symbols[static_cast<std::size_t>(top.left)];
    if (!left.alive || left.id != top.left_id || left.next < 0) continue;
    Symbol& right = symbols[static_cast<std::size_t>(left.next)];
    if (right.id != top.right_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[static_cast<std::size_t>(left.next)].prev = top.left;
    if (left.prev >= 0) consider(left.prev);
    consider(top.left);
  }

  std::vector<std::int64_t> ids;
  ids.reserve(symbols.size() + 1);
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  for (std::int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next)
    ids.push_back(symbols[static_cast<std::size_t>(i)].id);
  return ids;
}

std::string Llama2cTokenizer::decode(const std::vector<std::int64_t>& ids) const {
  std::string out;
  std::int64_t previous = -1;
  for (std::int64_t id : ids) {
    if (id < 0 || id >= vocab_size())
      fail(origin_, "decode", "token id " + std::to_string(id) + " is not in the vocabulary of " +
                                  std::to_string(vocab_size()));
    const Piece& piece = pieces_[static_cast<std::size_t>(id)];
    const std::string& bytes = decoded_[static_cast<std::size_t>(id)];
    if (piece.kind == PieceKind::Normal && previous == bos_id_ && previous >= 0 && !bytes.empty() && bytes[0] == ' ') {
      out.append(bytes, 1, std::string::npos);
    } else {
      out += bytes;
    }
    previous = id;
  }
  return out;
}

}  // namespace kvbound
