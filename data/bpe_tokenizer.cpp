#include "data/bpe_tokenizer.h"
#include "base/fnv1a.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/stringpiece.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/utext.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <utility>

#include "base/errors.h"

namespace kvbound {
namespace {

using nlohmann::json;

// HF ByteLevel's split regex (GPT-2).
constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// A user-supplied pattern that backtracks without end becomes an error instead of a hang; the unit
// is ICU's (roughly milliseconds), per single find().
constexpr std::int32_t kRegexTimeLimit = 2000;
constexpr int kMaxNesting = 16;  // Sequence inside Sequence inside ...

// ---------------------------------------------------------------------------------------------
// GPT-2's byte <-> character table: printable Latin-1 bytes stand for themselves, the other 68
// bytes move to U+0100.. so that every byte is spelled by one visible, non-space character.

struct ByteAlphabet {
  std::array<std::string, 256> spelling;   // UTF-8 of the character that spells each byte
  std::array<std::int16_t, 0x144> byte_of; // byte spelled by a character below U+0144, -1 if none
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.byte_of.fill(-1);
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const UChar32 c = printable ? b : 256 + shifted++;
      char utf8[4];
      int32_t n = 0;
      U8_APPEND_UNSAFE(utf8, n, c);
      a.spelling[b].assign(utf8, static_cast<std::size_t>(n));
      a.byte_of[static_cast<std::size_t>(c)] = static_cast<std::int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

// The bytes a byte-level spelling stands for; nullopt when a character is outside the alphabet.
std::optional<std::string> unspell(std::string_view token) {
  const ByteAlphabet& a = byte_alphabet();
  std::string bytes;
  const auto* s = reinterpret_cast<const std::uint8_t*>(token.data());
  const auto length = static_cast<int32_t>(token.size());
  for (int32_t i = 0; i < length;) {
    UChar32 c;
    U8_NEXT(s, i, length, c);
    if (c < 0 || c >= static_cast<UChar32>(a.byte_of.size()) || a.byte_of[static_cast<std::size_t>(c)] < 0)
      return std::nullopt;
    bytes.push_back(static_cast<char>(a.byte_of[static_cast<std::size_t>(c)]));
  }
  return bytes;
}

std::string spell(std::string_view bytes) {
  const ByteAlphabet& a = byte_alphabet();
  std::string out;
  for (unsigned char b : bytes) out += a.spelling[b];
  return out;
}

// HF's ByteLevel decoder: a token spelled in the alphabet is its bytes, any other token its own text.
std::string token_bytes(std::string_view token) {
  std::optional<std::string> bytes = unspell(token);
  return bytes ? std::move(*bytes) : std::string(token);
}

// ---------------------------------------------------------------------------------------------
// Unicode character classes used by the added-token options (Rust regex's \s and \w).

bool is_whitespace(UChar32 c) { return c >= 0 && u_isUWhiteSpace(c); }

bool is_word_char(UChar32 c) {
  if (c < 0) return false;
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) || u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL) ||
         (U_GET_GC_MASK(c) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0;
}

// The character that ends text[0, end) (at most 4 bytes back), or -1.
UChar32 char_before(std::string_view text, std::size_t end, std::size_t* start_of_char) {
  if (end == 0) return -1;
  const std::size_t window = std::min<std::size_t>(end, 4);
  const auto* s = reinterpret_cast<const std::uint8_t*>(text.data() + end - window);
  int32_t i = static_cast<int32_t>(window);
  UChar32 c;
  U8_PREV(s, 0, i, c);
  *start_of_char = end - window + static_cast<std::size_t>(i);
  return c;
}

UChar32 char_at(std::string_view text, std::size_t begin, std::size_t* end_of_char) {
  if (begin >= text.size()) return -1;
  const std::size_t window = std::min<std::size_t>(text.size() - begin, 4);
  const auto* s = reinterpret_cast<const std::uint8_t*>(text.data() + begin);
  int32_t i = 0;
  UChar32 c;
  U8_NEXT(s, i, static_cast<int32_t>(window), c);
  *end_of_char = begin + static_cast<std::size_t>(i);
  return c;
}

// ---------------------------------------------------------------------------------------------
// Added tokens, found the way HF's AddedVocabulary::find_matches does: leftmost-longest, then the
// single_word / lstrip / rstrip options.

struct Segment {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::int64_t id = -1;  // -1: plain text to pre-tokenize
};

class AddedTokenMatcher {
 public:
  // `text` is what is searched for: the content, or its normalized form for normalized tokens.
  void add(const BpeTokenizer::AddedToken& token, std::string text) {
    auto [it, inserted] = index_of_.emplace(text, entries_.size());
    Entry entry{std::move(text), token.id, token.lstrip, token.rstrip, token.single_word};
    if (inserted) {
      entries_.push_back(std::move(entry));
    } else {
      entries_[it->second] = std::move(entry);  // a later token with the same content wins, as in HF
    }
  }

  void finish() {
    for (std::size_t i = 0; i < entries_.size(); ++i)
      by_first_byte_[static_cast<unsigned char>(entries_[i].text[0])].push_back(static_cast<std::uint32_t>(i));
    for (auto& candidates : by_first_byte_)
      std::stable_sort(candidates.begin(), candidates.end(), [&](std::uint32_t a, std::uint32_t b) {
        return entries_[a].text.size() > entries_[b].text.size();
      });
  }

  bool empty() const { return entries_.empty(); }

