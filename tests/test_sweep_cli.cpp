// `kvbound sweep` end to end on stories260K (tiny runs, one thread each): a grid of 2 train points x 2 seeds x
// 2 eval variants with --jobs 2 writes every run, the summary (mean ± std over seeds, the best row per budget)
// and its plots; killed mid-way and re-run, it finishes only what was left; re-run after a config or a file
// changed, it redoes what they feed; killed alone, it leaves no step running; a failing point is reported while
// the others complete.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "test_env.h"
#include "tiny_cli_runs.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

void write_sweep(const test::TempDir& dir, const std::string& budgets) {
  const test::TinyCli cli = test::stories260k_cli();
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(cli, "  steps: 3\n", "trimkv:\n  gate_hidden: 16\n");
  std::ofstream(dir / "eval.yaml") << "model:\n  path: " << cli.model << "\neval:\n  text: " << cli.valid
                                   << "\n  budgets: [16]\n  tasks: [continuation]\n  context_len: 64\n  prefill_len: 32\n"
                                      "  score_from: 32\n  num_windows: 1\n";
  std::ofstream(dir / "sweep.yaml") << "train: " << (dir / "train.yaml") << "\neval: " << (dir / "eval.yaml")
                                    << "\nout_dir: " << (dir / "out") << "\nseeds: [0, 1]\nset:\n  eval.policies: [trimkv, h2o]\n"
                                       "grid:\n  trimkv.budget: " << budgets << "\neval_grid:\n  trimkv.score_offset: [0, 2]\n";
}

std::vector<std::string> csv_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<fs::path> results_files(const fs::path& out) {
  std::vector<fs::path> found;
  if (!fs::exists(out)) return found;
  for (const auto& e : fs::recursive_directory_iterator(out))
    if (e.path().filename() == "results.json") found.push_back(e.path());
  return found;
}

// `kvbound sweep DIR/sweep.yaml --jobs N` started in its own process group (log in DIR/first.log); its pid, or -1.
long start_sweep_in_background(const test::TempDir& dir, int jobs) {
  const std::string command = "setsid " + test::kvbound_bin() + " sweep " + (dir / "sweep.yaml") + " --jobs " +
                              std::to_string(jobs) + " >" + (dir / "first.log") + " 2>&1 & echo $!";
  FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) return -1;
  long pid = -1;
  if (std::fscanf(p, "%ld", &pid) != 1) pid = -1;
  ::pclose(p);
  return pid;
}

TEST(SweepCli, RunsEveryPointAndSummarisesOverSeeds) {
  test::TempDir dir("sweep_all");
  write_sweep(dir, "[4, 8]");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("sweep " + (dir / "sweep.yaml") + " --jobs 2", &out, &err), 0) << err;
  EXPECT_EQ(results_files(dir / "out").size(), 2u * 2u * 2u);  // points x seeds x eval variants
  const std::vector<std::string> csv = csv_lines(dir / "out/summary.csv");
  ASSERT_EQ(csv.size(), 1u + 2u * 2u * 2u);  // header + (point x variant x policy)
  EXPECT_EQ(csv[0].rfind("trimkv.budget,trimkv.score_offset,policy,budget,seeds,kl_to_full_mean,kl_to_full_std", 0), 0u)
      << csv[0];
  int best = 0;
  for (std::size_t i = 1; i < csv.size(); ++i) {
    EXPECT_NE(csv[i].find(",16,2,"), std::string::npos) << csv[i];  // M = 16, two seeds averaged
    best += csv[i].back() == '1';
  }
  EXPECT_EQ(best, 1);  // one best row for the one budget
  EXPECT_NE(out.find("| trimkv.budget | trimkv.score_offset | policy |"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(dir / "out/plots/kl_to_full_vs_trimkv.budget_M16.png"));
  EXPECT_TRUE(fs::exists(dir / "out/plots/kl_to_full_vs_trimkv.score_offset_M16.png"));
}

