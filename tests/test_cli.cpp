// The real `kvbound` binary, run as a user would: help lists working commands, generate reproduces
// llama2.c on stories260K, bad input gives one line on stderr naming the file and a non-zero exit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/bf16x3_linear.h"
#include "test_env.h"

namespace fs = std::filesystem;

namespace {

struct CliRun {
  int code;
  std::string out, err;
};

CliRun run(const std::string& args) {
  const fs::path err_file = fs::temp_directory_path() / ("kvbound_cli_err_" + std::to_string(::getpid()));
  const std::string cmd = kvbound::test::kvbound_bin() + " " + args + " 2>" + err_file.string();
  CliRun r{};
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_file);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  fs::remove(err_file);
  return r;
}

std::string quote(const std::string& s) { return "'" + s + "'"; }

TEST(Cli, HelpListsTheWorkingCommands) {
  const CliRun r = run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("  info "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  generate "), std::string::npos) << r.out;
  const CliRun none = run("");
  EXPECT_NE(none.code, 0);
  const CliRun bad = run("frobnicate");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("unknown command 'frobnicate'"), std::string::npos);
}

TEST(Cli, GenerateReproducesLlama2cOnStories260K) {
  const std::string dir = kvbound::test::asset("stories260K");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  // The tokenizer (tok512.bin) is found beside the weights.
  const CliRun r = run("generate --model " + quote(dir) + " --max-new-tokens 200 --threads 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Once upon a time, there was a little girl named Lily.", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("Lily didn't want to help her mom, so she\n"), std::string::npos) << r.out;
  const CliRun prompted = run("generate --model " + quote(dir) + " --prompt 'Once upon a time, there was a' "
                           "--max-new-tokens 7 --threads 1");  // BOS is prepended, as run.c does
  ASSERT_EQ(prompted.code, 0) << prompted.err;
  EXPECT_EQ(prompted.out, " little girl named Lily.\n");
}

std::vector<std::pair<std::string, std::string>> read_samples(const fs::path& jsonl) {
  std::ifstream in(jsonl);
  std::vector<std::pair<std::string, std::string>> samples;  // (prompt, text)
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    samples.emplace_back(j.at("prompt").get<std::string>(), j.at("text").get<std::string>());
  }
  return samples;
}

// --prompts: every prompt sampled --samples times as one batch into a JSON-lines file. Greedy rows equal the
// one-prompt generation (the batch changes nothing), sampled rows differ from each other, and the same seed
// writes the same file.
TEST(Cli, GenerateSamplesEveryPromptIntoJsonLines) {
  const std::string dir = kvbound::test::asset("stories260K");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  kvbound::test::TempDir tmp("generate_samples");
  std::ofstream(tmp / "prompts.txt") << "Once upon a time\n\nThe little dog\n";
  const std::string base = "generate --model " + quote(dir) + " --threads 1 --max-new-tokens 30 --prompts " +
                           (tmp / "prompts.txt") + " --samples 3";
  const CliRun greedy = run(base + " --out " + (tmp / "greedy.jsonl"));
  ASSERT_EQ(greedy.code, 0) << greedy.err;
  const auto rows = read_samples(tmp / "greedy.jsonl");
  ASSERT_EQ(rows.size(), 6u);
  for (const std::string prompt : {"Once upon a time", "The little dog"}) {
    const CliRun one = run("generate --model " + quote(dir) + " --threads 1 --max-new-tokens 30 --prompt " + quote(prompt));
    ASSERT_EQ(one.code, 0) << one.err;
    for (const auto& [p, text] : rows)
      if (p == prompt) EXPECT_EQ(text, prompt + one.out.substr(0, one.out.size() - 1)) << prompt;  // stdout ends in \n
  }
  ASSERT_EQ(run(base + " --temperature 1 --seed 5 --out " + (tmp / "a.jsonl")).code, 0);
  ASSERT_EQ(run(base + " --temperature 1 --seed 5 --out " + (tmp / "b.jsonl")).code, 0);
  const auto a = read_samples(tmp / "a.jsonl"), b = read_samples(tmp / "b.jsonl");
  EXPECT_EQ(a, b);
  ASSERT_EQ(a.size(), 6u);
  EXPECT_NE(a[0].second, a[1].second);
  EXPECT_EQ(a[3].second.rfind("The little dog", 0), 0u) << a[3].second;
  // Near-uniform sampling draws stories260K's byte pieces (<0x80>..<0xFF> alone are no UTF-8): each such byte is
  // written as U+FFFD, so every line stays JSON and the file prepares.
  const CliRun hot = run(base + " --temperature 50 --seed 1 --out " + (tmp / "hot.jsonl"));
  ASSERT_EQ(hot.code, 0) << hot.err;
  std::size_t replaced = 0;
  for (const auto& [p, text] : read_samples(tmp / "hot.jsonl")) replaced += text.find("\xEF\xBF\xBD") != std::string::npos;
  EXPECT_GT(replaced, 0u) << "no sample drew a lone byte piece: the test no longer exercises the replacement";
  const CliRun prepared = run("prepare --tokenizer " + quote(kvbound::test::asset("stories260K/tok512.bin")) + " --output " + (tmp / "hot.h5") + " " + (tmp / "hot.jsonl"));
  EXPECT_EQ(prepared.code, 0) << prepared.err;

  const CliRun lonely = run("generate --model " + quote(dir) + " --samples 3");
  EXPECT_NE(lonely.code, 0);
  EXPECT_NE(lonely.err.find("--samples: needs --prompts and --out"), std::string::npos) << lonely.err;
  const CliRun no_out = run("generate --model " + quote(dir) + " --prompts " + (tmp / "prompts.txt"));
  EXPECT_NE(no_out.code, 0);
  EXPECT_NE(no_out.err.find("--prompts and --out go together"), std::string::npos) << no_out.err;
}