  // Appends the segments of `text` (added tokens and the plain text between them) to `out`.
  void split(std::string_view text, std::vector<Segment>& out) const {
    std::size_t covered = 0;  // end of the last emitted segment
    std::size_t pos = 0;
    std::size_t start;
    while (const Entry* match = find_leftmost_longest(text, pos, &start)) {
      std::size_t stop = start + match->text.size();
      pos = stop;  // the search resumes after the match, whether or not it is kept
      if (match->single_word) {
        std::size_t unused;
        if (is_word_char(char_before(text, start, &unused)) || is_word_char(char_at(text, stop, &unused))) continue;
      }
      if (match->lstrip) {
        std::size_t char_start;
        while (start > covered && is_whitespace(char_before(text, start, &char_start)) && char_start >= covered)
          start = char_start;
      }
      if (match->rstrip) {
        std::size_t char_end;
        while (is_whitespace(char_at(text, stop, &char_end))) stop = char_end;
        pos = stop;  // keeps segments disjoint when a token could start inside the stripped space
      }
      if (covered < start) out.push_back({covered, start, -1});
      out.push_back({start, stop, match->id});
      covered = stop;
    }
    if (covered < text.size()) out.push_back({covered, text.size(), -1});
  }

 private:
  struct Entry {
    std::string text;
    std::int64_t id;
    bool lstrip, rstrip, single_word;
  };

  const Entry* find_leftmost_longest(std::string_view text, std::size_t from, std::size_t* start) const {
    for (std::size_t at = from; at < text.size(); ++at) {
      for (std::uint32_t i : by_first_byte_[static_cast<unsigned char>(text[at])]) {  // longest first
        if (text.compare(at, entries_[i].text.size(), entries_[i].text) == 0) {
          *start = at;
          return &entries_[i];
        }
      }
    }
    return nullptr;
  }

  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_of_;
  std::array<std::vector<std::uint32_t>, 256> by_first_byte_;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer steps. ByteLevel = optional prefix space + optional GPT-2 split; Digits and Split
// are regex splits. The byte-level spelling itself is implicit: BPE runs on each piece's bytes.

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct PreTokenizerStep {
  bool byte_level = false;
  bool add_prefix_space = false;
  std::unique_ptr<icu::RegexPattern> pattern;  // null: no split
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  std::string description;  // canonical form, part of the identity hash
};

// ICU's \s is [\t\n\f\r\p{Z}]; Oniguruma (HF's engine) uses Unicode White_Space, which adds \v and U+0085.
std::string icu_pattern(std::string_view onig_pattern) {
  std::string out;
  for (std::size_t i = 0; i < onig_pattern.size(); ++i) {
    const char c = onig_pattern[i];
    if (c == '\\' && i + 1 < onig_pattern.size()) {
      const char next = onig_pattern[++i];
      if (next == 's') {
        out += "\\p{White_Space}";
      } else if (next == 'S') {
        out += "\\P{White_Space}";
      } else {
        out += c;
        out += next;
      }
    } else {
      out += c;
    }
  }
  return out;
}

std::unique_ptr<icu::RegexPattern> compile_regex(std::string_view pattern, bool literal, const std::string& origin,
                                                 const std::string& field) {
  if (pattern.empty()) fail(origin, field, "empty pattern");
  const std::string source = literal ? std::string(pattern) : icu_pattern(pattern);
  UParseError parse_error{};
  UErrorCode status = U_ZERO_ERROR;
  std::unique_ptr<icu::RegexPattern> compiled(icu::RegexPattern::compile(
      icu::UnicodeString::fromUTF8(icu::StringPiece(source.data(), static_cast<int32_t>(source.size()))),
      literal ? UREGEX_LITERAL : 0, parse_error, status));
  if (U_FAILURE(status) || compiled == nullptr)
    fail(origin, field, std::string("invalid regex (") + u_errorName(status) + " at offset " +
                            std::to_string(parse_error.offset) + ")");
  return compiled;
}

// A piece of the text being pre-tokenized: a view into the input or into EncodeScratch::prefixed.
using Piece = std::string_view;

}  // namespace

// ---------------------------------------------------------------------------------------------

struct BpeTokenizer::Impl {
  struct MergeTarget {
    std::uint32_t rank;
    std::int32_t merged_id;
  };
  enum class IdKind : std::uint8_t { Unassigned, Ordinary, Special };

  std::string origin;
  std::array<std::int32_t, 256> byte_token{};  // id of each single-byte token, -1 when absent
  std::unordered_map<std::uint64_t, MergeTarget> merges;  // (left id << 32 | right id)
  std::int32_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::unordered_map<std::string, std::int32_t> whole_words;  // bytes -> id, only for ignore_merges
  AddedTokenMatcher raw_added;
  AddedTokenMatcher normalized_added;
  std::vector<const icu::Normalizer2*> normalizers;  // ICU singletons, not owned
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<std::string> bytes_of_id;
  std::vector<IdKind> kind_of_id;
  std::int64_t bos_id = -1;
  std::int64_t eos_id = -1;
  std::string identity;

  static std::uint64_t pair_key(std::int32_t left, std::int32_t right) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(left)) << 32) | static_cast<std::uint32_t>(right);
  }
  const MergeTarget* find_merge(std::int32_t left, std::int32_t right) const {
    auto it = merges.find(pair_key(left, right));
    return it == merges.end() ? nullptr : &it->second;
  }
};

