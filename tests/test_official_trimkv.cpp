// Parity with the official TRIM-KV release (PyPI trimkv 0.1.5 with transformers 4.57.1, installed test-only
// into .venv/official by scripts/setup.sh --test, apart from the golden references' own transformers): gates
// trained here on stories260K, exported with `kvbound export --format trimkv`, are loaded by the official
// loader unchanged, compute the same log β, and — with the trimkv policy in official mode (score offset 2, cut
// when M + buffer is reached) — keep the same positions after every token of a decode as the official
// TrimKVCache, at the same KL to the full cache. tests/parity/official_trimkv_parity.py does the official side.
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "checkpoints/safetensors_io.h"
#include "data/text_windows.h"
#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/run_checkpoint.h"

namespace kvbound {
namespace {

// Every layer's normalised input of one forward (what the gates read).
struct NormedInputs : AttentionHook {
  std::vector<at::Tensor> x;
  void before_attention(AttentionCall& call, KVCache&) override { x.push_back(call.normed_input); }
};

TEST(OfficialTrimKV, ExportLoadsUnchangedAndEvictsTheSameTokens) {
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("official_trimkv");
  std::string out, err;
  // Bias 2 spreads the retention scores, so eviction follows the gates rather than plain age.
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  steps: 20\n", "trimkv:\n  budget: 8\n  gate_hidden: 32\n  bias_init: 2.0\nrun:\n  out_dir: " + (dir / "run") + "\n");
  ASSERT_EQ(test::run_kvbound("train " + (dir / "train.yaml"), &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound("export " + (dir / "run") + " --format trimkv --out " + (dir / "official"), &out, &err), 0)
      << err;

  const c10::InferenceMode no_grad;
  const auto model = Backbone::load(cli.model, at::kFloat);
  const auto tokenizer = load_tokenizer(cli.model + "/tok512.bin");
  auto gates = std::make_shared<const RetentionGates>(RetentionGates::from_tensors(
      read_safetensors(latest_checkpoint_path(dir / "run")).tensors, model->config(), "run"));
  const std::vector<std::int64_t> window = TextWindows(cli.valid).sample(*tokenizer, 1, 96, 3).front();
  const at::Tensor tokens = at::tensor(window, at::TensorOptions().dtype(at::kLong));
  const std::int64_t T = tokens.size(0), L = model->config().num_layers, M = 8, buffer = 1;

  NormedInputs normed;
  KVCache full_cache = model->make_cache();
  const at::Tensor full = at::log_softmax(model->forward(tokens.unsqueeze(0), full_cache, &normed)[0], -1);
  std::vector<at::Tensor> log_beta;
  for (std::int64_t l = 0; l < L; ++l) log_beta.push_back(gates->log_beta(l, normed.x[static_cast<std::size_t>(l)])[0]);

  TrainedModules modules;
  modules.add<RetentionGates>(gates);
  auto policy = make_policy("trimkv", policy_config({"trimkv.score_offset=2", "trimkv.cut=reaches"}), modules);
  BudgetedCache budgeted(*policy, M, buffer);
  KVCache cache = model->make_cache();
  const std::int64_t hkv = model->config().num_kv_heads, widest = M + buffer;
  at::Tensor kept = at::full({T, L, hkv, widest}, -1.0, at::TensorOptions().dtype(at::kFloat));
  std::vector<at::Tensor> budgeted_logits;
  for (std::int64_t t = 0; t < T; ++t) {
    budgeted_logits.push_back(model->forward(tokens.narrow(0, t, 1).unsqueeze(0), cache, &budgeted)[0][0]);
    for (std::int64_t l = 0; l < L; ++l) {
      const at::Tensor pos = cache.positions(l)[0];  // [Hkv, N], in position order
      ASSERT_LE(pos.size(-1), widest);
      kept[t][l].narrow(-1, 0, pos.size(-1)).copy_(pos);
    }
  }
  const at::Tensor budgeted_lp = at::log_softmax(at::stack(budgeted_logits), -1);
  const at::Tensor kl = (full.exp() * (full - budgeted_lp)).sum(-1);
  EXPECT_GT(budgeted.evictions(), 0);

  const std::string reference = dir / "reference.safetensors";
  write_safetensors(reference,
                    {{"tokens", tokens.to(at::kFloat)}, {"log_beta", at::stack(log_beta)}, {"kept", kept}, {"kl", kl}},
                    {{"memory_size", std::to_string(M)}, {"buffer_size", std::to_string(buffer)}});
  const std::string command = "PYTHONPATH=" + std::string(KVBOUND_OFFICIAL_TRIMKV) + " " + KVBOUND_PYTHON + " " +
                              KVBOUND_PARITY_SCRIPT + " " + (dir / "official") + " " + cli.model + " " + reference;
  std::string report;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) report.append(buf, n);
  const int status = ::pclose(p);
  std::cout << report;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << report;
  EXPECT_NE(report.find("parity: OK"), std::string::npos) << report;
}

}  // namespace
}  // namespace kvbound