// Without a grid or a training config (how the README's table is made: one eval config, three eval seeds), the
// sweep evaluates each seed, averages them, and plots the means against the budget.
TEST(SweepCli, EvalOnlySweepAveragesSeedsAndPlotsTheMeansAgainstTheBudget) {
  test::TempDir dir("sweep_eval_only");
  const test::TinyCli cli = test::stories260k_cli();
  std::ofstream(dir / "eval.yaml") << "model:\n  path: " << cli.model << "\n  threads: 1\neval:\n  text: " << cli.valid
                                   << "\n  policies: [full, h2o, streaming_llm]\n  budgets: [8, 16]\n  tasks: [continuation]\n"
                                      "  context_len: 64\n  prefill_len: 32\n  score_from: 32\n  num_windows: 1\n";
  std::ofstream(dir / "sweep.yaml") << "eval: " << (dir / "eval.yaml") << "\nout_dir: " << (dir / "out") << "\nseeds: [0, 1]\n";
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("sweep " + (dir / "sweep.yaml") + " --jobs 2", &out, &err), 0) << err;
  EXPECT_EQ(results_files(dir / "out").size(), 2u);  // one point ("base") x two seeds
  const std::vector<std::string> csv = csv_lines(dir / "out/summary.csv");
  ASSERT_EQ(csv.size(), 1u + 1u + 2u * 2u) << out;  // header, full, (h2o, streaming_llm) x two budgets
  EXPECT_EQ(csv[0].rfind("policy,budget,seeds,kl_to_full_mean,kl_to_full_std", 0), 0u) << csv[0];
  // The two seeds score different windows: h2o's KL differs between them, so its std over seeds is not 0.
  for (std::size_t i = 1; i < csv.size(); ++i) {
    std::vector<std::string> fields;
    std::istringstream row(csv[i]);
    for (std::string field; std::getline(row, field, ',');) fields.push_back(field);
    ASSERT_GE(fields.size(), 5u) << csv[i];
    EXPECT_EQ(fields[2], "2") << csv[i];  // seeds averaged
    if (fields[0] == "h2o") EXPECT_GT(std::stod(fields[4]), 0.0) << csv[i];  // kl_to_full_std
  }
  for (const char* metric : {"kl_to_full", "top1_agree", "nll"})
    EXPECT_TRUE(fs::exists(fs::path(dir / "out/plots/vs_budget/base") / (std::string(metric) + ".png"))) << metric;
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Killed (SIGKILL to its whole process group) after its first results, the sweep re-run redoes nothing that
// finished: the early results keep their modification time, and every run ends complete.
TEST(SweepCli, AKilledSweepReRunFinishesOnlyWhatWasLeft) {
  test::TempDir dir("sweep_kill");
  write_sweep(dir, "[4, 8]");
  const long pid = start_sweep_in_background(dir, 1);
  ASSERT_GT(pid, 0);
  std::vector<fs::path> early;
  for (int i = 0; i < 600 && early.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    early = results_files(dir / "out");
  }
  ASSERT_FALSE(early.empty()) << "no result within a minute";
  ::kill(-static_cast<pid_t>(pid), SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::size_t done_before = results_files(dir / "out").size();
  ASSERT_LT(done_before, 8u) << "the sweep finished before it could be killed";
  const auto stamp = fs::last_write_time(early.front());

  std::string out, err;
  ASSERT_EQ(test::run_kvbound("sweep " + (dir / "sweep.yaml") + " --jobs 2", &out, &err), 0) << err;
  EXPECT_EQ(results_files(dir / "out").size(), 8u);
  EXPECT_EQ(fs::last_write_time(early.front()), stamp) << early.front();
  // The re-run ran fewer eval steps than the sweep has (the finished ones were skipped).
  EXPECT_EQ(count_of(err, ": eval "), 8u - done_before) << err;
}

// A re-run skips a finished step only while its inputs are unchanged: a changed eval key or a changed byte of a
// file the eval config names redoes the evals (saying what changed), an unchanged re-run redoes nothing.
TEST(SweepCli, AReRunRedoesTheEvalsWhoseConfigOrFilesChanged) {
  test::TempDir dir("sweep_stale_eval");
  const test::TinyCli cli = test::stories260k_cli();
  fs::copy_file(cli.valid, dir / "text.txt");
  const auto write_eval = [&](int windows) {
    std::ofstream(dir / "eval.yaml") << "model:\n  path: " << cli.model << "\neval:\n  text: " << (dir / "text.txt")
                                     << "\n  policies: [h2o]\n  budgets: [8]\n  tasks: [continuation]\n  context_len: 64\n"
                                        "  prefill_len: 32\n  score_from: 32\n  num_windows: " << windows << "\n";
  };
  write_eval(1);
  std::ofstream(dir / "sweep.yaml") << "eval: " << (dir / "eval.yaml") << "\nout_dir: " << (dir / "out") << "\nseeds: [0, 1]\n";
  const std::string sweep = "sweep " + (dir / "sweep.yaml");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound(sweep + " --jobs 2", &out, &err), 0) << err;
  const fs::path first = dir / "out/base/seed0/eval/base/results.json";
  ASSERT_TRUE(fs::exists(first));
  const auto stamp = fs::last_write_time(first);

  ASSERT_EQ(test::run_kvbound(sweep, &out, &err), 0) << err;  // --jobs 1: another thread share, the same inputs
  EXPECT_EQ(count_of(err, ": eval base"), 0u) << err;
  EXPECT_EQ(fs::last_write_time(first), stamp);

  write_eval(2);
  ASSERT_EQ(test::run_kvbound(sweep, &out, &err), 0) << err;
  EXPECT_EQ(count_of(err, ": eval base: inputs changed since it ran (eval.num_windows: 2): redoing"), 2u) << err;
  EXPECT_EQ(count_of(err, ": eval base\n"), 2u) << err;

  std::ofstream(dir / "text.txt", std::ios::app) << "One more line.\n";
  ASSERT_EQ(test::run_kvbound(sweep, &out, &err), 0) << err;
  EXPECT_EQ(count_of(err, "inputs changed since it ran (file " + (dir / "text.txt") + " fnv1a64:"), 2u) << err;
  EXPECT_EQ(count_of(err, ": eval base\n"), 2u) << err;
}

