// Every registered learned method through the real CLI on stories260K, driven by the method registry alone
// (a new registration is covered without touching this file): tiny training from an earlier stage when the
// method starts from one; the same run stopped half-way and resumed equals the uninterrupted one bit for bit;
// the export carries the method, and its bfloat16 export the same tensors rounded; `kvbound eval` of the
// policy that serves the method, with the bfloat16 export under every config key that takes it.
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <string>

#include "checkpoints/safetensors_io.h"
#include "modules/policies/registry.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/method_registry.h"
#include "train/run_checkpoint.h"

namespace kvbound {
namespace {

using test::kTinySections;

class EveryMethod : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryMethod, TrainsResumesBitIdenticallyExportsAndEvaluates) {
  const MethodRegistration& method = find_method(GetParam());
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("method_" + GetParam());
  std::string out, err;
  std::string init_from;
  if (method.starts_from) {
    std::ofstream(dir / "stage1.yaml") << test::tiny_train_yaml(
        cli, std::string("  method: ") + method.starts_from + "\n  steps: 2\n", kTinySections);
    ASSERT_EQ(test::run_kvbound("train " + (dir / "stage1.yaml") + " --set run.out_dir=" + (dir / "stage1"), &out, &err), 0)
        << err;
    init_from = "  init_from: " + (dir / "stage1") + "\n";
  }
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  method: " + GetParam() + "\n  steps: 4\n  checkpoint_every: 2\n" + init_from, kTinySections);
  const std::string train = "train " + (dir / "train.yaml") + " --set run.out_dir=";
  ASSERT_EQ(test::run_kvbound(train + (dir / "straight"), &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound(train + (dir / "resumed") + " --stop-after 2", &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound(train + (dir / "resumed") + " --resume", &out, &err), 0) << err;
  const SafetensorsFile straight = read_safetensors(latest_checkpoint_path(dir / "straight"));
  const SafetensorsFile resumed = read_safetensors(latest_checkpoint_path(dir / "resumed"));
  EXPECT_EQ(straight.metadata.at("step"), "4");
  EXPECT_EQ(straight.metadata.at("method"), GetParam());
  ASSERT_EQ(straight.tensors.size(), resumed.tensors.size());
  for (const auto& [name, t] : straight.tensors) EXPECT_TRUE(at::equal(resumed.tensors.at(name), t)) << name;

  const std::string file = dir / "export.safetensors";
  ASSERT_EQ(test::run_kvbound("export " + (dir / "straight") + " --out " + file, &out, &err), 0) << err;
  const SafetensorsFile exported = read_safetensors(file);
  EXPECT_EQ(exported.metadata.at("method"), GetParam());
  for (const auto& [name, t] : exported.tensors) EXPECT_EQ(name.rfind("optimizer.", 0), std::string::npos) << name;
  EXPECT_EQ(exported.metadata.count("cursor"), 0u);  // run bookkeeping stays behind
  // --dtype bfloat16: the same tensors rounded, and the serving policy below loads that file.
  const std::string bf16_file = dir / "export_bf16.safetensors";
  ASSERT_EQ(test::run_kvbound("export " + (dir / "straight") + " --dtype bfloat16 --out " + bf16_file, &out, &err), 0)
      << err;
  const SafetensorsFile bf16 = read_safetensors(bf16_file);
  ASSERT_EQ(bf16.tensors.size(), exported.tensors.size());
  for (const auto& [name, t] : exported.tensors) {
    const at::Tensor& half = bf16.tensors.at(name);
    if (t.is_floating_point()) EXPECT_EQ(half.scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(half, t.is_floating_point() ? t.to(at::kBFloat16) : t)) << name;
  }

  // The serving policy under this test's config (every key at its default, as in train.yaml).
  ConfigSchema schema;
  declare_method_train_keys(schema);
  declare_policy_keys(schema);
  const std::string policy = method.eval_policy(Config::load(schema, "", {}));
  std::string sets = "--set eval.policies=[" + policy + "]";
  ASSERT_FALSE(method.weights_keys.empty());
  for (const std::string& key : method.weights_keys) sets += " --set " + key + "=" + bf16_file;
  std::set<std::string> policies;
  ASSERT_EQ(test::tiny_eval(cli, dir / "eval", sets, &policies, &err), 0) << err;
  EXPECT_EQ(policies, std::set<std::string>{policy});
}

INSTANTIATE_TEST_SUITE_P(Registry, EveryMethod, ::testing::ValuesIn(method_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace kvbound
