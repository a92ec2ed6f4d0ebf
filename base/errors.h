// One exception type for every user-facing failure (bad file, bad config, bad shape).
// The CLI prints what() as a single line and exits non-zero, so messages must name the
// file and the field/tensor they are about: "FILE: FIELD: what is wrong".
#pragma once
#include <stdexcept>
#include <string>

namespace kvbound {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Builds "file: field: message" (field may be empty) and throws kvbound::Error.
[[noreturn]] inline void fail(const std::string& file, const std::string& field, const std::string& message) {
  std::string s = file;
  if (!field.empty()) s += ": " + field;
  s += ": " + message;
  throw Error(s);
}

}  // namespace kvbound