namespace {

using Impl = BpeTokenizer::Impl;

// ---------------------------------------------------------------------------------------------
// Encoding.

struct EncodeScratch {
  std::vector<std::unique_ptr<icu::RegexMatcher>> matchers;  // one per pre-tokenizer step (null: no split)
  std::deque<std::string> prefixed;                           // pieces that got a prefix space
  std::vector<Piece> pieces, next_pieces;
  struct Range {
    std::size_t begin, end;
    bool flag;  // is_match, then "remove" after the behavior is applied
  };
  std::vector<Range> ranges, kept;
  struct Symbol {
    std::int32_t id, prev, next;
    bool alive;
  };
  struct Candidate {
    std::uint32_t rank;
    std::int32_t pos, merged_id;
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> queue;
  std::string normalized, renormalized;
};

void regex_failed(const Impl& impl, UErrorCode status) {
  fail(impl.origin, "pre_tokenizer", std::string("regex match failed (") + u_errorName(status) + ")");
}

// HF NormalizedString::split: matches and gaps, optionally inverted, combined by `behavior`.
void split_piece(const Impl& impl, const PreTokenizerStep& step, icu::RegexMatcher& matcher, Piece piece,
                 EncodeScratch& s) {
  UErrorCode status = U_ZERO_ERROR;
  UText text = UTEXT_INITIALIZER;
  utext_openUTF8(&text, piece.data(), static_cast<int64_t>(piece.size()), &status);
  matcher.reset(&text);
  utext_close(&text);
  s.ranges.clear();
  std::size_t previous_end = 0;
  while (matcher.find(status)) {
    const auto begin = static_cast<std::size_t>(matcher.start64(status));
    const auto end = static_cast<std::size_t>(matcher.end64(status));
    if (previous_end != begin) s.ranges.push_back({previous_end, begin, false});
    s.ranges.push_back({begin, end, true});
    previous_end = end;
  }
  if (U_FAILURE(status)) regex_failed(impl, status);
  if (previous_end != piece.size()) s.ranges.push_back({previous_end, piece.size(), false});
  if (step.invert)
    for (auto& r : s.ranges) r.flag = !r.flag;

  s.kept.clear();
  bool previous_match = false;
  switch (step.behavior) {
    case SplitBehavior::Isolated:
      for (const auto& r : s.ranges) s.kept.push_back({r.begin, r.end, false});
      break;
    case SplitBehavior::Removed:
      s.kept = s.ranges;
      break;
    case SplitBehavior::Contiguous:
      for (const auto& r : s.ranges) {
        if (r.flag == previous_match && !s.kept.empty()) {
          s.kept.back().end = r.end;
        } else {
          s.kept.push_back({r.begin, r.end, false});
        }
        previous_match = r.flag;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const auto& r : s.ranges) {
        if (r.flag && !previous_match && !s.kept.empty()) {
          s.kept.back().end = r.end;
        } else {
          s.kept.push_back({r.begin, r.end, false});
        }
        previous_match = r.flag;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto r = s.ranges.rbegin(); r != s.ranges.rend(); ++r) {
        if (r->flag && !previous_match && !s.kept.empty()) {
          s.kept.back().begin = r->begin;
        } else {
          s.kept.push_back({r->begin, r->end, false});
        }
        previous_match = r->flag;
      }
      std::reverse(s.kept.begin(), s.kept.end());
      break;
  }
  for (const auto& r : s.kept)
    if (!r.flag && r.end > r.begin) s.next_pieces.push_back(piece.substr(r.begin, r.end - r.begin));
}

// HF's BPE::merge_word + Word::merge_all on the bytes of one piece, ids appended to `out`.
void bpe_piece(const Impl& impl, Piece piece, EncodeScratch& s, std::vector<std::int64_t>& out) {
  if (impl.ignore_merges) {
    auto it = impl.whole_words.find(std::string(piece));
    if (it != impl.whole_words.end()) {
      out.push_back(it->second);
      return;
    }
  }
  auto& symbols = s.symbols;
  symbols.clear();
  bool previous_unknown = false;
  for (unsigned char b : piece) {
    std::int32_t id = impl.byte_token[b];
    if (id < 0) {
      if (impl.unk_id < 0) continue;  // HF drops characters it cannot spell when there is no unk token
      if (impl.fuse_unk && previous_unknown) continue;
      id = impl.unk_id;
      previous_unknown = true;
    } else {
      previous_unknown = false;
    }
    const auto index = static_cast<std::int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Lowest rank first, then leftmost.
  auto later = [](const EncodeScratch::Candidate& a, const EncodeScratch::Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  auto& queue = s.queue;
  queue.clear();
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
    if (const auto* m = impl.find_merge(symbols[i].id, symbols[i + 1].id))
      queue.push_back({m->rank, static_cast<std::int32_t>(i), m->merged_id});
  std::make_heap(queue.begin(), queue.end(), later);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), later);
    const EncodeScratch::Candidate top = queue.back();
    queue.pop_back();
    auto& left = symbols[static_cast<std::size_t>(top.pos)];
    if (!left.alive || left.next < 0) continue;
    auto& right = symbols[static_cast<std::size_t>(left.next)];
    // A stale entry is recognised, as in HF, by the pair no longer merging into the same token.
    const auto* current = impl.find_merge(left.id, right.id);
    if (current == nullptr || current->merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[static_cast<std::size_t>(left.next)].prev = top.pos;
    if (left.prev >= 0) {
      if (const auto* m = impl.find_merge(symbols[static_cast<std::size_t>(left.prev)].id, left.id)) {
        queue.push_back({m->rank, left.prev, m->merged_id});
        std::push_heap(queue.begin(), queue.end(), later);
      }
    }
    if (left.next >= 0) {
      if (const auto* m = impl.find_merge(left.id, symbols[static_cast<std::size_t>(left.next)].id)) {
        queue.push_back({m->rank, top.pos, m->merged_id});
        std::push_heap(queue.begin(), queue.end(), later);
      }
    }
  }
  for (std::int32_t i = 0; i >= 0; i = symbols[static_cast<std::size_t>(i)].next)
    out.push_back(symbols[static_cast<std::size_t>(i)].id);
}

void pre_tokenize_and_merge(const Impl& impl, std::string_view text, EncodeScratch& s, std::vector<std::int64_t>& out) {
  if (text.empty()) return;
  s.pieces.assign(1, text);
  s.prefixed.clear();
  for (std::size_t k = 0; k < impl.pre_tokenizer.size(); ++k) {
    const PreTokenizerStep& step = impl.pre_tokenizer[k];
    s.next_pieces.clear();
    for (Piece piece : s.pieces) {
      if (step.add_prefix_space && piece.front() != ' ') {
        s.prefixed.push_back(" " + std::string(piece));
        piece = s.prefixed.back();
      }
      if (step.pattern) {
        split_piece(impl, step, *s.matchers[k], piece, s);
      } else {
        s.next_pieces.push_back(piece);
      }
    }
    std::swap(s.pieces, s.next_pieces);
  }
  for (Piece piece : s.pieces) bpe_piece(impl, piece, s, out);
}

std::string normalize(const Impl& impl, const icu::Normalizer2& normalizer, std::string_view text) {
  if (text.size() > static_cast<std::size_t>(INT32_MAX))
    fail(impl.origin, "normalizer", "text of " + std::to_string(text.size()) + " bytes is too long to normalize at once");
  std::string out;
  icu::StringByteSink<std::string> sink(&out);
  UErrorCode status = U_ZERO_ERROR;
  normalizer.normalizeUTF8(0, icu::StringPiece(text.data(), static_cast<int32_t>(text.size())), sink, nullptr,
                           status);
  if (U_FAILURE(status)) fail(impl.origin, "normalizer", std::string("normalization failed: ") + u_errorName(status));
  return out;
}

// Normalizes one stretch of raw text, cuts out normalized added tokens, pre-tokenizes and merges the rest.
void encode_plain(const Impl& impl, std::string_view text, EncodeScratch& s, std::vector<std::int64_t>& out) {
  std::string_view normalized = text;
  for (const icu::Normalizer2* n : impl.normalizers) {
    s.renormalized = normalize(impl, *n, normalized);
    std::swap(s.normalized, s.renormalized);
    normalized = s.normalized;
  }
  if (impl.normalized_added.empty()) {
    pre_tokenize_and_merge(impl, normalized, s, out);
    return;
  }
  std::vector<Segment> segments;
  impl.normalized_added.split(normalized, segments);
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
    } else {
      pre_tokenize_and_merge(impl, normalized.substr(seg.begin, seg.end - seg.begin), s, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Identity: FNV-1a 64 over a canonical serialization.

// ---------------------------------------------------------------------------------------------
// Loading. Every check names the origin and the JSON path of the field.

struct Loader {
  const std::string& origin;

  [[noreturn]] void error(const std::string& field, const std::string& message) const { fail(origin, field, message); }

  // The member `key` of object `obj`, or null when it is absent or JSON null.
  const json* member(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const json& require(const json& obj, const char* key, const std::string& field) const {
    const json* v = member(obj, key);
    if (v == nullptr) error(field, "missing");
    return *v;
  }
  const json& object(const json& v, const std::string& field) const {
    if (!v.is_object()) error(field, std::string("expected an object, found ") + v.type_name());
    return v;
  }
  const json& array(const json& v, const std::string& field) const {
    if (!v.is_array()) error(field, std::string("expected an array, found ") + v.type_name());
    return v;
  }
  const std::string& string(const json& v, const std::string& field) const {
    if (!v.is_string()) error(field, std::string("expected a string, found ") + v.type_name());
    return v.get_ref<const std::string&>();
  }
  bool boolean(const json& obj, const char* key, const std::string& field, bool fallback) const {
    const json* v = member(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) error(field, std::string("expected true or false, found ") + v->type_name());
    return v->get<bool>();
  }
  std::int64_t integer(const json& v, const std::string& field) const {
    if (!v.is_number_integer()) error(field, std::string("expected an integer, found ") + v.type_name());
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))
      error(field, "integer out of range");
    return v.get<std::int64_t>();
  }
  // A token for an error message: short, control bytes escaped so the message stays one line.
  static std::string quoted(std::string_view s) {
    constexpr std::size_t kShown = 40;
    std::string out = "'";
    for (unsigned char c : s.substr(0, kShown)) {
      if (c < 0x20 || c == 0x7F) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "\\x%02X", c);
        out += hex;
      } else {
        out += static_cast<char>(c);
      }
    }
    return out + (s.size() > kShown ? "...'" : "'");
  }
};

// What both sources (tokenizer.json, lists) give to the common assembly step.
struct Model {
  std::vector<std::pair<std::string, std::int64_t>> vocab;  // byte-level spelling, id
  std::vector<std::pair<std::string, std::string>> merges;  // best first
  std::vector<std::string> merge_fields;                    // error names of each merge
  std::string vocab_field;
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::vector<BpeTokenizer::AddedToken> added;
  std::vector<std::string> added_fields;
  std::vector<std::string> normalizer_names;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::optional<std::string> bos_token, eos_token;  // by content, looked up after the vocabulary
  std::string bos_field, eos_field;
  std::int64_t bos_id = -1, eos_id = -1;            // by id
};

const icu::Normalizer2* icu_normalizer(const Loader& in, const std::string& name, const std::string& field) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  if (name == "NFC") n = icu::Normalizer2::getNFCInstance(status);
  else if (name == "NFD") n = icu::Normalizer2::getNFDInstance(status);
  else if (name == "NFKC") n = icu::Normalizer2::getNFKCInstance(status);
  else if (name == "NFKD") n = icu::Normalizer2::getNFKDInstance(status);
  else in.error(field, "normalizer '" + name + "' is not supported (NFC, NFD, NFKC, NFKD, Sequence)");
  if (U_FAILURE(status) || n == nullptr) in.error(field, std::string("ICU has no ") + name + ": " + u_errorName(status));
  return n;
}

