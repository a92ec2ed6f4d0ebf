#include "losses/memory_mse.h"

namespace kvbound::losses {

MemoryMSE::MemoryMSE(std::int64_t num_layers) : sse_(static_cast<std::size_t>(num_layers)) {}

void MemoryMSE::add(std::int64_t layer, const at::Tensor& output, const at::Tensor& target, const at::Tensor& mask) {
  const at::Tensor err = (output.to(at::kFloat) - target.to(at::kFloat)) * mask;
  at::Tensor& sse = sse_.at(static_cast<std::size_t>(layer));
  sse = sse.defined() ? sse + err.pow(2).sum() : err.pow(2).sum();
}

std::vector<at::Tensor> MemoryMSE::per_layer() const {
  std::vector<at::Tensor> out;
  for (const at::Tensor& sse : sse_) out.push_back(sse / elements_);
  return out;
}

}  // namespace kvbound::losses
