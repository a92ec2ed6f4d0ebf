// FNV-1a 64-bit hashing: the stable, dependency-free fingerprint behind tokenizer identities and config
// hashes (not cryptographic; it only has to change when the hashed content changes).
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace kvbound {

class Fnv1a {
 public:
  // Length-prefixed, so ("ab","c") and ("a","bc") hash differently.
  void add(std::string_view bytes) {
    add_u64(bytes.size());
    add_raw(bytes);
  }
  void add_raw(std::string_view bytes) {
    for (unsigned char b : bytes) byte(b);
  }
  void add_u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) byte(static_cast<unsigned char>(v >> (8 * i)));
  }
  std::uint64_t value() const { return hash_; }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(hash_));
    return buf;
  }

 private:
  void byte(unsigned char b) {
    hash_ ^= b;
    hash_ *= 0x100000001b3ULL;
  }
  std::uint64_t hash_ = 0xcbf29ce484222325ULL;
};

}  // namespace kvbound
