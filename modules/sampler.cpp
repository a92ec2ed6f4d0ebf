#include "modules/sampler.h"

#include <ATen/ops/argmax.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sort.h>

#include "base/errors.h"

namespace kvbound {

Sampler::Sampler(SamplingOptions options) : options_(options), rng_(options.seed) {
  if (options_.temperature < 0) fail("sampling", "temperature", "must be >= 0");
  if (!(options_.top_p > 0 && options_.top_p <= 1)) fail("sampling", "top_p", "must be in (0, 1]");
}

std::int64_t Sampler::next(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 1, "Sampler::next: logits must be [vocab]");
  if (options_.temperature == 0) return at::argmax(logits).item<std::int64_t>();
  const at::Tensor probs = at::softmax(logits.to(at::kDouble) / options_.temperature, 0);
  const auto [sorted, order] = at::sort(probs, 0, /*descending=*/true);
  const double* p = sorted.data_ptr<double>();
  const std::int64_t* ids = order.data_ptr<std::int64_t>();
  // Nucleus: the shortest prefix of the sorted distribution whose mass reaches top_p.
  std::int64_t keep = 0;
  double mass = 0;
  while (keep < sorted.size(0) && (keep == 0 || mass < options_.top_p)) mass += p[keep++];
  double r = std::uniform_real_distribution<double>(0.0, mass)(rng_);
  for (std::int64_t i = 0; i < keep; ++i) {
    r -= p[i];
    if (r <= 0) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace kvbound
