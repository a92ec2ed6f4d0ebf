// The CUDA path against the CPU path, through the real CLI on stories260K, in float32 and bfloat16: for every
// registered method, a few training updates on `--device cuda` log the CPU run's losses; `kvbound eval` of every
// policy (the heuristics, every method's serving policy with its trained weights, and "+mem") on the GPU gives the
// CPU's KL, top-1 agreement and NLL; greedy `kvbound generate` writes the CPU's text in float32. Runs where the
// CUDA module loads and a CUDA device exists (scripts/gpu_check.sh on the GPU machine); skipped elsewhere.
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "base/config.h"
#include "eval/results.h"
#include "modules/policies/registry.h"
#include "ops/cuda_module.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

using test::kTinySections;

// Relative tolerance between the devices: float32 differs only in the order of reductions (cuBLAS, SDPA, the
// kernels); bfloat16 rounds every activation, so an eviction decision on a near tie may flip.
double tolerance(const std::string& dtype) { return dtype == "float32" ? 2e-4 : 5e-2; }

void expect_close(double cpu, double gpu, double rel, const std::string& what) {
  ASSERT_TRUE(std::isfinite(gpu)) << what << ": " << gpu;
  EXPECT_LE(std::abs(cpu - gpu), rel * std::max(1e-3, std::abs(cpu))) << what << ": cpu " << cpu << ", cuda " << gpu;
}

class DeviceParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string why;
    if (!load_cuda_kernels(&why)) GTEST_SKIP() << why;
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device on this machine";
  }
};

// The quality metrics of every row, "policy@M" -> metric -> value (speeds differ between devices by design).
std::map<std::string, std::map<std::string, double>> quality_rows(const std::string& results_json) {
  std::map<std::string, std::map<std::string, double>> rows;
  for (const ResultRow& row : read_results_json(results_json).rows)
    for (const char* metric : {"kl_to_full", "top1_agree", "nll", "peak_kv_bytes"})
      if (row.metrics.count(metric)) rows[row.policy + "@" + std::to_string(row.budget)][metric] = row.metrics.at(metric);
  return rows;
}

TEST_P(DeviceParity, EveryMethodTrainsAndEveryPolicyEvaluatesAsOnTheCpu) {
  const std::string dtype = GetParam();
  const double rel = tolerance(dtype);
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("device_parity_" + dtype);
  std::string out, err;
  // (policies, --set arguments) of each eval: one per method (its serving policy with the CPU-trained export),
  // and one of every policy no method serves (the heuristics).
  std::vector<std::pair<std::string, std::string>> evals;
  std::set<std::string> heuristics(policy_names().begin(), policy_names().end());
  ConfigSchema schema;
  declare_method_train_keys(schema);
  declare_policy_keys(schema);
  const Config defaults = Config::load(schema, "", {});
  for (const std::string& name : method_names()) {
    const MethodRegistration& method = find_method(name);
    std::string init_from;
    if (method.starts_from) init_from = "  init_from: " + (dir / (std::string(method.starts_from) + "_cpu")) + "\n";
    std::ofstream(dir / (name + ".yaml")) << test::tiny_train_yaml(
        cli, "  method: " + name + "\n  steps: 4\n" + init_from, std::string(kTinySections) + "model:\n  dtype: " + dtype + "\n");
    std::map<std::string, std::vector<double>> losses;
    for (const std::string device : {"cpu", "cuda"}) {
      const std::string run = dir / (name + "_" + device);
      ASSERT_EQ(test::run_kvbound("train " + (dir / (name + ".yaml")) + " --set run.out_dir=" + run +
                                      " --set model.device=" + device,
                                  &out, &err),
                0)
          << name << " on " << device << ": " << err;
      for (const auto& line : test::read_jsonl(run + "/metrics.jsonl"))
        if (line["type"] == "train") losses[device].push_back(line["loss"].get<double>());
    }
    ASSERT_EQ(losses["cpu"].size(), 4u) << name;
    ASSERT_EQ(losses["cuda"].size(), losses["cpu"].size()) << name;
    for (std::size_t s = 0; s < losses["cpu"].size(); ++s)
      expect_close(losses["cpu"][s], losses["cuda"][s], rel, name + " " + dtype + " loss at update " + std::to_string(s + 1));

    const std::string exported = dir / (name + ".safetensors");
    ASSERT_EQ(test::run_kvbound("export " + (dir / (name + "_cpu")) + " --out " + exported, &out, &err), 0) << err;
    const std::string policy = method.eval_policy(defaults);
    heuristics.erase(policy);
    std::string sets;
    for (const std::string& key : method.weights_keys) sets += " --set " + key + "=" + exported;
    evals.emplace_back(policy, sets);
  }
  std::string heuristic_list = "full";
  for (const std::string& p : heuristics) heuristic_list += "," + p;
  evals.emplace_back(heuristic_list, "");

  for (std::size_t e = 0; e < evals.size(); ++e) {
    const auto& [policies, sets] = evals[e];
    std::map<std::string, std::map<std::string, std::map<std::string, double>>> rows;
    for (const std::string device : {"cpu", "cuda"}) {
      const std::string out_dir = dir / ("eval" + std::to_string(e) + "_" + device);
      std::set<std::string> seen;
      ASSERT_EQ(test::tiny_eval(cli, out_dir,
                                "--set eval.policies=[" + policies + "] --set model.dtype=" + dtype +
                                    " --set model.device=" + device + sets,
                                &seen, &err),
                0)
          << policies << " on " << device << ": " << err;
      rows[device] = quality_rows(out_dir + "/results.json");
    }
    ASSERT_EQ(rows["cpu"].size(), rows["cuda"].size()) << policies;
    for (const auto& [row, metrics] : rows["cpu"])
      for (const auto& [metric, value] : metrics) {
        ASSERT_TRUE(rows["cuda"].count(row) && rows["cuda"][row].count(metric)) << row << " " << metric;
        if (std::string(metric) == "peak_kv_bytes")  // the same entries in the same dtype
          EXPECT_EQ(value, rows["cuda"][row][metric]) << row;
        else
          expect_close(value, rows["cuda"][row][metric], rel, row + " " + metric + " (" + dtype + ")");
      }
  }

  if (dtype == "float32") {  // greedy decoding: a bfloat16 near tie may pick another token, float32's may not
    std::map<std::string, std::string> text;
    for (const std::string device : {"cpu", "cuda"}) {
      ASSERT_EQ(test::run_kvbound("generate --model " + cli.model + " --prompt 'Once upon a time' --max-new-tokens 48 "
                                  "--device " + device,
                                  &text[device], &err),
                0)
          << err;
    }
    EXPECT_EQ(text["cpu"], text["cuda"]);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, DeviceParity, ::testing::Values("float32", "bfloat16"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace kvbound