TEST(Cli, InfoDescribesTheModel) {
  const std::string dir = kvbound::test::asset("stories260K");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  const CliRun r = run("info --model " + quote(dir));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("layers            5\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("8 query, 4 key/value (head_dim 8)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("F32 x47"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameters        260032 "), std::string::npos) << r.out;
}

TEST(Cli, BadInputIsOneLineNamingTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("kvbound_cli_bad_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path gguf = dir / "broken.gguf";
  std::ofstream(gguf) << "NOPE this is not a gguf file at all";
  for (const std::string& args : {"info --model " + gguf.string(), "info --model " + (dir / "nothing").string(),
                                  "info --model " + dir.string(), "generate --max-new-tokens -3 --model " + gguf.string(),
                                  "info --dtype float8 --model " + gguf.string()}) {
    const CliRun r = run(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_TRUE(r.out.empty()) << args << ": " << r.out;
    ASSERT_FALSE(r.err.empty()) << args;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("error: "), std::string::npos) << r.err;
  }
  const CliRun r = run("info --model " + gguf.string());
  EXPECT_NE(r.err.find(gguf.string() + ": "), std::string::npos) << r.err;
  fs::remove_all(dir);
}

// The device is resolved once, before any work: a CUDA device this machine cannot use is one line naming the
// option or key (on a machine with a GPU, an index it does not have is). A bad spelling likewise.
TEST(Cli, AnUnavailableDeviceIsOneLineNamingTheKey) {
  const std::string dir = kvbound::test::asset("stories260K");
  for (const auto& [args, key] :
       std::vector<std::pair<std::string, std::string>>{{"generate --model " + quote(dir) + " --device cuda:999", "--device"},
                                                        {"info --model " + quote(dir) + " --device tpu", "--device"},
                                                        {"eval --set model.path=" + quote(dir) + " --set eval.text=" +
                                                             quote(kvbound::test::asset("text/tinystories_valid_first794KB_hf.txt")) +
                                                             " --set model.device=cuda:999",
                                                         "config: model.device"}}) {
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << args;
    EXPECT_NE(r.err.find(key + ": "), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// model.fp32_products / --fp32-products: a bad value is one line naming the option or key; bf16x3 where it cannot
// run (bfloat16 compute) runs on with the model's own GEMM and says so in one line on stderr.
TEST(Cli, Float32ProductsAreCheckedAndAFallbackIsSaid) {
  const std::string dir = quote(kvbound::test::asset("stories260K"));
  for (const auto& [args, key] : std::vector<std::pair<std::string, std::string>>{
           {"info --model " + dir + " --fp32-products float16", "--fp32-products: "},
           {"eval --set model.path=" + dir + " --set eval.text=" +
                quote(kvbound::test::asset("text/tinystories_valid_first794KB_hf.txt")) + " --set model.fp32_products=fast",
            "config: model.fp32_products: "}}) {
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << args;
    EXPECT_NE(r.err.find(key + "unknown float32 products"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  const CliRun r = run("generate --model " + dir + " --dtype bfloat16 --fp32-products bf16x3 --max-new-tokens 4");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(r.out.empty());
  EXPECT_NE(r.err.find("--fp32-products: bf16x3 runs only for float32 compute on a CPU with AMX"), std::string::npos)
      << r.err;
  // info says which products a float32 model forms.
  const CliRun info = run("info --model " + dir + " --fp32-products bf16x3");
  EXPECT_EQ(info.code, 0) << info.err;
  EXPECT_NE(info.out.find(kvbound::ops::bf16x3_available() ? "fp32_products     bf16x3 (AMX tiles)\n"
                                                          : "fp32_products     float32 GEMM\n"),
            std::string::npos)
      << info.out;
}

// eval.layer_budget_shares needs one finite share > 0 per layer: anything else is one line naming the key, and
// nothing is written.
TEST(Cli, BadLayerBudgetSharesAreOneLineNamingTheKey) {
  const fs::path out = fs::temp_directory_path() / ("kvbound_cli_shares_" + std::to_string(::getpid()));
  for (const auto& [shares, message] : std::vector<std::pair<std::string, std::string>>{
           {"[1,2]", "has 2 shares but the model has 5 layers"}, {"[1,1,0,1,1]", "every share must be finite and > 0"}}) {
    const CliRun r = run("eval --set model.path=" + quote(kvbound::test::asset("stories260K")) + " --set eval.text=" +
                         quote(kvbound::test::asset("text/tinystories_valid_first794KB_hf.txt")) +
                         " --set eval.layer_budget_shares=" + shares + " --set eval.out_dir=" + out.string());
    EXPECT_EQ(r.code, 1) << shares;
    EXPECT_NE(r.err.find("config: eval.layer_budget_shares: " + message), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_FALSE(fs::exists(out)) << shares;
  }
}

// Every config the repository ships resolves against its command's schema (train for configs/trimkv and
// configs/indexmem, eval for configs/eval: with the model pointed nowhere, the first error is the model's;
// configs/sweeps: a dry run resolves its keys and base configs).
// Every config override is its own --set: a second key=value after one --set is refused in one line naming it,
// before anything runs (cxxopts would set it aside and the run would go on without it).
TEST(Cli, AnArgumentNoOptionTakesIsRefused) {
  const fs::path out = fs::temp_directory_path() / ("kvbound_cli_stray_" + std::to_string(::getpid()));
  const std::string config = quote(std::string(KVBOUND_CONFIGS) + "/trimkv/stories260k.yaml");
  for (const std::string& args : {"train " + config + " --set train.steps=2 run.out_dir=" + out.string(),
                                  "eval " + config + " stray", "info --model " + quote(kvbound::test::default_model()) + " stray"}) {
    const CliRun r = run(args);
    EXPECT_EQ(r.code, 1) << args;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("error: arguments: unexpected '"), std::string::npos) << args << ": " << r.err;
  }
  EXPECT_FALSE(fs::exists(out));
}

TEST(Cli, EveryShippedConfigResolves) {
  int seen = 0;
  for (const auto& entry : fs::recursive_directory_iterator(KVBOUND_CONFIGS)) {
    if (entry.path().extension() != ".yaml") continue;
    const std::string folder = entry.path().parent_path().filename().string();
    ++seen;
    if (folder == "sweeps") {  // a sweep resolves its base configs with its fixed keys before it runs anything
      const fs::path here = fs::current_path();
      fs::current_path(fs::path(KVBOUND_CONFIGS).parent_path());  // its paths are the repository's, like every config's
      const CliRun r = run("sweep " + quote(entry.path().string()) + " --dry-run");
      fs::current_path(here);
      EXPECT_EQ(r.code, 0) << entry.path() << ": " << r.err;
      continue;
    }
    const std::string command = folder == "eval" ? "eval" : "train";
    const CliRun r = run(command + " " + quote(entry.path().string()) + " --set model.path=/nonexistent/model");
    EXPECT_EQ(r.code, 1) << entry.path();
    EXPECT_NE(r.err.find("error: /nonexistent/model: "), std::string::npos) << entry.path() << ": " << r.err;
  }
  EXPECT_GE(seen, 10);
}

TEST(Cli, InfoCountsTheGgufQuantTypes) {
  KVBOUND_REQUIRE_FILE(kvbound::test::default_model());
  const CliRun r = run("info --model " + quote(kvbound::test::default_model()));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("stored_types      F32 x61 Q4_1 x210 Q8_0 x1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("parameters        134515008 "), std::string::npos) << r.out;
}

TEST(Cli, GeneratesWithTheDefaultModel) {
  KVBOUND_REQUIRE_FILE(kvbound::test::default_model());
  const CliRun r = run("generate --model " + quote(kvbound::test::default_model()) +
                    " --prompt 'The capital of France is' --max-new-tokens 8 --threads 1");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("Paris"), std::string::npos) << r.out;
}

}  // namespace
