// The distillation loss's two products with the LM head in bfloat16 on a CPU without AMX (ops/bf16_dot_panels.h)
// against the float32 GEMM the loss ran there before (at::mm on the widened values, MKL's sgemm) in the same run,
// on SmolLM2-135M's head: logits [rows, V] = h [rows, d] · Wᵀ and the product into the head [rows, d] = p [rows, V] · W,
// each parallel as losses::DistillationHead runs it (over panels of the vocabulary; over rows), the best of `repeats`.
// Also the bfloat16-output matmul (oneDNN), which rounds the result the loss needs in float32: the speed of this
// CPU's bfloat16 GEMM, for scale. Prints one JSON line with the times, the ratios and the largest difference to
// the float32 GEMM.
// Usage: bench_head_products [rows=128] [V=49152] [d=576] [threads=2] [repeats=5]
#include <ATen/Parallel.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "bench/best_time.h"
#include "ops/bf16_dot_panels.h"

int main(int argc, char** argv) {
  const long rows = argc > 1 ? std::stol(argv[1]) : 128, V = argc > 2 ? std::stol(argv[2]) : 49152;
  const long d = argc > 3 ? std::stol(argv[3]) : 576;
  const int threads = argc > 4 ? std::stoi(argv[4]) : 2, repeats = argc > 5 ? std::stoi(argv[5]) : 5;
  namespace dot = kvbound::ops::bf16_dot;
  if (!dot::available()) {
    std::cerr << "bench_head_products: this CPU has no AVX512-BF16 (ops/bf16_dot_panels.h)\n";
    return 1;
  }
  if (d % 2 != 0 || V % 2 != 0) {
    std::cerr << "bench_head_products: d and V must be even\n";
    return 2;
  }
  at::set_num_threads(threads);
  const c10::InferenceMode no_autograd;
  at::manual_seed(0);
  const at::Tensor W = (at::randn({V, d}) * 0.05).to(at::kBFloat16), h = at::randn({rows, d}).to(at::kBFloat16);
  const at::Tensor p = (at::randn({rows, V}) * 1e-3).to(at::kBFloat16);
  const at::Tensor W_float = W.to(at::kFloat), h_float = h.to(at::kFloat), p_float = p.to(at::kFloat);
  const at::Tensor logit_panels = dot::pack_transposed_panels(W);
  const at::Tensor mix_panels = dot::pack_transposed_panels(W.t().contiguous());
  const long logit_panel_count = (V + dot::kPanel - 1) / dot::kPanel, mix_panel_count = (d + dot::kPanel - 1) / dot::kPanel;
  const at::Tensor logits = at::zeros({rows, logit_panel_count * dot::kPanel}), mixed = at::zeros({rows, mix_panel_count * dot::kPanel});
  const auto* h_bits = static_cast<const uint16_t*>(h.const_data_ptr());
  const auto* p_bits = static_cast<const uint16_t*>(p.const_data_ptr());
  const auto dot_logits = [&] {
    at::parallel_for(0, logit_panel_count, 8, [&](int64_t first, int64_t last) {
      dot::multiply_panels(h_bits, rows, d, d, static_cast<const uint16_t*>(logit_panels.const_data_ptr()), first, last,
                           logits.mutable_data_ptr<float>(), logits.stride(0));
    });
  };
  const auto dot_mix = [&] {
    at::parallel_for(0, rows, 6, [&](int64_t begin, int64_t end) {
      dot::multiply_panels(p_bits + begin * V, end - begin, V, V, static_cast<const uint16_t*>(mix_panels.const_data_ptr()),
                           0, mix_panel_count, mixed.mutable_data_ptr<float>() + begin * mixed.stride(0), mixed.stride(0));
    });
  };
  const double ours_logits = kvbound::bench::best_seconds(dot_logits, repeats);
  const double sgemm_logits = kvbound::bench::best_seconds([&] { at::mm(h_float, W_float.t()); }, repeats);
  const double bf16_logits = kvbound::bench::best_seconds([&] { at::mm(h, W.t()); }, repeats);
  const double ours_mix = kvbound::bench::best_seconds(dot_mix, repeats);
  const double sgemm_mix = kvbound::bench::best_seconds([&] { at::mm(p_float, W_float); }, repeats);
  const double bf16_mix = kvbound::bench::best_seconds([&] { at::mm(p, W); }, repeats);
  const double logits_diff = (logits.narrow(1, 0, V) - at::mm(h_float, W_float.t())).abs().max().item<double>();
  const double mix_diff = (mixed.narrow(1, 0, d) - at::mm(p_float, W_float)).abs().max().item<double>();
  std::printf("{\"bench\": \"head_products\", \"rows\": %ld, \"V\": %ld, \"d\": %ld, \"threads\": %d, "
              "\"logits_s\": {\"bf16_dot\": %.5f, \"sgemm\": %.5f, \"bf16_out_matmul\": %.5f}, \"logits_ratio\": %.3f, "
              "\"mix_s\": {\"bf16_dot\": %.5f, \"sgemm\": %.5f, \"bf16_out_matmul\": %.5f}, \"mix_ratio\": %.3f, "
              "\"logits_max_abs_diff\": %.3g, \"mix_max_abs_diff\": %.3g}\n",
              rows, V, d, threads, ours_logits, sgemm_logits, bf16_logits, sgemm_logits / ours_logits, ours_mix, sgemm_mix,
              bf16_mix, sgemm_mix / ours_mix, logits_diff, mix_diff);
}
