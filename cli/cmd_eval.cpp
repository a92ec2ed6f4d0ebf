// `kvbound eval CONFIG [--set key=value ...]`: policies x budgets x tasks on one model; writes the
// resolved config.yaml, results.json, results.md and quality-vs-budget PNG plots into eval.out_dir and
// prints the Markdown table.
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstring>
#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <set>

#include "cli/parse_arguments.h"
#include "base/build_options.h"
#include "base/atomic_file.h"
#include "base/errors.h"
#include "data/tokenizer.h"
#include "eval/budget_sweep.h"
#include "eval/plots.h"
#include "eval/results.h"
#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"
#include "cli/commands.h"
#include "base/config.h"
#include "cli/command_schemas.h"
#include "cli/model_setup.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

SweepSettings sweep_settings(const Config& c) {
  SweepSettings s;
  s.budgets = c.get_int_list("eval.budgets");
  s.run_continuation = s.run_retrieval = false;
  for (const std::string& task : c.get_string_list("eval.tasks")) {
    if (task == "continuation") s.run_continuation = true;
    else if (task == "retrieval") s.run_retrieval = true;
    else fail("config", "eval.tasks", "unknown task '" + task + "' (continuation, retrieval)");
  }
  s.text_path = c.get_string("eval.text");
  s.text_part = text_part(c, "eval.text_part");
  s.context_len = c.get_int("eval.context_len");
  s.num_windows = c.get_int("eval.num_windows");
  if (s.num_windows < 1) fail("config", "eval.num_windows", "must be >= 1");
  s.seed = static_cast<std::uint64_t>(c.get_int("eval.seed"));
  s.continuation.prefill_len = c.get_int("eval.prefill_len");
  s.continuation.score_from = c.get_int("eval.score_from");
  s.continuation.chunk_size = c.get_int("eval.chunk_size");
  s.continuation.buffer = c.get_int("eval.buffer");
  s.continuation.budgeted_layers = c.get_int_list("eval.budgeted_layers");
  s.continuation.layer_budget_shares = c.get_float_list("eval.layer_budget_shares");
  if (const std::string scope = c.get_string("eval.budget_scope"); scope != "policy")
    s.continuation.budget_scope = parse_budget_scope(scope, "eval.budget_scope");
  s.retrieval.context_len = c.get_int("eval.retrieval.context_len");
  s.retrieval.depths = c.get_float_list("eval.retrieval.depths");
  s.retrieval.samples_per_depth = c.get_int("eval.retrieval.samples");
  s.retrieval.chunk_size = s.continuation.chunk_size;
  s.retrieval.buffer = s.continuation.buffer;
  s.retrieval.budgeted_layers = s.continuation.budgeted_layers;
  s.retrieval.layer_budget_shares = s.continuation.layer_budget_shares;
  s.retrieval.budget_scope = s.continuation.budget_scope;
  s.retrieval.seed = s.seed;
  return s;
}

}  // namespace

int cmd_eval(int argc, char** argv) {
  const std::vector<std::string> overrides = extract_overrides(argc, argv);
  const ConfigSchema schema = eval_schema();
  cxxopts::Options o("kvbound eval", "Compare KV eviction policies under budgets. Override any config key with "
                                     "--set key=value (e.g. --set eval.budgets=[64,128]).");
  o.add_options()("config", "YAML config (see configs/eval/)", cxxopts::value<std::string>())("h,help", "show help");
  o.parse_positional({"config"});
  o.positional_help("CONFIG");
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\npolicies (eval.policies; any bounded one also as POLICY+mem, with a latent memory):\n";
    for (const PolicyRegistration* p : policy_registry())
      std::cout << "  " << p->name << std::string(15 - std::min<std::size_t>(14, std::strlen(p->name)), ' ') << p->summary << "\n";
    std::cout << "\nconfig keys:\n" << schema.describe() << "\n";
    return 0;
  }
  const Config config = Config::load(schema, r.count("config") ? r["config"].as<std::string>() : "", overrides);
  SweepSettings settings = sweep_settings(config);
  const ConfiguredModel loaded = load_configured_model(config);
  const std::string& model_path = loaded.model_path;
  const std::string& tok_path = loaded.tokenizer_path;
  const auto& tokenizer = loaded.tokenizer;
  const auto& model = loaded.model;
  for (const std::int64_t layer : settings.continuation.budgeted_layers)
    if (layer < 0 || layer >= model->config().num_layers)
      fail("config", "eval.budgeted_layers", "layer " + std::to_string(layer) + " is not in [0, " +
                                                 std::to_string(model->config().num_layers) + ")");
  if (!settings.continuation.layer_budget_shares.empty())
    check_layer_budget_shares(settings.continuation.layer_budget_shares, model->config().num_layers);
  // Learned weights are checked against this backbone, and every policy configured, before any evaluation work.
  TrainedModules modules;
  std::map<std::string, std::string> weights_meta;
  for (const MethodRegistration* m : method_registry()) m->load_for_eval(config, *model, modules, weights_meta);
  std::set<std::string> listed;  // one row per policy and budget: a repeat would fail only after the whole run
  for (const std::string& name : config.get_string_list("eval.policies")) {
    if (!listed.insert(name).second) fail("config", "eval.policies", "'" + name + "' is listed twice");
    settings.policies.emplace_back(name, config, modules);
  }

  const c10::InferenceMode no_autograd;  // evaluation never needs gradients: skip autograd bookkeeping
  const std::string out_dir = config.get_string("eval.out_dir");
  std::filesystem::create_directories(out_dir);
  config.write(out_dir + "/config.yaml");
  EvalResults results = run_budget_sweep(*model, *tokenizer, settings);
  results.meta["model"] = model_path;
  results.meta["architecture"] = model->config().architecture;
  results.meta["tokenizer"] = tok_path;
  results.meta["config_hash"] = config.hash();
  results.meta["text"] = settings.text_path;
  for (const auto& [key, value] : weights_meta) results.meta[key] = value;
  write_results_json(results, out_dir + "/results.json");
  const std::string table = results_markdown(results);
  write_file_atomic(out_dir + "/results.md", table);
  const std::vector<std::string> plots =
      KVBOUND_WITH_PLOTS ? write_quality_plots(results, out_dir) : std::vector<std::string>{};
  std::cout << table << "\n";
  std::cerr << "[eval] wrote " << out_dir << "/results.json, results.md";
  for (const auto& p : plots) std::cerr << ", " << std::filesystem::path(p).filename().string();
  std::cerr << (KVBOUND_WITH_PLOTS ? "" : " (no plots: this kvbound was built without cairo, KVBOUND_WITH_PLOTS=OFF)")
            << "\n";
  return 0;
}

}  // namespace kvbound
