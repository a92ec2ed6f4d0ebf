// Next-token choice from a logits row: greedy, or temperature + nucleus (top-p) sampling with its own
// seeded generator so a run is reproducible.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>

namespace kvbound {

struct SamplingOptions {
  double temperature = 0.0;  // 0 = greedy
  double top_p = 1.0;        // keep the smallest set of tokens whose probability reaches top_p
  std::uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplingOptions options);
  // logits: [vocab] float32. Returns the chosen token id.
  std::int64_t next(const at::Tensor& logits);

 private:
  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace kvbound
