// Data-parallel training on c10d (ProcessGroupGloo over loopback): `kvbound train --nproc 2` with batch B per
// process gives the losses and weights of one process with batch 2B, to 2e-6 (the gradient mean is summed in
// another order); a run resumes under another world size; the environment contract is checked.
#include <ATen/ops/equal.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/data_parallel.h"
#include "train/run_checkpoint.h"

namespace kvbound {
namespace {

// Pride and Prejudice is one document: every row of 32 tokens is full, so every rank's rows weigh alike and the
// mean of the shards' losses is the loss of the whole batch.
std::string train_yaml(const test::TinyCli& cli, const std::string& out, std::int64_t batch) {
  return "model:\n  path: " + cli.model + "\n  threads: 1\ndata:\n  train_text: " + test::asset("text/gutenberg1342_pride_and_prejudice.txt") +
         "\ntrain:\n  seq_len: 32\n  batch_size: " + std::to_string(batch) + "\n  steps: 4\n  warmup: 1\n  eval_every: 0\n"
         "  checkpoint_every: 2\ntrimkv:\n  budget: 8\n  gate_hidden: 16\n  bias_init: 2.0\nrun:\n  out_dir: " + out + "\n";
}

double max_weight_difference(const std::string& a, const std::string& b) {
  const SafetensorsFile x = read_safetensors(latest_checkpoint_path(a)), y = read_safetensors(latest_checkpoint_path(b));
  double worst = 0;
  for (const auto& [name, t] : x.tensors)
    if (name.rfind("optimizer.", 0) != 0) worst = std::max(worst, (t - y.tensors.at(name)).abs().max().item<double>());
  return worst;
}

TEST(DataParallelCli, TwoProcessesWithBatchBEqualOneProcessWith2B) {
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("data_parallel");
  std::ofstream(dir / "one.yaml") << train_yaml(cli, dir / "one", 4);
  std::ofstream(dir / "two.yaml") << train_yaml(cli, dir / "two", 2);
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "one.yaml"), &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "two.yaml") + " --nproc 2", &out, &err), 0) << err;
  const auto one = test::read_jsonl(dir / "one/metrics.jsonl"), two = test::read_jsonl(dir / "two/metrics.jsonl");
  ASSERT_EQ(one.size(), 4u);
  ASSERT_EQ(two.size(), 4u);  // rank 0 logs, once per step
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_NEAR(two[i]["loss"].get<double>(), one[i]["loss"].get<double>(), 2e-6 * std::abs(one[i]["loss"].get<double>()));
    EXPECT_EQ(two[i]["tokens"].get<std::int64_t>(), one[i]["tokens"].get<std::int64_t>());  // tokens summed over ranks
  }
  EXPECT_LT(max_weight_difference(dir / "one", dir / "two"), 2e-6);

  // A 1-process run stopped at step 2 resumes with 2 processes: the same config (B rows per process), so the
  // global batch doubles from there; the data position carries on.
  std::ofstream(dir / "mixed.yaml") << train_yaml(cli, dir / "mixed", 4);
  ASSERT_EQ(test::run_kvbound("train " + (dir / "mixed.yaml") + " --stop-after 2", &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound("train " + (dir / "mixed.yaml") + " --resume --nproc 2", &out, &err), 0) << err;
  const auto mixed = test::read_jsonl(dir / "mixed/metrics.jsonl");
  ASSERT_EQ(mixed.size(), 4u);
  EXPECT_EQ(mixed[1]["tokens"].get<std::int64_t>(), 2 * 4 * 32);
  EXPECT_EQ(mixed[3]["tokens"].get<std::int64_t>(), 2 * 4 * 32 + 2 * 8 * 32);
  EXPECT_EQ(read_safetensors(latest_checkpoint_path(dir / "mixed")).metadata.at("step"), "4");
}

TEST(DataParallelEnv, ReadsTorchrunsContractAndNamesABadValue) {
  ::unsetenv("WORLD_SIZE");
  EXPECT_FALSE(distributed_env().has_value());
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "10.0.0.1", 1);
  ::setenv("MASTER_PORT", "29511", 1);
  const auto env = distributed_env();
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 1);
  EXPECT_EQ(env->world, 2);
  EXPECT_EQ(env->master_addr, "10.0.0.1");
  EXPECT_EQ(env->master_port, 29511);
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(distributed_env(), Error);
  ::setenv("RANK", "one", 1);
  EXPECT_THROW(distributed_env(), Error);
  for (const char* name : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
}

}  // namespace
}  // namespace kvbound
