// The YAML + --set configuration: precedence, types, lists, errors a user sees (exact one-line messages,
// with the closest valid key), the resolved YAML and its hash, and the atomic write.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "base/errors.h"
#include "base/config.h"

namespace fs = std::filesystem;
using kvbound::Config;
using kvbound::ConfigSchema;
using kvbound::ConfigType;

namespace {

ConfigSchema eval_schema() {
  ConfigSchema s;
  s.add("model.path", ConfigType::String, "", "HF folder or .gguf file")
      .add("eval.budgets", ConfigType::IntList, "[64, 128]", "KV budget M per layer")
      .add("eval.policies", ConfigType::StringList, "[full, h2o]", "eviction policies")
      .add("eval.chunk", ConfigType::Int, "32", "prefill chunk")
      .add("train.lr", ConfigType::Float, "2e-4", "learning rate")
      .add("train.global_capacity", ConfigType::Bool, "false", "compare summed S with M*L*H")
      .add("train.loss_weights", ConfigType::FloatList, "[0.5, 0.5]", "w_kl, w_ntp")
      .add("trimkv.gate.bias_init", ConfigType::Float, "8", "gate bias init")
      .add("eval.seed", ConfigType::Int, "0", "declared after other sections: still written under eval");
  return s;
}

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvbound_config_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string yaml_file(const std::string& text, const std::string& name = "x.yaml") {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << text;
    return path;
  }

  fs::path dir_;
};

