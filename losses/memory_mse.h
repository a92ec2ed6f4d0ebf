// L_MSE of the latent memory (DESIGN.md, "Latent memory"), accumulated chunk by chunk over one replay of a
// batch at one budget: per layer, the squared error between the memory-augmented attention output o and the
// full-attention output o_full over the real positions of the chunks after the first eviction, divided by
// the number of scored elements.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kvbound::losses {

class MemoryMSE {
 public:
  explicit MemoryMSE(std::int64_t num_layers);
  // Adds one scored chunk of one layer: output, target [B, Hq, C, D]; mask [B, 1, C, 1] (1 at real positions).
  void add(std::int64_t layer, const at::Tensor& output, const at::Tensor& target, const at::Tensor& mask);
  // Counts the elements one scored chunk adds in each layer (every layer scores the same chunks): its real
  // positions times the elements of one position (Hq · D). Known on the host from the batch's weights.
  void count(double elements) { elements_ += elements; }
  // Whether any real position was scored (rows too short for the budget to evict give none).
  bool empty() const { return elements_ == 0; }
  // Mean squared error per layer (float32 scalars, differentiable); empty() must be false.
  std::vector<at::Tensor> per_layer() const;

 private:
  std::vector<at::Tensor> sse_;  // per layer: sum of squared errors
  double elements_ = 0;          // scored elements of one layer
};

}  // namespace kvbound::losses