void parse_normalizer(const Loader& in, const json& j, const std::string& field, int depth, Model& m) {
  if (depth > kMaxNesting) in.error(field, "nested too deeply");
  in.object(j, field);
  const std::string& type = in.string(in.require(j, "type", field + ".type"), field + ".type");
  if (type == "Sequence") {
    const json& list = in.array(in.require(j, "normalizers", field + ".normalizers"), field + ".normalizers");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_normalizer(in, list[i], field + ".normalizers[" + std::to_string(i) + "]", depth + 1, m);
    return;
  }
  icu_normalizer(in, type, field + ".type");
  m.normalizer_names.push_back(type);
}

SplitBehavior split_behavior(const Loader& in, const std::string& name, const std::string& field) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  in.error(field, "unknown behavior '" + name + "'");
}

void parse_pre_tokenizer(const Loader& in, const json& j, const std::string& field, int depth,
                         std::vector<PreTokenizerStep>& steps) {
  if (depth > kMaxNesting) in.error(field, "nested too deeply");
  in.object(j, field);
  const std::string& type = in.string(in.require(j, "type", field + ".type"), field + ".type");
  if (type == "Sequence") {
    const json& list = in.array(in.require(j, "pretokenizers", field + ".pretokenizers"), field + ".pretokenizers");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(in, list[i], field + ".pretokenizers[" + std::to_string(i) + "]", depth + 1, steps);
    return;
  }
  PreTokenizerStep step;
  if (type == "ByteLevel") {
    // HF's defaults when the fields are absent: add_prefix_space true, use_regex true.
    step.byte_level = true;
    step.add_prefix_space = in.boolean(j, "add_prefix_space", field + ".add_prefix_space", true);
    const bool use_regex = in.boolean(j, "use_regex", field + ".use_regex", true);
    if (use_regex) step.pattern = compile_regex(kGpt2Regex, false, in.origin, field);
    step.description = std::string("ByteLevel prefix=") + (step.add_prefix_space ? "1" : "0") +
                       " regex=" + (use_regex ? "1" : "0");
  } else if (type == "Digits") {
    const bool individual = in.boolean(j, "individual_digits", field + ".individual_digits", false);
    // HF splits on char::is_numeric (Nd, Nl, No) = \p{N}.
    step.pattern = compile_regex("\\p{N}", false, in.origin, field);
    step.behavior = individual ? SplitBehavior::Isolated : SplitBehavior::Contiguous;
    step.description = std::string("Digits individual=") + (individual ? "1" : "0");
  } else if (type == "Split") {
    const json& pattern = in.object(in.require(j, "pattern", field + ".pattern"), field + ".pattern");
    const json* regex = in.member(pattern, "Regex");
    const json* literal = in.member(pattern, "String");
    if ((regex == nullptr) == (literal == nullptr)) in.error(field + ".pattern", "needs exactly one of Regex, String");
    const std::string pattern_field = field + ".pattern." + (regex ? "Regex" : "String");
    const std::string& source = in.string(regex ? *regex : *literal, pattern_field);
    step.pattern = compile_regex(source, regex == nullptr, in.origin, pattern_field);
    const std::string& behavior = in.string(in.require(j, "behavior", field + ".behavior"), field + ".behavior");
    step.behavior = split_behavior(in, behavior, field + ".behavior");
    step.invert = in.boolean(j, "invert", field + ".invert", false);
    step.description = std::string("Split ") + (regex ? "regex " : "string ") + source + " " + behavior +
                       " invert=" + (step.invert ? "1" : "0");
  } else {
    in.error(field + ".type", "pre-tokenizer '" + type + "' is not supported (ByteLevel, Split, Digits, Sequence)");
  }
  steps.push_back(std::move(step));
}

