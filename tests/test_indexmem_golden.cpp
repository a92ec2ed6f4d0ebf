// IndexMem golden: the stage-1 indexer loss L_KL (IndexMemIndexerMethod, four pool / window / min_gap / lead
// settings) and the stage-2 latent-memory loss L_MSE (MemoryMethod under streaming_llm at two budgets, add and slot reads) equal,
// in total, per layer and in their parameter gradients, a float64 PyTorch implementation of the same formulas
// on a tiny random Llama with a padded batch (tests/golden/make_indexmem_golden.py).
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoints/safetensors_io.h"
#include "modules/backbone.h"
#include "ops/pooled_window.h"
#include "golden_reader.h"
#include "test_env.h"
#include "train/indexmem_method.h"
#include "train/memory_method.h"

namespace kvbound {
namespace {

double meta_double(const SafetensorsFile& g, const std::string& key) { return std::stod(g.metadata.at(key)); }
std::int64_t meta_int(const SafetensorsFile& g, const std::string& key) { return std::stoll(g.metadata.at(key)); }

// |Δ| ≤ 1e-5 (relative when the value is above 1), and also ≤ 1e-4 relative so that small values are
// checked to more than their leading digit. Returns |Δ| for the report.
double expect_value(double got, double want, const std::string& what) {
  const double delta = std::abs(got - want);
  EXPECT_LE(delta, 1e-5 * std::max(1.0, std::abs(want))) << what << ": got " << got << ", want " << want;
  EXPECT_LE(delta, 1e-4 * std::abs(want)) << what << ": got " << got << ", want " << want;
  return delta;
}

// Gradients: max |Δ| over the tensor relative to the reference's max |g| (float32 vs float64 backward).
void expect_gradients(const std::map<std::string, at::Tensor>& params, const SafetensorsFile& golden,
                      const std::string& prefix) {
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << prefix << name;
    const at::Tensor want = golden.tensors.at(prefix + name);
    const double scale = std::max(want.abs().max().item<double>(), 1e-12);
    const double rel = (p.grad() - want).abs().max().item<double>() / scale;
    EXPECT_LT(rel, 1e-4) << prefix << name << " (max |g| " << scale << ")";
    if (rel >= worst) std::tie(worst, worst_name) = std::make_pair(rel, name);
  }
  std::cout << "  gradients: largest relative |Δ| " << worst << " (" << worst_name << ")\n";
}

void load_parameters(const std::map<std::string, at::Tensor>& params, const SafetensorsFile& weights) {
  const at::NoGradGuard no_grad;
  ASSERT_EQ(params.size(), weights.tensors.size());
  for (const auto& [name, p] : params) p.detach().copy_(weights.tensors.at(name));
}

// A method's loss on the golden batch against the golden's `prefix`total, `prefix`layerN and, after its
// backward, `prefix`grad.*; prints every |Δ| under `label`.
void expect_loss_equals_golden(TrainingMethod& method, const Batch& batch, const SafetensorsFile& golden,
                               const std::string& prefix, const std::string& label, std::int64_t num_layers) {
  const StepLoss loss = method.loss(batch);
  std::ostringstream report;
  report << label << ": |Δ| total " << expect_value(loss.total.item<double>(), meta_double(golden, prefix + "total"), "total");
  ASSERT_EQ(loss.per_layer.size(), static_cast<std::size_t>(num_layers));
  for (std::size_t l = 0; l < loss.per_layer.size(); ++l)
    report << ", layer " << l << " "
           << expect_value(loss.per_layer[l], meta_double(golden, prefix + "layer" + std::to_string(l)), "layer " + std::to_string(l));
  std::cout << report.str() << "\n";
  loss.total.backward();
  expect_gradients(method.named_parameters(), golden, prefix + "grad.");
}

TEST(IndexMemGolden, IndexerKLEqualsThePythonFormulas) {
  const std::string dir = test::test_data("indexmem");
  KVBOUND_REQUIRE_FILE(dir + "/golden.safetensors");
  const auto model = Backbone::load(dir, at::kFloat);
  const SafetensorsFile golden = read_safetensors(dir + "/golden.safetensors");
  const SafetensorsFile weights = read_safetensors(dir + "/indexer.safetensors");
  const Batch batch = test::golden_batch(golden);
  const std::int64_t settings = meta_int(golden, "kl_settings");
  ASSERT_GE(settings, 1);
  for (std::int64_t i = 0; i < settings; ++i) {
    const std::string k = "kl" + std::to_string(i) + ".";
    IndexMemSettings s;
    s.indexer.d_index = meta_int(golden, "d_index");
    s.indexer.key_heads = "kv";
    s.indexer.rope = true;
    s.indexer.relu = false;
    s.pool_name = golden.metadata.at(k + "pool");
    s.pool = ops::parse_pool_mode(s.pool_name);
    s.window = meta_int(golden, k + "window");
    s.min_gap = meta_int(golden, k + "min_gap");
    s.lead = meta_int(golden, k + "lead");
    const std::string what = s.pool_name + " window " + std::to_string(s.window) + " min_gap " + std::to_string(s.min_gap) +
                             " lead " + std::to_string(s.lead);
    SCOPED_TRACE(what);
    IndexMemIndexerMethod method(*model, s, 0);
    load_parameters(method.named_parameters(), weights);
    expect_loss_equals_golden(method, batch, golden, k, "L_KL " + what, model->config().num_layers);
  }
}

TEST(IndexMemGolden, MemoryMSEEqualsThePythonFormulas) {
  const std::string dir = test::test_data("indexmem");
  KVBOUND_REQUIRE_FILE(dir + "/golden.safetensors");
  const auto model = Backbone::load(dir, at::kFloat);
  const SafetensorsFile golden = read_safetensors(dir + "/golden.safetensors");
  const SafetensorsFile weights = read_safetensors(dir + "/memory.safetensors");
  for (const MemoryRead read : {MemoryRead::Add, MemoryRead::Slot}) {
    const std::string key = "mse_" + memory_read_name(read);
    SCOPED_TRACE(key);
    MemorySettings s;
    s.memory.read = read;
    s.memory.dim = meta_int(golden, "d_memory");
    s.policy = "streaming_llm";
    s.budgets.clear();
    std::istringstream budgets(golden.metadata.at("budgets"));
    for (std::string b; std::getline(budgets, b, ',');) s.budgets.push_back(std::stoll(b));
    s.chunk = meta_int(golden, "chunk");
    s.policy_config = policy_config({"streaming_llm.sinks=" + std::to_string(meta_int(golden, "sinks"))});
    MemoryMethod method(*model, s, 0);
    load_parameters(method.named_parameters(), weights);
    expect_loss_equals_golden(method, test::golden_batch(golden), golden, key + ".", key, model->config().num_layers);
  }
}

}  // namespace
}  // namespace kvbound
