// TensorBoard logging: CRC-32C against the RFC 3720 test vectors, histograms that count every value, and the
// real CLI's event files read back with the `tensorboard` package (tests/tensorboard/check_event_files.py):
// every metrics.jsonl number a scalar with its steps and values, every eval's log β histograms per layer —
// also after a run was stopped and resumed (the event files are rewritten from the lines the resume kept).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fstream>
#include <string>

#include "base/crc32c.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/tensorboard/event_writer.h"

namespace kvbound {
namespace {

TEST(Crc32c, MatchesTheRfc3720TestVectors) {
  std::string bytes(32, '\0');
  EXPECT_EQ(crc32c(bytes), 0x8A9136AAu);
  bytes.assign(32, '\xFF');
  EXPECT_EQ(crc32c(bytes), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>(i);
  EXPECT_EQ(crc32c(bytes), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>(31 - i);
  EXPECT_EQ(crc32c(bytes), 0x113FDB5Cu);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  // TFRecord's mask: rotate right by 15, add 0xa282ead8.
  EXPECT_EQ(masked_crc32c("123456789"), ((0xE3069283u >> 15) | (0xE3069283u << 17)) + 0xa282ead8u);
}

TEST(Histogram, CountsEveryValueBetweenMinAndMax) {
  const Histogram h = make_histogram({-3.0, -1.0, 0.0, 0.5, 0.5, 2.0}, 5);
  EXPECT_EQ(h.min, -3.0);
  EXPECT_EQ(h.max, 2.0);
  EXPECT_EQ(h.num, 6.0);
  EXPECT_DOUBLE_EQ(h.sum, -1.0);
  EXPECT_DOUBLE_EQ(h.sum_squares, 9.0 + 1.0 + 0.25 + 0.25 + 4.0);
  ASSERT_EQ(h.bucket.size(), 5u);
  EXPECT_EQ(h.bucket_limit.back(), 2.0);
  EXPECT_EQ(h.bucket[0] + h.bucket[1] + h.bucket[2] + h.bucket[3] + h.bucket[4], 6.0);
  EXPECT_EQ(h.bucket[4], 1.0);  // the maximum lands in the last bucket
  EXPECT_EQ(make_histogram({1.5, 1.5}).bucket.size(), 1u);
}

TEST(TensorBoardCli, EventFilesHoldEveryMetricAlsoAfterAResume) {
  const test::TinyCli cli = test::stories260k_cli();
  test::TempDir dir("tensorboard_cli");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(
      cli, "  steps: 4\n  eval_windows: 2\n  eval_context_len: 64\n  eval_prefill_len: 32\n  eval_chunk_size: 8\n",
      "trimkv:\n  budget: 8\n  gate_hidden: 16\nrun:\n  out_dir: " + (dir / "run") + "\n");
  const std::string train = "train " + (dir / "train.yaml") + " --set train.eval_every=2 --set data.eval_text=" + cli.valid;
  std::string out, err;
  ASSERT_EQ(test::run_kvbound(train + " --stop-after 3", &out, &err), 0) << err;
  ASSERT_EQ(test::run_kvbound(train + " --resume", &out, &err), 0) << err;
  const std::string command = std::string(KVBOUND_PYTHON) + " " + KVBOUND_TENSORBOARD_CHECK + " " + (dir / "run") + " 2>&1";
  std::string report;
  FILE* p = ::popen(command.c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) report.append(buf, n);
  const int status = ::pclose(p);
  std::cout << report;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << report;
  EXPECT_NE(report.find("histogram tags match"), std::string::npos) << report;
  EXPECT_NE(report.find("5 histogram tags"), std::string::npos) << report;  // log β of stories260K's 5 layers
}

}  // namespace
}  // namespace kvbound
