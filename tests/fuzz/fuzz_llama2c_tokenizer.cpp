// libFuzzer: a llama2.c tokenizer.bin made of arbitrary bytes either loads or throws kvbound::Error; a
// loaded tokenizer encodes text (including the input's own bytes) into ids that decode without error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/errors.h"
#include "data/llama2c_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::unique_ptr<kvbound::Llama2cTokenizer> tok;
  try {
    tok = kvbound::Llama2cTokenizer::from_bin(data, size, "fuzz.bin");
  } catch (const kvbound::Error&) {
    return 0;
  }
  const std::string texts[] = {
      "Once upon a time, Lily's mom said \"Hi!\"\n\t  caf\xC3\xA9 \xE6\x97\xA5 \xF0\x9F\x99\x82 \x80\xFF",
      std::string(reinterpret_cast<const char*>(data), size < 64 ? size : 64),
      "",
  };
  for (const std::string& text : texts) {
    const std::vector<std::int64_t> ids = tok->encode(text, true);
    for (std::int64_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();
    tok->decode(ids);  // ids from encode always decode: an Error here is a bug, so it is not caught
  }
  return 0;
}
