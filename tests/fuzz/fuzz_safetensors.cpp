// libFuzzer: parse_safetensors on arbitrary bytes must either succeed with every tensor inside the
// buffer or throw kvbound::Error; never crash, never read out of bounds.
#include <cstddef>
#include <cstdint>

#include "base/errors.h"
#include "checkpoints/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto header = kvbound::parse_safetensors(data, size, "fuzz.safetensors");
    volatile std::uint8_t sink = 0;
    for (const auto& [name, info] : header.tensors) {
      if (info.begin + info.nbytes > size) __builtin_trap();
      if (info.nbytes > 0) sink = sink + data[info.begin] + data[info.begin + info.nbytes - 1];
    }
  } catch (const kvbound::Error&) {
  }
  return 0;
}