// Byte-level BPE needs exactly one ByteLevel step, and it must be the last (later steps would see
// the byte spelling, which this implementation never materialises).
void check_byte_level_last(const Loader& in, const std::vector<PreTokenizerStep>& steps) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].byte_level != (i + 1 == steps.size()))
      in.error("pre_tokenizer", "byte-level BPE needs one ByteLevel pre-tokenizer, as the last step");
  }
  if (steps.empty()) in.error("pre_tokenizer", "byte-level BPE needs a ByteLevel pre-tokenizer");
}

void check_decoder(const Loader& in, const json& j, const std::string& field, int depth) {
  if (depth > kMaxNesting) in.error(field, "nested too deeply");
  in.object(j, field);
  const std::string& type = in.string(in.require(j, "type", field + ".type"), field + ".type");
  if (type == "Sequence") {
    const json& list = in.array(in.require(j, "decoders", field + ".decoders"), field + ".decoders");
    for (std::size_t i = 0; i < list.size(); ++i)
      check_decoder(in, list[i], field + ".decoders[" + std::to_string(i) + "]", depth + 1);
    return;
  }
  if (type != "ByteLevel") in.error(field + ".type", "decoder '" + type + "' is not supported (ByteLevel)");
}

// The BOS a post-processor puts before the text: the SpecialToken that opens the "single" template.
void parse_post_processor(const Loader& in, const json& j, const std::string& field, int depth, Model& m) {
  if (depth > kMaxNesting) in.error(field, "nested too deeply");
  in.object(j, field);
  const std::string& type = in.string(in.require(j, "type", field + ".type"), field + ".type");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& list = in.array(in.require(j, "processors", field + ".processors"), field + ".processors");
    for (std::size_t i = 0; i < list.size(); ++i)
      parse_post_processor(in, list[i], field + ".processors[" + std::to_string(i) + "]", depth + 1, m);
    return;
  }
  if (type != "TemplateProcessing")
    in.error(field + ".type", "post-processor '" + type + "' is not supported (TemplateProcessing, ByteLevel, Sequence)");
  const json& single = in.array(in.require(j, "single", field + ".single"), field + ".single");
  if (single.empty()) return;
  const json& first = in.object(single[0], field + ".single[0]");
  const json* special = in.member(first, "SpecialToken");
  if (special == nullptr) return;
  const std::string name =
      in.string(in.require(in.object(*special, field + ".single[0].SpecialToken"), "id", field + ".single[0].SpecialToken.id"),
                field + ".single[0].SpecialToken.id");
  const std::string tokens_field = field + ".special_tokens";
  const json& tokens = in.object(in.require(j, "special_tokens", tokens_field), tokens_field);
  const std::string entry_field = tokens_field + "." + name;
  auto entry = tokens.find(name);
  if (entry == tokens.end()) in.error(entry_field, "missing (named by single[0])");
  const json& ids = in.array(in.require(in.object(*entry, entry_field), "ids", entry_field + ".ids"), entry_field + ".ids");
  if (ids.size() != 1) in.error(entry_field + ".ids", "a BOS must be exactly one token");
  m.bos_id = in.integer(ids[0], entry_field + ".ids[0]");
  m.bos_field = entry_field + ".ids[0]";
}

