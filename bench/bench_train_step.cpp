// Training throughput of a learned method's update on random tokens, for models no tokenizer travels with
// (bench/peers/make_random_llama.py on the GPU machine): what Trainer::step does without its data, logs and
// checkpoints — the method's loss on a batch (teacher forward, student forward with the method's modules, its
// loss terms), backward, gradient clipping and AdamW on the trainable tensors — the median of STEPS updates after
// two warm-up updates (the peers' rule too, bench/peers/update_timing.py), the clock read after a device barrier on CUDA. Any train key can be set as in
// `kvbound train` (e.g. trimkv.gate_hidden=512). For trimkv and indexmem it also times, alone, the matrix
// products their update cannot avoid (bench/matrix_products.h): the floor under any update on the same GEMM, on
// kvbound's GEMM and on ATen's (a PyTorch peer's) where the two differ.
// Prints one JSON line.
// Usage: bench_train_step MODEL METHOD SEQ_LEN BATCH [steps=5] [device=cpu] [dtype=float32] [key=value ...]
#include <ATen/ops/full_like.h>
#include <ATen/ops/randint.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "base/process_heap.h"
#include "bench/matrix_products.h"
#include "base/config.h"
#include "cli/command_schemas.h"
#include "cli/model_setup.h"
#include "data/training_rows.h"
#include "modules/backbone.h"
#include "ops/cuda_module.h"
#include "train/method_registry.h"
#include "train/optimizer.h"

namespace {

// The products of one update on `rows` positions that no implementation on the same GEMM can skip, in seconds.
// trimkv: the teacher's and the student's forward through every layer, the student's backward to the inputs
// of every layer (the backbone frozen: no weight gradients), the logits of both, and the distillation loss's
// gradient through the head, (p_s − p_t)·W, plus p_s·W when the ce term is trained. indexmem (stage 1): the
// teacher's forward through every layer (the indexer's own products are d_index wide, left out; no logits).
std::optional<double> unavoidable_products_seconds(const std::string& method, const kvbound::Config& config,
                                                   const kvbound::Backbone& model, std::int64_t rows,
                                                   at::ScalarType dtype, kvbound::bench::MatrixProducts::Gemm gemm) {
  if (method != "trimkv" && method != "indexmem") return std::nullopt;
  if (!model.device().is_cpu()) return std::nullopt;  // timed without a device barrier: CPU only
  const kvbound::bench::MatrixProducts products(model.config(), rows, dtype, gemm);
  const int repeats = 3;
  if (method == "indexmem") return products.layers_forward(repeats);
  const int head_products = config.get_float("trimkv.w_ntp") != 0 ? 2 : 1;
  return 2 * products.layers_forward(repeats) + products.layers_input_gradients(repeats) +
         2 * products.head_logits(repeats) + head_products * products.head_expectation(repeats);
}

}  // namespace

int main(int argc, char** argv) try {
  kvbound::keep_freed_memory_in_process();  // as kvbound does (base/process_heap.h)
  if (argc < 5) {
    std::cerr << "usage: bench_train_step MODEL METHOD SEQ_LEN BATCH [steps=5] [device=cpu] [dtype=float32] "
                 "[key=value ...]\n";
    return 2;
  }
  using Clock = std::chrono::steady_clock;
  const std::string model_path = argv[1], method_name = argv[2];
  const std::int64_t T = std::stoll(argv[3]), B = std::stoll(argv[4]);
  const int steps = argc > 5 ? std::stoi(argv[5]) : 5;
  const std::string device_name = argc > 6 ? argv[6] : "cpu", dtype_name = argc > 7 ? argv[7] : "float32";
  std::vector<std::string> overrides = {"data.train_text=unused", "model.path=" + model_path,
                                        "model.device=" + device_name, "model.dtype=" + dtype_name,
                                        "train.method=" + method_name};
  for (int i = 8; i < argc; ++i) overrides.push_back(argv[i]);
  const kvbound::Config config = kvbound::Config::load(kvbound::train_schema(), "", overrides);
  const auto model = kvbound::load_configured_backbone(config);
  const c10::Device device = model->device();
  void (*barrier)() = device.is_cuda() ? reinterpret_cast<void (*)()>(kvbound::cuda_module_symbol("kvbound_cuda_synchronize"))
                                       : nullptr;
  const auto now = [&] {
    if (barrier) barrier();
    return Clock::now();
  };
  kvbound::MethodSetup setup{config, *model, 0, {}, {}};
  auto method = kvbound::find_method(method_name).make(setup);
  std::vector<at::Tensor> params;
  for (const auto& [name, tensor] : method->named_parameters()) params.push_back(tensor);
  kvbound::AdamW optimizer(params, kvbound::AdamWSettings{});

  at::manual_seed(0);
  kvbound::Batch batch;
  batch.inputs = at::randint(3, model->config().vocab_size, {B, T}, at::TensorOptions().dtype(at::kLong));
  batch.targets = at::full_like(batch.inputs, -1);
  batch.targets.narrow(1, 0, T - 1).copy_(batch.inputs.narrow(1, 1, T - 1));
  batch.weights = (batch.targets >= 0).to(at::kFloat);
  batch.tokens = B * (T - 1);
  batch = batch.to(device);
  double loss = 0;
  const auto update = [&] {
    optimizer.zero_grad();
    const kvbound::StepLoss step = method->loss(batch);
    step.total.backward();
    kvbound::clip_grad_norm(params, 1.0);
    optimizer.step(1e-4);
    loss = step.total.item<double>();
  };
  for (int i = 0; i < 2; ++i) update();
  // The median update: on a shared machine a neighbour's burst stretches one update, not the typical one.
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = now();
    update();
    times.push_back(std::chrono::duration<double>(now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  const auto n = times.size();
  const double seconds = n % 2 ? times[n / 2] : (times[n / 2 - 1] + times[n / 2]) / 2;
  using kvbound::bench::MatrixProducts;
  const MatrixProducts::Gemm backbone_gemm = MatrixProducts::Gemm::kBackbone;
  const std::string gemm = MatrixProducts::gemm_name(model->dtype(), backbone_gemm);
  const std::optional<double> floor =
      unavoidable_products_seconds(method_name, config, *model, B * T, model->dtype(), backbone_gemm);
  const std::optional<double> aten_floor =
      gemm == "aten" ? floor
                     : unavoidable_products_seconds(method_name, config, *model, B * T, model->dtype(),
                                                    MatrixProducts::Gemm::kAten);
  const auto milliseconds = [](const std::optional<double>& s) { return s ? std::to_string(*s * 1e3) : std::string("null"); };
  const bool bf16x3 = model->float32_products() == kvbound::Backbone::Float32Products::kBf16x3;
  std::printf("{\"impl\": \"kvbound\", \"method\": \"%s\", \"T\": %ld, \"B\": %ld, \"device\": \"%s\", \"dtype\": \"%s\", "
              "\"fp32_products\": \"%s\", \"ms_per_update\": %.1f, \"tok_s\": %.1f, \"loss\": %.4f, "
              "\"gemm\": \"%s\", \"unavoidable_products_ms\": %s, \"aten_unavoidable_products_ms\": %s}\n",
              method_name.c_str(), static_cast<long>(T), static_cast<long>(B), device.str().c_str(), dtype_name.c_str(),
              bf16x3 ? "bf16x3" : "float32", seconds * 1e3, static_cast<double>(B * T) / seconds, loss, gemm.c_str(), milliseconds(floor).c_str(),
              milliseconds(aten_floor).c_str());
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_train_step: " << e.what() << "\n";
  return 1;
}
