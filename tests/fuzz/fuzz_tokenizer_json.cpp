// libFuzzer: a tokenizer.json made of arbitrary bytes either loads or throws kvbound::Error; a loaded
// tokenizer encodes text (including the input's own, possibly invalid UTF-8, bytes) into ids that
// decode without error. Never a crash, a hang or an out-of-bounds read.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/errors.h"
#include "data/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<kvbound::BpeTokenizer> tok;
  try {
    tok = kvbound::BpeTokenizer::from_tokenizer_json(bytes, "fuzz.json");
  } catch (const kvbound::Error&) {
    return 0;
  }
  const std::string texts[] = {
      "Hello, world! It's 2024-01-15; x1 = 42.\n\tab  ab <eos>ba<sep> [MASK] caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x99\x82",
      std::string(bytes.substr(0, 64)),
      "",
  };
  for (const std::string& text : texts) {
    std::vector<std::int64_t> ids;
    try {
      ids = tok->encode(text, true);
    } catch (const kvbound::Error&) {
      continue;  // a regex that exceeds its time or stack limit
    }
    for (std::int64_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();
    tok->decode(ids);  // ids from encode always decode: an Error here is a bug, so it is not caught
  }
  return 0;
}