// tokenizer_config.json's bos_token / eos_token: a string, or an AddedToken object with "content".
std::optional<std::string> config_token(const Loader& in, const json& config, const char* key) {
  const json* v = in.member(config, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_object()) return in.string(in.require(*v, "content", std::string(key) + ".content"), std::string(key) + ".content");
  return in.string(*v, key);
}

BpeTokenizer::AddedToken parse_added_token(const Loader& in, const json& j, const std::string& field) {
  in.object(j, field);
  BpeTokenizer::AddedToken t;
  t.id = in.integer(in.require(j, "id", field + ".id"), field + ".id");
  t.content = in.string(in.require(j, "content", field + ".content"), field + ".content");
  t.special = in.boolean(j, "special", field + ".special", false);
  t.normalized = in.boolean(j, "normalized", field + ".normalized", !t.special);
  t.lstrip = in.boolean(j, "lstrip", field + ".lstrip", false);
  t.rstrip = in.boolean(j, "rstrip", field + ".rstrip", false);
  t.single_word = in.boolean(j, "single_word", field + ".single_word", false);
  return t;
}

void parse_bpe_model(const Loader& in, const json& j, Model& m) {
  in.object(j, "model");
  if (const json* type = in.member(j, "type"); type != nullptr && in.string(*type, "model.type") != "BPE")
    in.error("model.type", "model '" + type->get<std::string>() + "' is not supported (BPE)");
  if (in.boolean(j, "byte_fallback", "model.byte_fallback", false))
    in.error("model.byte_fallback", "byte fallback (sentencepiece-style BPE) is not supported");
  if (const json* dropout = in.member(j, "dropout"); dropout != nullptr) {
    if (!dropout->is_number()) in.error("model.dropout", "expected a number");
    if (dropout->get<double>() != 0.0) in.error("model.dropout", "BPE dropout is a training option; not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* v = in.member(j, key);
    if (v != nullptr && !in.string(*v, std::string("model.") + key).empty())
      in.error(std::string("model.") + key, "not supported by byte-level BPE");
  }
  if (const json* unk = in.member(j, "unk_token")) m.unk_token = in.string(*unk, "model.unk_token");
  m.fuse_unk = in.boolean(j, "fuse_unk", "model.fuse_unk", false);
  m.ignore_merges = in.boolean(j, "ignore_merges", "model.ignore_merges", false);

  const json& vocab = in.object(in.require(j, "vocab", "model.vocab"), "model.vocab");
  m.vocab_field = "model.vocab";
  m.vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    m.vocab.emplace_back(it.key(), in.integer(it.value(), "model.vocab." + Loader::quoted(it.key())));

  const json& merges = in.array(in.require(j, "merges", "model.merges"), "model.merges");
  m.merges.reserve(merges.size());
  m.merge_fields.reserve(merges.size());
  for (std::size_t i = 0; i < merges.size(); ++i) {
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    const json& merge = merges[i];
    if (merge.is_string()) {
      const std::string& line = merge.get_ref<const std::string&>();
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == line.size() || line.find(' ', space + 1) != std::string::npos)
        in.error(field, "expected \"left right\", found " + Loader::quoted(line));
      m.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2) {
      m.merges.emplace_back(in.string(merge[0], field + "[0]"), in.string(merge[1], field + "[1]"));
    } else {
      in.error(field, "expected \"left right\" or [left, right]");
    }
    m.merge_fields.push_back(field);
  }
}

