// Tiny runs of the real CLI on stories260K, shared by the learned-method tests (trimkv, indexmem, memory):
// a train config of a few 2 × 32-token updates on one thread, metrics.jsonl reading, and a one-window eval.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "test_env.h"

namespace kvbound::test {

struct TinyCli {
  std::string model, train, valid;  // stories260K and its train / held-out text in assets/
};

inline TinyCli stories260k_cli() {
  return {asset("stories260K"), asset("text/tinystories_train_first2MiB.txt"),
          asset("text/tinystories_valid_first794KB_hf.txt")};
}

// Small sizes for every method's section (YAML to append to a train config), so any method trains in seconds.
constexpr const char* kTinySections =
    "trimkv:\n  budget: 8\n  gate_hidden: 16\nindexmem:\n  d_index: 8\n  window: 8\n"
    "memory:\n  dim: 8\n  budgets: [8, 12]\n  chunk: 4\n";

// A train config: stories260K, one thread, rows of 32 tokens, 2 per update, warm-up 1, no periodic eval;
// `train_keys` are more lines under `train:` (e.g. "  steps: 3\n"), `sections` more top-level YAML.
inline std::string tiny_train_yaml(const TinyCli& c, const std::string& train_keys, const std::string& sections) {
  return "model:\n  path: " + c.model + "\n  threads: 1\ndata:\n  train_text: " + c.train +
         "\ntrain:\n  seq_len: 32\n  batch_size: 2\n  warmup: 1\n  eval_every: 0\n" + train_keys + sections;
}

inline std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

// `kvbound eval` of one 64-token window at M = 16 (continuation) with more `--set` arguments; returns the
// exit code and the policies found in results.json.
inline int tiny_eval(const TinyCli& c, const std::string& out_dir, const std::string& sets, std::set<std::string>* policies,
                     std::string* err) {
  std::string out;
  const int rc = run_kvbound("eval --set model.path=" + c.model + " --set model.threads=1 --set eval.text=" + c.valid +
                                 " --set eval.budgets=[16] --set eval.tasks=[continuation] --set eval.context_len=64"
                                 " --set eval.prefill_len=32 --set eval.score_from=32 --set eval.num_windows=1"
                                 " --set eval.out_dir=" + out_dir + " " + sets,
                             &out, err);
  if (rc != 0) return rc;
  std::ifstream in(out_dir + "/results.json");
  const nlohmann::json results = nlohmann::json::parse(in);  // named: a range-for over a temporary's member dangles
  for (const auto& row : results["rows"]) policies->insert(row["policy"].get<std::string>());
  return rc;
}

}  // namespace kvbound::test