// A changed train key retrains the point and redoes its export and evals; the re-run's results are those of a
// fresh sweep with the new config.
TEST(SweepCli, AReRunRetrainsAPointWhoseTrainConfigChanged) {
  test::TempDir dir("sweep_stale_train");
  write_sweep(dir, "[4]");
  const std::string sweep = "sweep " + (dir / "sweep.yaml") + " --jobs 2";
  std::string out, err;
  ASSERT_EQ(test::run_kvbound(sweep, &out, &err), 0) << err;
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(test::stories260k_cli(), "  steps: 4\n", "trimkv:\n  gate_hidden: 16\n");
  ASSERT_EQ(test::run_kvbound(sweep, &out, &err), 0) << err;
  EXPECT_EQ(count_of(err, ": train: inputs changed since it ran (train.steps: 4): redoing"), 2u) << err;
  EXPECT_EQ(count_of(err, ": train\n"), 2u) << err;
  EXPECT_EQ(count_of(err, ": export\n"), 2u) << err;
  EXPECT_EQ(count_of(err, ": eval "), 4u) << err;  // 2 seeds x 2 eval variants
  EXPECT_EQ(results_files(dir / "out").size(), 4u);
  std::ifstream metrics(dir / "out/trimkv.budget=4/seed0/train/metrics.jsonl");
  std::size_t updates = 0;
  for (std::string line; std::getline(metrics, line);) updates += line.find("\"type\":\"train\"") != std::string::npos;
  EXPECT_EQ(updates, 4u);  // the run was redone from scratch, not resumed past its old end
}

// Processes still running whose command line mentions `text` (a zombie's is empty).
std::vector<std::string> live_processes_mentioning(const std::string& text) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator("/proc")) {
    std::ifstream in(e.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), {});
    if (cmdline.find(text) != std::string::npos) found.push_back(e.path().filename().string() + ": " + cmdline.c_str());
  }
  return found;
}

// The sweep alone killed (SIGKILL to its pid, as `kill PID` would, not to its group): its running steps end too,
// so no orphan writes into a run folder that a re-run is about to resume.
TEST(SweepCli, KillingTheSweepStopsItsSteps) {
  test::TempDir dir("sweep_orphans");
  write_sweep(dir, "[4, 8]");
  std::ofstream(dir / "train.yaml") << test::tiny_train_yaml(test::stories260k_cli(), "  steps: 100000\n",  // far past the 10 s
                                                            "trimkv:\n  gate_hidden: 16\n");
  const long pid = start_sweep_in_background(dir, 2);
  ASSERT_GT(pid, 0);
  const std::string runs = dir / "out";
  std::vector<std::string> steps;
  for (int i = 0; i < 600 && steps.empty(); ++i) {
    for (const std::string& proc : live_processes_mentioning(runs))
      if (proc.find(": kvbound") != std::string::npos) steps.push_back(proc);
    if (steps.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_FALSE(steps.empty()) << "no step started within a minute";
  ::kill(static_cast<pid_t>(pid), SIGKILL);
  std::vector<std::string> left = live_processes_mentioning(runs);
  for (int i = 0; i < 100 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = live_processes_mentioning(runs);
  }
  EXPECT_TRUE(left.empty()) << left.size() << " steps outlived the sweep by 10 s, e.g. " << left.front();
}

TEST(SweepCli, AFailingPointIsReportedAndTheOthersComplete) {
  test::TempDir dir("sweep_fail");
  write_sweep(dir, "[0, 4]");  // trimkv.budget 0 is rejected by kvbound train
  std::string out, err;
  EXPECT_EQ(test::run_kvbound("sweep " + (dir / "sweep.yaml") + " --jobs 2", &out, &err), 1);
  EXPECT_NE(err.find("trimkv.budget=0 seed 0: train FAILED: "), std::string::npos) << err;
  EXPECT_NE(err.find("trimkv.budget: must be >= 1"), std::string::npos) << err;
  EXPECT_NE(err.find("2 of 4 runs failed"), std::string::npos) << err;
  EXPECT_EQ(results_files(dir / "out/trimkv.budget=4").size(), 4u);
  EXPECT_TRUE(fs::exists(dir / "out/summary.md"));
}

TEST(SweepCli, AnUnknownKeyFailsBeforeAnythingRuns) {
  test::TempDir dir("sweep_typo");
  write_sweep(dir, "[4]");
  std::ofstream(dir / "sweep.yaml", std::ios::app) << "  trimkv.budgt: [1]\n";  // under eval_grid
  std::string out, err;
  EXPECT_EQ(test::run_kvbound("sweep " + (dir / "sweep.yaml"), &out, &err), 1);
  EXPECT_NE(err.find("trimkv.budgt: not an eval key (did you mean"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

}  // namespace
}  // namespace kvbound