// Builds the runtime tables from a parsed Model; all cross-references are checked here.
std::unique_ptr<Impl> assemble(const Loader& in, Model m) {
  auto impl = std::make_unique<Impl>();
  impl->origin = in.origin;
  impl->fuse_unk = m.fuse_unk;
  impl->ignore_merges = m.ignore_merges;
  impl->pre_tokenizer = std::move(m.pre_tokenizer);
  for (const std::string& name : m.normalizer_names) impl->normalizers.push_back(icu_normalizer(in, name, "normalizer"));

  // Ids may leave gaps, but not more than the file has entries (keeps the id tables bounded).
  const std::int64_t id_limit = static_cast<std::int64_t>(m.vocab.size() + m.added.size());
  auto check_id = [&](std::int64_t id, const std::string& field) {
    if (id < 0 || id >= id_limit)
      in.error(field, "id " + std::to_string(id) + " is outside [0, " + std::to_string(id_limit) +
                          ") (the file lists " + std::to_string(id_limit) + " tokens)");
  };
  std::int64_t size = 0;
  std::unordered_map<std::string, std::int32_t> vocab;
  vocab.reserve(m.vocab.size());
  for (const auto& [token, id] : m.vocab) {
    const std::string field = m.vocab_field + "." + Loader::quoted(token);
    check_id(id, field);
    if (!vocab.emplace(token, static_cast<std::int32_t>(id)).second) in.error(field, "listed twice");
    size = std::max(size, id + 1);
  }
  for (std::size_t i = 0; i < m.added.size(); ++i) {
    check_id(m.added[i].id, m.added_fields[i] + ".id");
    size = std::max(size, m.added[i].id + 1);
  }
  impl->bytes_of_id.assign(static_cast<std::size_t>(size), std::string());
  impl->kind_of_id.assign(static_cast<std::size_t>(size), Impl::IdKind::Unassigned);
  std::vector<const std::string*> vocab_token_of_id(static_cast<std::size_t>(size), nullptr);
  for (const auto& [token, id] : m.vocab) {
    const auto k = static_cast<std::size_t>(id);
    if (vocab_token_of_id[k] != nullptr)
      in.error(m.vocab_field + "." + Loader::quoted(token), "id " + std::to_string(id) + " is given to two tokens");
    vocab_token_of_id[k] = &token;
    impl->kind_of_id[k] = Impl::IdKind::Ordinary;
    impl->bytes_of_id[k] = token_bytes(token);
    if (m.ignore_merges)
      if (std::optional<std::string> bytes = unspell(token)) impl->whole_words.emplace(std::move(*bytes), id);
  }
  const ByteAlphabet& alphabet = byte_alphabet();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(alphabet.spelling[static_cast<std::size_t>(b)]);
    impl->byte_token[static_cast<std::size_t>(b)] = it == vocab.end() ? -1 : it->second;
  }
  if (m.unk_token) {
    auto it = vocab.find(*m.unk_token);
    if (it == vocab.end()) in.error("model.unk_token", Loader::quoted(*m.unk_token) + " is not in the vocabulary");
    impl->unk_id = it->second;
  }

  Fnv1a hash;
  impl->merges.reserve(m.merges.size());
  for (std::size_t rank = 0; rank < m.merges.size(); ++rank) {
    const auto& [left, right] = m.merges[rank];
    auto id_of = [&](const std::string& token) {
      auto it = vocab.find(token);
      if (it == vocab.end()) in.error(m.merge_fields[rank], Loader::quoted(token) + " is not in the vocabulary");
      return it->second;
    };
    const std::int32_t left_id = id_of(left), right_id = id_of(right), merged_id = id_of(left + right);
    // A pair listed twice keeps its later rank, as HF's HashMap collect does.
    impl->merges[Impl::pair_key(left_id, right_id)] = {static_cast<std::uint32_t>(rank), merged_id};
    hash.add_u64(Impl::pair_key(left_id, right_id));
  }

  std::vector<bool> added_at_id(static_cast<std::size_t>(size), false);
  for (std::size_t i = 0; i < m.added.size(); ++i) {
    const BpeTokenizer::AddedToken& t = m.added[i];
    const std::string& field = m.added_fields[i];
    if (t.content.empty()) in.error(field + ".content", "empty");
    auto in_vocab = vocab.find(t.content);
    if (in_vocab != vocab.end() && in_vocab->second != t.id)
      in.error(field + ".id", "id " + std::to_string(t.id) + " but the vocabulary gives " + Loader::quoted(t.content) +
                                  " id " + std::to_string(in_vocab->second));
    const auto k = static_cast<std::size_t>(t.id);
    if (in_vocab == vocab.end() && vocab_token_of_id[k] != nullptr)
      in.error(field + ".id", "id " + std::to_string(t.id) + " belongs to the vocabulary's " +
                                  Loader::quoted(*vocab_token_of_id[k]));
    if (added_at_id[k] && impl->bytes_of_id[k] != token_bytes(t.content))
      in.error(field + ".id", "id " + std::to_string(t.id) + " is given to two added tokens");
    added_at_id[k] = true;
    impl->kind_of_id[k] = t.special ? Impl::IdKind::Special : Impl::IdKind::Ordinary;
    impl->bytes_of_id[k] = token_bytes(t.content);
    if (t.normalized) {
      std::string text = t.content;
      for (const icu::Normalizer2* n : impl->normalizers) text = normalize(*impl, *n, text);
      if (!text.empty()) impl->normalized_added.add(t, std::move(text));
    } else {
      impl->raw_added.add(t, t.content);
    }
    hash.add(t.content);
    hash.add_u64(static_cast<std::uint64_t>(t.id));
    hash.add_u64((t.special ? 1u : 0u) | (t.normalized ? 2u : 0u) | (t.lstrip ? 4u : 0u) | (t.rstrip ? 8u : 0u) |
                 (t.single_word ? 16u : 0u));
  }
  impl->raw_added.finish();
  impl->normalized_added.finish();

  auto id_of_content = [&](const std::string& content, const std::string& field) -> std::int64_t {
    for (const auto& t : m.added)
      if (t.content == content) return t.id;
    auto it = vocab.find(content);
    if (it == vocab.end()) in.error(field, Loader::quoted(content) + " is not in the vocabulary");
    return it->second;
  };
  impl->bos_id = m.bos_id >= 0 ? m.bos_id : m.bos_token ? id_of_content(*m.bos_token, m.bos_field) : -1;
  impl->eos_id = m.eos_id >= 0 ? m.eos_id : m.eos_token ? id_of_content(*m.eos_token, m.eos_field) : -1;
  for (auto [id, field] : {std::pair{impl->bos_id, m.bos_field}, std::pair{impl->eos_id, m.eos_field}})
    if (id < -1 || id >= size || (id >= 0 && impl->kind_of_id[static_cast<std::size_t>(id)] == Impl::IdKind::Unassigned))
      in.error(field, "token id " + std::to_string(id) + " is not in the vocabulary");

  for (std::size_t id = 0; id < impl->bytes_of_id.size(); ++id) {
    hash.add_u64(static_cast<std::uint64_t>(impl->kind_of_id[id]));
    hash.add(impl->bytes_of_id[id]);
  }
  for (const std::string& name : m.normalizer_names) hash.add(name);
  for (const PreTokenizerStep& step : impl->pre_tokenizer) hash.add(step.description);
  hash.add_u64(static_cast<std::uint64_t>(impl->bos_id));
  hash.add_u64(static_cast<std::uint64_t>(impl->eos_id));
  hash.add_u64(static_cast<std::uint64_t>(impl->unk_id));
  hash.add_u64((impl->fuse_unk ? 1u : 0u) | (impl->ignore_merges ? 2u : 0u));
  impl->identity = "bpe:" + hash.hex();
  return impl;
}

