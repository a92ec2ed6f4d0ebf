// The matrix products a backbone pass cannot avoid, timed alone on random weights of the model's shapes (same
// dtype and threads): the floor under any forward or training update built on the same GEMM, so a speed ratio
// against a peer on that GEMM is bounded by the peer's time over the floor. Attention, norms, RoPE and
// activations are left out; every layer has its own weights, so they stream from memory as in a real pass.
// Gemm::kBackbone forms them as kvbound does (float32 on oneDNN where ops/onednn_linear.h prefers it), Gemm::kAten
// as ATen's at::linear and at::mm do (what a PyTorch peer calls): the two floors side by side.
#pragma once
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>

#include <vector>

#include "bench/best_time.h"
#include "checkpoints/model_config.h"
#include "ops/onednn_linear.h"

namespace kvbound::bench {

class MatrixProducts {
 public:
  enum class Gemm { kBackbone, kAten };
  MatrixProducts(const ModelConfig& c, std::int64_t rows, at::ScalarType dtype, Gemm gemm = Gemm::kBackbone)
      : onednn_(on_onednn(dtype, gemm)) {
    const auto opts = at::TensorOptions().dtype(dtype);
    const std::int64_t d = c.hidden_size, q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;
    const std::int64_t inter = c.intermediate_size;
    for (std::int64_t l = 0; l < c.num_layers; ++l)
      layers_.push_back({at::randn({q_out, d}, opts), at::randn({kv_out, d}, opts), at::randn({kv_out, d}, opts),
                         at::randn({d, q_out}, opts), at::randn({inter, d}, opts), at::randn({inter, d}, opts),
                         at::randn({d, inter}, opts)});
    head_ = at::randn({c.vocab_size, d}, opts);
    hidden_ = at::randn({rows, d}, opts);
    attended_ = at::randn({rows, q_out}, opts);
    mlp_hidden_ = at::randn({rows, inter}, opts);
    q_grad_ = at::randn({rows, q_out}, opts);
    kv_grad_ = at::randn({rows, kv_out}, opts);
    probs_ = at::randn({rows, c.vocab_size}, opts);
  }

  // Which GEMM forms the products of `dtype` under `gemm` here: "onednn" or "aten".
  static const char* gemm_name(at::ScalarType dtype, Gemm gemm) { return on_onednn(dtype, gemm) ? "onednn" : "aten"; }
  const char* gemm_name() const { return onednn_ ? "onednn" : "aten"; }

  // Best of `repeats` timings of each kind of work, in seconds.
  // Every layer's q, k, v, o, gate, up and down projections (separate weights, as the backbone holds them).
  double layers_forward(int repeats) const {
    return best_seconds(
        [&] {
          for (const auto& w : layers_) {
            for (const at::Tensor* weight : {&w.q, &w.k, &w.v, &w.gate, &w.up}) linear(hidden_, *weight);
            linear(attended_, w.o);
            linear(mlp_hidden_, w.down);
          }
        },
        repeats);
  }
  // The input gradients of the same projections (dX = dY·W): what a backward to earlier layers forms when
  // the backbone's weights are frozen.
  double layers_input_gradients(int repeats) const {
    return best_seconds(
        [&] {
          for (const auto& w : layers_) {
            mm(q_grad_, w.q);
            for (const at::Tensor* weight : {&w.k, &w.v}) mm(kv_grad_, *weight);
            for (const at::Tensor* weight : {&w.gate, &w.up}) mm(mlp_hidden_, *weight);
            for (const at::Tensor* weight : {&w.o, &w.down}) mm(hidden_, *weight);
          }
        },
        repeats);
  }
  // Vocabulary logits h·Wᵀ of every row.
  double head_logits(int repeats) const { return best_seconds([&] { linear(hidden_, head_); }, repeats); }
  // A distribution over the vocabulary taken back through the head, p·W (a distillation loss's gradient).
  double head_expectation(int repeats) const { return best_seconds([&] { mm(probs_, head_); }, repeats); }

 private:
  static bool on_onednn(at::ScalarType dtype, Gemm gemm) {
    return gemm == Gemm::kBackbone && dtype == at::kFloat && ops::onednn::float32_preferred();
  }
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w) const {
    return onednn_ ? ops::onednn::linear(x, w) : at::linear(x, w);
  }
  at::Tensor mm(const at::Tensor& a, const at::Tensor& b) const {
    return onednn_ ? ops::onednn::mm(a, b) : at::mm(a, b);
  }

  bool onednn_;
  struct LayerWeights {
    at::Tensor q, k, v, o, gate, up, down;
  };
  std::vector<LayerWeights> layers_;
  at::Tensor head_, hidden_, attended_, mlp_hidden_, q_grad_, kv_grad_, probs_;
};

}  // namespace kvbound::bench