// The one-line kvbound::Error that loading gives, or "(loaded)".
std::string load_error(const ConfigSchema& schema, const std::string& path, const std::vector<std::string>& overrides) {
  try {
    Config::load(schema, path, overrides);
  } catch (const kvbound::Error& e) {
    return e.what();
  }
  return "(loaded)";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const char* kDefaultYaml =
    "model:\n"
    "  path: \"\"\n"
    "eval:\n"
    "  budgets: [64, 128]\n"
    "  policies: [\"full\", \"h2o\"]\n"
    "  chunk: 32\n"
    "  seed: 0\n"
    "train:\n"
    "  lr: 2.0e-04\n"
    "  global_capacity: false\n"
    "  loss_weights: [0.5, 0.5]\n"
    "trimkv:\n"
    "  gate:\n"
    "    bias_init: 8.0\n";

TEST_F(ConfigTest, DefaultsOnly) {
  const Config c = Config::load(eval_schema(), "", {});
  EXPECT_EQ(c.get_string("model.path"), "");
  EXPECT_EQ(c.get_int_list("eval.budgets"), (std::vector<std::int64_t>{64, 128}));
  EXPECT_EQ(c.get_string_list("eval.policies"), (std::vector<std::string>{"full", "h2o"}));
  EXPECT_EQ(c.get_int("eval.chunk"), 32);
  EXPECT_DOUBLE_EQ(c.get_float("train.lr"), 2e-4);
  EXPECT_FALSE(c.get_bool("train.global_capacity"));
  EXPECT_EQ(c.get_float_list("train.loss_weights"), (std::vector<double>{0.5, 0.5}));
  EXPECT_DOUBLE_EQ(c.get_float("trimkv.gate.bias_init"), 8.0);
  EXPECT_EQ(c.to_yaml(), kDefaultYaml);
  // FNV-1a 64 of kDefaultYaml, computed independently (Python).
  EXPECT_EQ(c.hash(), "b8dde01431d91b1d");
}

TEST_F(ConfigTest, YamlOverridesDefaults) {
  const std::string path = yaml_file(
      "# a recipe\n"
      "model:\n"
      "  path: models/smol.gguf\n"
      "eval:\n"
      "  chunk: 16\n"
      "train.lr: 1e-3          # dotted keys work in the file too\n"
      "trimkv:\n"
      "  gate: {bias_init: 18}\n"
      "  \n");
  const Config c = Config::load(eval_schema(), path, {});
  EXPECT_EQ(c.get_string("model.path"), "models/smol.gguf");
  EXPECT_EQ(c.get_int("eval.chunk"), 16);
  EXPECT_DOUBLE_EQ(c.get_float("train.lr"), 1e-3);
  EXPECT_DOUBLE_EQ(c.get_float("trimkv.gate.bias_init"), 18.0);
  EXPECT_EQ(c.get_int_list("eval.budgets"), (std::vector<std::int64_t>{64, 128}));  // untouched default
}

TEST_F(ConfigTest, EmptyFileAndEmptySectionKeepDefaults) {
  EXPECT_EQ(Config::load(eval_schema(), yaml_file(""), {}).to_yaml(), kDefaultYaml);
  EXPECT_EQ(Config::load(eval_schema(), yaml_file("# nothing\neval:\n"), {}).to_yaml(), kDefaultYaml);
}

TEST_F(ConfigTest, SetOverridesYamlInOrder) {
  const std::string path = yaml_file("eval:\n  chunk: 16\nmodel:\n  path: a.gguf\n");
  const Config c = Config::load(eval_schema(), path,
                                {"eval.chunk=8", "train.global_capacity=true", "model.path=b=c.gguf", "eval.chunk=4",
                                 "train.lr=-.inf"});
  EXPECT_EQ(c.get_int("eval.chunk"), 4);  // the last --set wins
  EXPECT_TRUE(c.get_bool("train.global_capacity"));
  EXPECT_EQ(c.get_string("model.path"), "b=c.gguf");  // split at the first '='
  EXPECT_EQ(c.get_float("train.lr"), -std::numeric_limits<double>::infinity());
  // An empty value is the empty string; a whole section can be set as a YAML mapping.
  const Config d = Config::load(eval_schema(), path, {"model.path=", "eval={chunk: 2, policies: [tova]}"});
  EXPECT_EQ(d.get_string("model.path"), "");
  EXPECT_EQ(d.get_int("eval.chunk"), 2);
  EXPECT_EQ(d.get_string_list("eval.policies"), (std::vector<std::string>{"tova"}));
}

TEST_F(ConfigTest, Lists) {
  const std::string path = yaml_file(
      "eval:\n"
      "  budgets:\n"
      "    - 16\n"
      "    - 32\n"
      "  policies: [snapkv, 'h2o+mem', \"a, b\"]\n"
      "train:\n"
      "  loss_weights: [1, 0.25]\n");
  const Config c = Config::load(eval_schema(), path, {});
  EXPECT_EQ(c.get_int_list("eval.budgets"), (std::vector<std::int64_t>{16, 32}));
  EXPECT_EQ(c.get_string_list("eval.policies"), (std::vector<std::string>{"snapkv", "h2o+mem", "a, b"}));
  EXPECT_EQ(c.get_float_list("train.loss_weights"), (std::vector<double>{1.0, 0.25}));

  const Config flow = Config::load(eval_schema(), path, {"eval.budgets=[8,16, 1024]", "train.loss_weights=[]"});
  EXPECT_EQ(flow.get_int_list("eval.budgets"), (std::vector<std::int64_t>{8, 16, 1024}));
  EXPECT_TRUE(flow.get_float_list("train.loss_weights").empty());
  // A lone scalar is a one-element list.
  const Config single = Config::load(eval_schema(), path, {"eval.budgets=64", "eval.policies=trimkv"});
  EXPECT_EQ(single.get_int_list("eval.budgets"), (std::vector<std::int64_t>{64}));
  EXPECT_EQ(single.get_string_list("eval.policies"), (std::vector<std::string>{"trimkv"}));
}

TEST_F(ConfigTest, UnknownKeyInYamlNamesTheClosest) {
  const ConfigSchema s = eval_schema();
  std::string path = yaml_file("eval:\n  budgts: [1]\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":2: eval.budgts: unknown key (did you mean eval.budgets?)");
  path = yaml_file("evl:\n  budgets: [1]\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":1: evl: unknown key (did you mean eval?)");
  path = yaml_file("trimkv:\n  gate:\n    bais_init: 1\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":3: trimkv.gate.bais_init: unknown key (did you mean trimkv.gate.bias_init?)");
}

TEST_F(ConfigTest, UnknownKeyInSetNamesTheClosest) {
  const ConfigSchema s = eval_schema();
  EXPECT_EQ(load_error(s, "", {"eval.polices=[h2o]"}), "--set: eval.polices: unknown key (did you mean eval.policies?)");
  EXPECT_EQ(load_error(s, "", {"evla.policies=[h2o]"}), "--set: evla.policies: unknown key (did you mean eval.policies?)");
  EXPECT_EQ(load_error(s, "", {"eval.bugdets=1"}), "--set: eval.bugdets: unknown key (did you mean eval.budgets?)");
  // The right leaf under the wrong section.
  EXPECT_EQ(load_error(s, "", {"train.chunk=1"}), "--set: train.chunk: unknown key (did you mean eval.chunk?)");
}

TEST_F(ConfigTest, Closest) {
  const ConfigSchema s = eval_schema();
  EXPECT_EQ(s.closest("eval.budget"), "eval.budgets");
  EXPECT_EQ(s.closest("trian"), "train");
  EXPECT_EQ(s.closest("trimkv.gat"), "trimkv.gate");
  EXPECT_EQ(s.closest("model.lr"), "train.lr");
  EXPECT_EQ(s.closest("eval.foo"), "");  // nothing close: no guess
  EXPECT_EQ(ConfigSchema().closest("x"), "");
}

TEST_F(ConfigTest, UnknownKeyWithNothingCloseListsWhatIsThere) {
  const ConfigSchema s = eval_schema();
  EXPECT_EQ(load_error(s, "", {"foo=1"}), "--set: foo: unknown key (top-level names: model, eval, train, trimkv)");
  EXPECT_EQ(load_error(s, "", {"eval.foo=1"}), "--set: eval.foo: unknown key (eval has: budgets, policies, chunk, seed)");
  EXPECT_EQ(load_error(s, "", {"trimkv.gate.x.y=1"}), "--set: trimkv.gate.x.y: unknown key (trimkv.gate has: bias_init)");
  EXPECT_EQ(load_error(s, "", {"eval.chunk.size=1"}),
            "--set: eval.chunk.size: unknown key (eval.chunk is a value (int), not a section)");
}

TEST_F(ConfigTest, MalformedOverride) {
  const ConfigSchema s = eval_schema();
  EXPECT_EQ(load_error(s, "", {"eval.budgets"}), "--set: 'eval.budgets': expected KEY=VALUE");
  EXPECT_EQ(load_error(s, "", {"=3"}), "--set: '=3': expected KEY=VALUE");
  EXPECT_EQ(load_error(s, "", {"eval.budgets=[1, 2"}).rfind("--set: eval.budgets: value '[1, 2' is not valid YAML: ", 0), 0u);
}

TEST_F(ConfigTest, TypeErrors) {
  const ConfigSchema s = eval_schema();
  std::string path = yaml_file("train:\n  lr: fast\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":2: train.lr: expected a float, got 'fast'");
  EXPECT_EQ(load_error(s, "", {"eval.chunk=1.5"}), "--set: eval.chunk: expected an integer, got '1.5'");
  EXPECT_EQ(load_error(s, "", {"eval.chunk=1e3"}), "--set: eval.chunk: expected an integer, got '1e3'");
  EXPECT_EQ(load_error(s, "", {"eval.chunk=99999999999999999999"}),
            "--set: eval.chunk: expected an integer, got '99999999999999999999'");
  EXPECT_EQ(load_error(s, "", {"eval.chunk="}), "--set: eval.chunk: expected an integer, got nothing");
  EXPECT_EQ(load_error(s, "", {"train.global_capacity=yes"}),
            "--set: train.global_capacity: expected true or false, got 'yes'");
  EXPECT_EQ(load_error(s, "", {"eval.budgets=[64, x]"}), "--set: eval.budgets[1]: expected an integer, got 'x'");
  EXPECT_EQ(load_error(s, "", {"eval.budgets=64,128"}),
            "--set: eval.budgets: expected a list of ints like [1, 2], got '64,128'");
  EXPECT_EQ(load_error(s, "", {"eval.budgets=[[1]]"}), "--set: eval.budgets[0]: expected an integer, got a list");
  EXPECT_EQ(load_error(s, "", {"model.path=[a]"}), "--set: model.path: expected a string, got a list");
  path = yaml_file("train:\n  lr:\n    value: 1\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":3: train.lr: expected a float, got a mapping");
  path = yaml_file("eval: 5\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":1: eval: expected a mapping of keys (a section), got '5'");
  path = yaml_file("- eval\n");
  EXPECT_EQ(load_error(s, path, {}), path + ":1: expected a mapping of keys at the top level, got a list");
}

TEST_F(ConfigTest, RequiredKeys) {
  ConfigSchema s = eval_schema();
  s.add_required("run.name", ConfigType::String, "run folder name");
  EXPECT_EQ(load_error(s, "", {}),
            "--set: run.name: required key is not set (set it in the YAML or with --set run.name=VALUE)");
  const std::string path = yaml_file("eval:\n  chunk: 1\n");
  EXPECT_EQ(load_error(s, path, {}),
            path + ": run.name: required key is not set (set it in the YAML or with --set run.name=VALUE)");
  EXPECT_EQ(Config::load(s, path, {"run.name=first"}).get_string("run.name"), "first");
  EXPECT_EQ(Config::load(s, yaml_file("run: {name: second}\n"), {}).get_string("run.name"), "second");
}

TEST_F(ConfigTest, YamlSyntaxErrorNamesTheLine) {
  const std::string path = yaml_file("eval:\n  chunk: 1\n   budgets: [1]\n");
  EXPECT_EQ(load_error(eval_schema(), path, {}), path + ":3: YAML syntax error at column 11: illegal map value");
  const std::string unclosed = yaml_file("eval:\n  budgets: [1, 2\n  chunk: 3\n");
  EXPECT_EQ(load_error(eval_schema(), unclosed, {}).rfind(unclosed + ":", 0), 0u);
}

TEST_F(ConfigTest, DuplicateKeys) {
  std::string path = yaml_file("eval:\n  chunk: 1\n  chunk: 2\n");
  EXPECT_EQ(load_error(eval_schema(), path, {}), path + ":3: eval.chunk: duplicate key");
  path = yaml_file("eval:\n  chunk: 1\neval.chunk: 2\n");
  EXPECT_EQ(load_error(eval_schema(), path, {}), path + ":3: eval.chunk: duplicate key");
  path = yaml_file("eval:\n  chunk: 1\neval:\n  seed: 2\n");
  EXPECT_EQ(load_error(eval_schema(), path, {}), path + ":3: eval: duplicate key");
}

TEST_F(ConfigTest, FileProblems) {
  const std::string missing = (dir_ / "missing.yaml").string();
  EXPECT_EQ(load_error(eval_schema(), missing, {}), missing + ": cannot open: No such file or directory");
  EXPECT_EQ(load_error(eval_schema(), dir_.string(), {}), dir_.string() + ": is a folder, expected a YAML file");
  const std::string two = yaml_file("eval: {chunk: 1}\n---\neval: {chunk: 2}\n");
  EXPECT_EQ(load_error(eval_schema(), two, {}), two + ": holds 2 YAML documents, expected one");
}

TEST_F(ConfigTest, ResolvedYamlRoundTrips) {
  const Config c = Config::load(eval_schema(), "",
                                {"model.path=\"odd \\\"path\\\"\\\\ with: colon\\t#\\x01 é\"", "eval.policies=[\"true\", '1', '', null]",
                                 "train.lr=0.1", "trimkv.gate.bias_init=1e300", "train.loss_weights=[.nan, 3, -0.0]"});
  EXPECT_EQ(c.get_string("model.path"), "odd \"path\"\\ with: colon\t#\x01 é");
  EXPECT_EQ(c.get_string_list("eval.policies"), (std::vector<std::string>{"true", "1", "", ""}));
  const std::string path = (dir_ / "config.yaml").string();
  c.write(path);
  EXPECT_EQ(read_text(path), c.to_yaml());
  const Config back = Config::load(eval_schema(), path, {});
  EXPECT_EQ(back.to_yaml(), c.to_yaml());
  EXPECT_EQ(back.hash(), c.hash());
  EXPECT_EQ(back.get_string("model.path"), c.get_string("model.path"));
  EXPECT_DOUBLE_EQ(back.get_float("trimkv.gate.bias_init"), 1e300);
  EXPECT_NE(back.hash(), Config::load(eval_schema(), path, {"eval.chunk=33"}).hash());
}

TEST_F(ConfigTest, WriteIsAtomic) {
  const fs::path path = dir_ / "config.yaml";
  std::ofstream(path) << "old\n";
  const Config c = Config::load(eval_schema(), "", {});
  c.write(path.string());
  EXPECT_EQ(read_text(path), kDefaultYaml);
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir_)) entries.push_back(e.path().filename().string());
  EXPECT_EQ(entries, std::vector<std::string>{"config.yaml"});  // no temporary left behind

  // Missing folders are created (write_file_atomic's rule, shared by every file the tools write).
  c.write((dir_ / "new_folder" / "config.yaml").string());
  EXPECT_EQ(read_text(dir_ / "new_folder" / "config.yaml"), kDefaultYaml);

  // A rename that fails (the target is a folder) removes the temporary file.
  fs::create_directory(dir_ / "folder");
  EXPECT_THROW(c.write((dir_ / "folder").string()), kvbound::Error);
  entries.clear();
  for (const auto& e : fs::directory_iterator(dir_)) entries.push_back(e.path().filename().string());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"config.yaml", "folder", "new_folder"}));
}

TEST_F(ConfigTest, ReadingUndeclaredOrMistypedKeysIsAProgrammingError) {
  const Config c = Config::load(eval_schema(), "", {});
  EXPECT_THROW(c.get_int("eval.nope"), std::logic_error);
  EXPECT_THROW(c.get_float("eval.chunk"), std::logic_error);
  EXPECT_THROW(c.get_int("eval"), std::logic_error);
  EXPECT_THROW(c.get_string_list("model.path"), std::logic_error);
}

TEST_F(ConfigTest, SchemaMisuseIsAProgrammingError) {
  EXPECT_THROW(eval_schema().add("eval.chunk", ConfigType::Int, "1", ""), std::logic_error);      // twice
  EXPECT_THROW(eval_schema().add("eval", ConfigType::Int, "1", ""), std::logic_error);            // a section
  EXPECT_THROW(eval_schema().add("eval.chunk.x", ConfigType::Int, "1", ""), std::logic_error);    // under a key
  EXPECT_THROW(eval_schema().add("eval..x", ConfigType::Int, "1", ""), std::logic_error);         // malformed
  EXPECT_THROW(eval_schema().add("eval.x-y", ConfigType::Int, "1", ""), std::logic_error);        // malformed
  EXPECT_THROW(eval_schema().add("eval.x", ConfigType::Int, "", ""), std::logic_error);           // no default
  EXPECT_THROW(eval_schema().add("eval.x", ConfigType::IntList, "[1, a]", ""), std::logic_error);  // bad default
  EXPECT_THROW(eval_schema().add("eval.x", ConfigType::Int, "[1", ""), std::logic_error);         // bad YAML
}

TEST_F(ConfigTest, DescribeListsEveryKey) {
  ConfigSchema s;
  s.add("eval.budgets", ConfigType::IntList, "[64,128]", "KV budgets").add_required("model.path", ConfigType::String, "model");
  EXPECT_EQ(s.describe(),
            "  eval.budgets  int list     [64, 128]   KV budgets\n"
            "  model.path    string       (required)  model\n");
}

TEST_F(ConfigTest, ExtractOverrides) {
  std::vector<std::string> args = {"eval", "--config", "x.yaml", "--set", "eval.budgets=[64,128]", "--set=eval.chunk=8",
                                   "--", "--set", "kept"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int argc = static_cast<int>(args.size());
  EXPECT_EQ(kvbound::extract_overrides(argc, argv.data()),
            (std::vector<std::string>{"eval.budgets=[64,128]", "eval.chunk=8"}));
  ASSERT_EQ(argc, 6);
  EXPECT_EQ(std::vector<std::string>(argv.begin(), argv.begin() + argc),
            (std::vector<std::string>{"eval", "--config", "x.yaml", "--", "--set", "kept"}));
  EXPECT_EQ(argv[argc], nullptr);

  std::vector<std::string> dangling = {"eval", "--set"};
  std::vector<char*> dargv = {dangling[0].data(), dangling[1].data(), nullptr};
  int dargc = 2;
  EXPECT_THROW(kvbound::extract_overrides(dargc, dargv.data()), kvbound::Error);
}

}  // namespace