json parse_json(const Loader& in, std::string_view text, const std::string& what) {
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    in.error(what, std::string("invalid JSON: ") + e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------

BpeTokenizer::BpeTokenizer(std::unique_ptr<const Impl> impl) : impl_(std::move(impl)) {}
BpeTokenizer::~BpeTokenizer() = default;

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_tokenizer_json(std::string_view json_text, const std::string& origin,
                                                                std::string_view tokenizer_config_text) {
  const Loader in{origin};
  try {
    const json root = parse_json(in, json_text, "");
    in.object(root, "(top level)");
    Model m;
    parse_bpe_model(in, in.require(root, "model", "model"), m);
    if (const json* added = in.member(root, "added_tokens")) {
      in.array(*added, "added_tokens");
      for (std::size_t i = 0; i < added->size(); ++i) {
        const std::string field = "added_tokens[" + std::to_string(i) + "]";
        m.added.push_back(parse_added_token(in, (*added)[i], field));
        m.added_fields.push_back(field);
      }
    }
    if (const json* normalizer = in.member(root, "normalizer")) parse_normalizer(in, *normalizer, "normalizer", 0, m);
    if (const json* pre = in.member(root, "pre_tokenizer")) parse_pre_tokenizer(in, *pre, "pre_tokenizer", 0, m.pre_tokenizer);
    check_byte_level_last(in, m.pre_tokenizer);
    if (const json* post = in.member(root, "post_processor")) parse_post_processor(in, *post, "post_processor", 0, m);
    check_decoder(in, in.require(root, "decoder", "decoder"), "decoder", 0);
    bool adds_bos = m.bos_id >= 0;  // the post-processor template starts with BOS
    if (!tokenizer_config_text.empty()) {
      const std::string config_origin = origin + " (tokenizer_config.json)";
      const Loader config_in{config_origin};
      const json config = parse_json(config_in, tokenizer_config_text, "");
      config_in.object(config, "(top level)");
      if (m.bos_id < 0) {
        m.bos_token = config_token(config_in, config, "bos_token");
        m.bos_field = "tokenizer_config.json: bos_token";
      }
      m.eos_token = config_token(config_in, config, "eos_token");
      m.eos_field = "tokenizer_config.json: eos_token";
      if (config.contains("add_bos_token") && config["add_bos_token"].is_boolean())
        adds_bos = adds_bos || config["add_bos_token"].get<bool>();
    }
    auto tokenizer = std::unique_ptr<BpeTokenizer>(new BpeTokenizer(assemble(in, std::move(m))));
    tokenizer->set_adds_bos(adds_bos);
    return tokenizer;
  } catch (const json::exception& e) {
    fail(origin, "", std::string("unexpected JSON content: ") + e.what());
  }
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_lists(const Lists& lists, const std::string& origin) {
  const Loader in{origin};
  Model m;
  m.vocab_field = lists.field_prefix + "tokens";
  m.vocab.reserve(lists.tokens.size());
  for (std::size_t id = 0; id < lists.tokens.size(); ++id) {
    // transformers respells a token that uses characters outside the byte alphabet from its UTF-8.
    const std::string& token = lists.tokens[id];
    m.vocab.emplace_back(is_byte_level_spelling(token) ? token : spell(token), static_cast<std::int64_t>(id));
  }
  m.merges.reserve(lists.merges.size());
  for (std::size_t i = 0; i < lists.merges.size(); ++i) {
    const std::string field = lists.field_prefix + "merges[" + std::to_string(i) + "]";
    const std::string& line = lists.merges[i];
    const std::size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() || line.find(' ', space + 1) != std::string::npos)
      in.error(field, "expected \"left right\", found " + Loader::quoted(line));
    m.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    m.merge_fields.push_back(field);
  }
  m.added = lists.added;
  for (std::size_t i = 0; i < lists.added.size(); ++i)
    m.added_fields.push_back(lists.field_prefix + "tokens[" + std::to_string(lists.added[i].id) + "]");
  try {
    parse_pre_tokenizer(in, parse_json(in, lists.pre_tokenizer_json, "pre_tokenizer"), "pre_tokenizer", 0,
                        m.pre_tokenizer);
  } catch (const json::exception& e) {
    fail(origin, "pre_tokenizer", e.what());
  }
  check_byte_level_last(in, m.pre_tokenizer);
  m.bos_id = lists.bos_id;
  m.eos_id = lists.eos_id;
  m.bos_field = lists.field_prefix + "bos_token_id";
  m.eos_field = lists.field_prefix + "eos_token_id";
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(assemble(in, std::move(m))));
}

bool BpeTokenizer::is_byte_level_spelling(std::string_view token) { return unspell(token).has_value(); }

std::vector<std::int64_t> BpeTokenizer::encode(std::string_view text, bool add_bos) const {
  const Impl& impl = *impl_;
  std::vector<std::int64_t> ids;
  if (add_bos && impl.bos_id >= 0) ids.push_back(impl.bos_id);
  EncodeScratch s;
  for (const PreTokenizerStep& step : impl.pre_tokenizer) {
    std::unique_ptr<icu::RegexMatcher> matcher;
    if (step.pattern) {
      UErrorCode status = U_ZERO_ERROR;
      matcher.reset(step.pattern->matcher(status));
      if (matcher) matcher->setTimeLimit(kRegexTimeLimit, status);
      if (U_FAILURE(status) || !matcher) regex_failed(impl, status);
    }
    s.matchers.push_back(std::move(matcher));
  }
  if (impl.raw_added.empty()) {
    encode_plain(impl, text, s, ids);
    return ids;
  }
  std::vector<Segment> segments;
  impl.raw_added.split(text, segments);
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
    } else {
      encode_plain(impl, text.substr(seg.begin, seg.end - seg.begin), s, ids);
    }
  }
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<std::int64_t>& ids) const {
  const Impl& impl = *impl_;
  std::string out;
  for (std::int64_t id : ids) {
    if (id < 0 || id >= static_cast<std::int64_t>(impl.kind_of_id.size()) ||
        impl.kind_of_id[static_cast<std::size_t>(id)] == Impl::IdKind::Unassigned)
      fail(impl.origin, "decode", "token id " + std::to_string(id) + " is not in the vocabulary of " +
                                      std::to_string(impl.kind_of_id.size()));
    if (impl.kind_of_id[static_cast<std::size_t>(id)] == Impl::IdKind::Special) continue;
    out += impl.bytes_of_id[static_cast<std::size_t>(id)];
  }
  return out;
}

std::int64_t BpeTokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->kind_of_id.size()); }
std::int64_t BpeTokenizer::bos_id() const { return impl_->bos_id; }
std::int64_t BpeTokenizer::eos_id() const { return impl_->eos_id; }
std::string BpeTokenizer::identity() const { return impl_->identity; }

}  // namespace kvbound
