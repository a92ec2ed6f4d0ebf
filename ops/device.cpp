#include "ops/device.h"

#include <ATen/Context.h>

#include <algorithm>
#include <cctype>

#include "base/errors.h"
#include "ops/cuda_module.h"

namespace kvbound {

c10::Device resolve_device(const std::string& spec, const std::string& where) {
  const auto reject = [&](const std::string& message) { throw Error(where + ": " + message); };
  if (spec == "cpu") return c10::Device(c10::kCPU);
  const std::string cuda = "cuda";
  if (spec.compare(0, cuda.size(), cuda) != 0)
    reject("'" + spec + "' is not a device (cpu, cuda, cuda:N)");
  std::int64_t index = 0;
  if (spec.size() > cuda.size()) {
    const std::string digits = spec.substr(cuda.size() + 1);
    if (spec[cuda.size()] != ':' || digits.empty() || digits.size() > 3 ||
        !std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); }))
      reject("'" + spec + "' is not a device (cpu, cuda, cuda:N)");
    index = std::stoll(digits);
  }
  std::string why;
  if (!load_cuda_kernels(&why)) reject("'" + spec + "' but CUDA is not available here: " + why);
  // ATen picks its CUDA hooks once per process: if anything asked for them before the module brought
  // libtorch_cuda in (a CPU backward does), CUDA stays invisible to this process even with a GPU present.
  if (!at::hasCUDA())
    reject("'" + spec + "' but LibTorch sees no CUDA device in this process (no GPU, or ATen ran before the " +
           "CUDA module was loaded: call kvbound::load_cuda_kernels() first, ops/cuda_module.h)");
  const auto count = static_cast<std::int64_t>(at::getNumGPUs());
  if (index >= count)
    reject("'" + spec + "' but this machine has " + std::to_string(count) + " CUDA device(s)");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

}  // namespace kvbound
