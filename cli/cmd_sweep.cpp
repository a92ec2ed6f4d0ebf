// `kvbound sweep SWEEP.yaml [--jobs N] [--dry-run]`: a grid of configs, each point trained, exported and
// evaluated into its own folder, then one summary.
//
//   train: configs/trimkv/stories260k.yaml     # base train config (omit it to sweep evaluations alone)
//   eval: configs/eval/stories260k_reference.yaml
//   out_dir: runs/sweeps/trimkv
//   seeds: [0, 1]                               # train.seed per repetition (eval.seed when there is no train)
//   set: {train.steps: 200, eval.policies: [trimkv, h2o]}   # fixed for every point
//   grid: {trimkv.budget: [8, 16, 32], trimkv.bias_init: [8, 18]}   # train and eval keys: retrains per point
//   eval_grid: {trimkv.score_offset: [0, 2]}    # eval-only keys: every variant evaluates the same weights
//   metric: kl_to_full                          # what "best" means in the summary
//
// A key goes to every command whose schema declares it (a policy key reaches the periodic eval too). Points
// are folders OUT_DIR/<key=value,...>/seed<S>/ holding train/ (the run), weights.safetensors (its export: the
// best periodic eval's weights when there is one) and eval/<eval point>/results.json; steps already done are
// skipped and an interrupted training resumes, so re-running a killed sweep finishes only what was left — unless
// a step's inputs changed since (train.inputs, eval/<eval point>.inputs: the resolved config and the content of
// every file it names), which redoes that step and what depends on it. A
// failed step is reported (its log kept beside it) and the other points go on; the exit code says whether any
// failed. --jobs N runs N points at once, each with 1/N of the cores (model.threads, unless `set` fixes it).
// OUT_DIR gets summary.md, summary.csv (mean ± std over seeds of every quality metric, best point per budget)
// and plots/<metric>_vs_<key>_M<budget>.png; a point evaluated at two or more budgets also
// plots/vs_budget/<point>/<metric>.png (its seed means against the budget).
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <atomic>
#include <csignal>
#include <cxxopts.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "cli/parse_arguments.h"
#include "base/build_options.h"
#include "base/atomic_file.h"
#include "base/errors.h"
#include "base/usable_cores.h"
#include "cli/command_schemas.h"
#include "cli/commands.h"
#include "cli/sweep_inputs.h"
#include "eval/results.h"
#include "eval/sweep_summary.h"
#include "modules/policies/registry.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

using KeyValues = std::vector<std::pair<std::string, std::string>>;  // key -> YAML text, in order

struct SweepSpec {
  std::string source;
  std::string train_config, eval_config, out_dir = "runs/sweep", metric = "kl_to_full";
  std::vector<std::int64_t> seeds{0};
  KeyValues fixed;
  std::vector<std::pair<std::string, std::vector<std::string>>> grid, eval_grid;
};

// The YAML value as one flow-style line (a scalar as written), for `--set KEY=VALUE`.
std::string flow_text(const YAML::Node& node) {
  if (node.IsScalar()) return node.Scalar();
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

std::string where(const SweepSpec& spec, const YAML::Node& node) {
  return spec.source + ":" + std::to_string(node.Mark().line + 1);
}

SweepSpec read_sweep(const std::string& path, const ConfigSchema& train, const ConfigSchema& eval) {
  SweepSpec spec;
  spec.source = path;
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    fail(path, "", "cannot read the sweep file");
  } catch (const YAML::Exception& e) {
    fail(path + ":" + std::to_string(e.mark.line + 1), "", "not valid YAML: " + e.msg);
  }
  if (!root.IsMap()) fail(path, "", "a sweep file is a YAML map (train, eval, out_dir, seeds, set, grid, eval_grid, metric)");
  const auto declared = [&](const std::string& key, bool eval_only, const YAML::Node& at) {
    const bool in_train = !spec.train_config.empty() && !eval_only && train.find(key);
    if (in_train || eval.find(key)) return;
    const std::string near = eval.closest(key).empty() ? train.closest(key) : eval.closest(key);
    fail(where(spec, at), key, std::string(eval_only ? "not an eval key" : "neither a train nor an eval key") +
                                   (near.empty() ? "" : " (did you mean " + near + "?)"));
  };
  for (const auto& entry : root) {
    const std::string key = entry.first.Scalar();
    if (key == "train") spec.train_config = entry.second.Scalar();
    else if (key == "eval") spec.eval_config = entry.second.Scalar();
    else if (key == "out_dir") spec.out_dir = entry.second.Scalar();
    else if (key == "metric") spec.metric = entry.second.Scalar();
    else if (key == "seeds") {
      spec.seeds.clear();
      if (!entry.second.IsSequence() || entry.second.size() == 0) fail(where(spec, entry.second), "seeds", "a non-empty list of integers");
      for (const auto& s : entry.second) spec.seeds.push_back(s.as<std::int64_t>());
    } else if (key != "set" && key != "grid" && key != "eval_grid") {
      fail(where(spec, entry.first), key, "unknown sweep key (train, eval, out_dir, seeds, set, grid, eval_grid, metric)");
    }
  }
  if (spec.eval_config.empty()) fail(path, "eval", "missing: the base eval config every point is evaluated with");
  for (const char* section : {"set", "grid", "eval_grid"}) {
    const YAML::Node node = root[section];
    if (!node) continue;
    if (!node.IsMap()) fail(where(spec, node), section, "a map of dotted config keys");
    for (const auto& entry : node) {
      const std::string key = entry.first.Scalar();
      declared(key, std::string(section) == "eval_grid", entry.first);
      if (std::string(section) == "set") {
        spec.fixed.emplace_back(key, flow_text(entry.second));
        continue;
      }
      if (!entry.second.IsSequence() || entry.second.size() == 0)
        fail(where(spec, entry.second), key, std::string(section) + " values are a non-empty list");
      std::vector<std::string> values;
      for (const auto& v : entry.second) values.push_back(flow_text(v));
      (std::string(section) == "grid" ? spec.grid : spec.eval_grid).emplace_back(key, values);
    }
  }
  return spec;
}

// Every combination of the keys' values, the first key varying slowest.
std::vector<KeyValues> combinations(const std::vector<std::pair<std::string, std::vector<std::string>>>& grid) {
  std::vector<KeyValues> out{{}};
  for (const auto& [key, values] : grid) {
    std::vector<KeyValues> next;
    for (const KeyValues& partial : out)
      for (const std::string& v : values) {
        KeyValues extended = partial;
        extended.emplace_back(key, v);
        next.push_back(std::move(extended));
      }
    out = std::move(next);
  }
  return out;
}

// Runs `kvbound ARGS` (this very binary) with stdout and stderr into `log`; true when it exits 0.
bool run_kvbound(const std::vector<std::string>& args, const std::string& log) {
  fs::create_directories(fs::path(log).parent_path());
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(log, "", "cannot write the step's log");
  std::vector<std::string> argv_text{"kvbound"};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {  // only async-signal-safe calls until exec
    // A sweep that is killed takes its steps with it (a survivor would race the re-run's step in the same run
    // folder). The signal comes when the forking thread ends; that thread waits for this child.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(143);  // the sweep was already gone before prctl
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  ::close(fd);
  if (pid < 0) fail(log, "", "cannot start a process");
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::string last_line(const std::string& log) {
  std::ifstream in(log);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty()) last = line;
  return last;
}

struct Job {
  KeyValues point;
  std::size_t point_index = 0;
  std::int64_t seed = 0;
  fs::path dir;
};

class Sweep {
 public:
  Sweep(SweepSpec spec, ConfigSchema train, ConfigSchema eval, std::int64_t threads, bool dry_run)
      : spec_(std::move(spec)), train_(std::move(train)), eval_(std::move(eval)), threads_(threads), dry_run_(dry_run) {}

  // One point and seed: train (or resume), export, then every eval variant; false when a step failed. A finished
  // step is skipped only while its recorded inputs (cli/sweep_inputs.h) are unchanged; a stale one is redone,
  // with what depended on it (a retrained point's export and evals).
  bool run(const Job& job, std::size_t number, std::size_t total) {
    const std::string label = "[sweep] " + std::to_string(number) + "/" + std::to_string(total) + " " +
                              sweep_point_name(job.point) + " seed " + std::to_string(job.seed);
    std::vector<std::string> weights_sets;
    if (!spec_.train_config.empty()) {
      const fs::path run_dir = job.dir / "train";
      const fs::path weights = job.dir / "weights.safetensors";
      std::vector<std::string> args{"train", spec_.train_config};
      add_sets(args, train_, job.point, "train.seed=" + std::to_string(job.seed));
      args.insert(args.end(), {"--set", "run.out_dir=" + run_dir.string()});
      const bool started = fs::exists(job.dir / ".trained") || fs::exists(run_dir);
      const std::string inputs = dry_run_ ? "" : step_inputs(train_, args);
      if (started && !dry_run_ && !current(label, "train", job.dir / "train.inputs", inputs)) {
        for (const fs::path& stale : {job.dir / ".trained", run_dir, weights, job.dir / "eval"}) fs::remove_all(stale);
      }
      if (!fs::exists(job.dir / ".trained")) {
        const bool resume = fs::exists(run_dir / "checkpoints" / "LATEST");
        if (resume) args.push_back("--resume");
        if (!dry_run_) write_file_atomic((job.dir / "train.inputs").string(), inputs);
        if (!step(label, resume ? "train (resumed)" : "train", args, job.dir / "train.log")) return false;
        if (!dry_run_) write_file_atomic((job.dir / ".trained").string(), "");
      }
      if (!fs::exists(weights)) {
        std::vector<std::string> export_args{"export", run_dir.string(), "--out", weights.string()};
        if (fs::exists(run_dir / "best.safetensors") || dry_run_) export_args.push_back("--best");
        if (!step(label, "export", export_args, job.dir / "export.log")) return false;
      }
      for (const std::string& key : weights_keys(run_dir)) weights_sets.push_back(key + "=" + weights.string());
    }
    bool ok = true;
    for (const KeyValues& variant : combinations(spec_.eval_grid)) {
      const std::string name = sweep_point_name(variant);
      const fs::path out = job.dir / "eval" / name;
      std::vector<std::string> args{"eval", spec_.eval_config};
      KeyValues keys = job.point;
      keys.insert(keys.end(), variant.begin(), variant.end());
      add_sets(args, eval_, keys, spec_.train_config.empty() ? "eval.seed=" + std::to_string(job.seed) : "");
      for (const std::string& set : weights_sets) args.insert(args.end(), {"--set", set});
      args.insert(args.end(), {"--set", "eval.out_dir=" + out.string()});
      const fs::path record = job.dir / "eval" / (name + ".inputs");
      const std::string inputs = dry_run_ ? "" : step_inputs(eval_, args);
      if (fs::exists(out / "results.json") && (dry_run_ || current(label, "eval " + name, record, inputs))) continue;
      fs::remove_all(out);
      if (!dry_run_) write_file_atomic(record.string(), inputs);
      ok = step(label, "eval " + name, args, job.dir / "eval" / (name + ".log")) && ok;
    }
    return ok;
  }

 private:
  // The inputs of `kvbound ARGS` (a command, its config, then --set pairs).
  static std::string step_inputs(const ConfigSchema& schema, const std::vector<std::string>& args) {
    std::vector<std::string> sets;
    for (std::size_t i = 2; i + 1 < args.size(); ++i)
      if (args[i] == "--set") sets.push_back(args[++i]);
    return sweep_step_inputs(schema, args[1], sets);
  }

  // True when `record` holds `inputs`; otherwise says what changed and that the step is redone.
  bool current(const std::string& label, const std::string& what, const fs::path& record, const std::string& inputs) {
    std::string recorded;
    if (std::ifstream in(record); in) recorded.assign(std::istreambuf_iterator<char>(in), {});
    const std::string change = sweep_inputs_change(recorded, inputs);
    if (change.empty()) return true;
    const std::lock_guard<std::mutex> lock(print_);
    std::cerr << label << ": " << what << ": inputs changed since it ran (" << change << "): redoing\n";
    return false;
  }

  // --set for every fixed and point key `schema` declares, the seed, and the thread share.
  void add_sets(std::vector<std::string>& args, const ConfigSchema& schema, const KeyValues& point,
                const std::string& seed) const {
    bool threads_fixed = false;
    for (const KeyValues* group : {&spec_.fixed, &point})
      for (const auto& [key, value] : *group) {
        if (!schema.find(key)) continue;
        args.insert(args.end(), {"--set", key + "=" + value});
        threads_fixed = threads_fixed || key == "model.threads";
      }
    if (!seed.empty()) args.insert(args.end(), {"--set", seed});
    if (!threads_fixed) args.insert(args.end(), {"--set", "model.threads=" + std::to_string(threads_)});
  }

  // The eval keys that take the trained method's export (its registration), from the run's own config.
  std::vector<std::string> weights_keys(const fs::path& run_dir) const {
    if (dry_run_) return {"<the method's weights keys>"};
    const Config config = Config::load(train_, (run_dir / "config.yaml").string(), {});
    return find_method(config.get_string("train.method"), (run_dir / "config.yaml").string() + ": train.method").weights_keys;
  }

  bool step(const std::string& label, const std::string& what, const std::vector<std::string>& args, const fs::path& log) {
    {
      const std::lock_guard<std::mutex> lock(print_);
      std::cerr << label << ": " << what << (dry_run_ ? ": kvbound" : "\n");
      if (dry_run_) {
        for (const std::string& a : args) std::cerr << " " << a;
        std::cerr << "\n";
      }
    }
    if (dry_run_) return true;
    if (run_kvbound(args, log.string())) return true;
    const std::lock_guard<std::mutex> lock(print_);
    std::cerr << label << ": " << what << " FAILED: " << last_line(log.string()) << " (log: " << log.string() << ")\n";
    return false;
  }

  SweepSpec spec_;
  ConfigSchema train_, eval_;
  std::int64_t threads_;
  bool dry_run_;
  std::mutex print_;
};

}  // namespace

int cmd_sweep(int argc, char** argv) {
  cxxopts::Options o("kvbound sweep", "Train, export and evaluate every point of a grid of configs, then summarise "
                                      "(mean ± std over seeds, best point per budget, each learned policy against the best heuristic "
                                      "of its own seed, plots).");
  o.add_options()("sweep", "sweep file (see configs/sweeps/)", cxxopts::value<std::string>())(
      "j,jobs", "points run at once (each gets 1/N of the cores)", cxxopts::value<std::int64_t>()->default_value("1"))(
      "dry-run", "print the commands the sweep would run, run nothing")("h,help", "show help");
  o.parse_positional({"sweep"});
  o.positional_help("SWEEP.yaml");
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  if (!r.count("sweep")) fail("kvbound sweep", "SWEEP.yaml", "missing (see --help)");
  const std::int64_t jobs = r["jobs"].as<std::int64_t>();
  if (jobs < 1) fail("--jobs", "", "must be >= 1");
  const bool dry_run = r.count("dry-run") > 0;
  ConfigSchema train = train_schema(), eval = eval_schema();
  SweepSpec spec = read_sweep(r["sweep"].as<std::string>(), train, eval);
  // Both base configs resolve with the fixed keys before anything runs (a typo fails here, not mid-sweep).
  for (const auto& [config, schema] : {std::pair{spec.train_config, &train}, std::pair{spec.eval_config, &eval}}) {
    if (config.empty()) continue;
    std::vector<std::string> sets;
    for (const auto& [key, value] : spec.fixed)
      if (schema->find(key)) sets.push_back(key + "=" + value);
    Config::load(*schema, config, sets);
  }

  std::vector<std::string> keys;
  for (const auto& [key, values] : spec.grid) keys.push_back(key);
  for (const auto& [key, values] : spec.eval_grid) keys.push_back(key);
  const std::vector<KeyValues> points = combinations(spec.grid);
  std::vector<Job> queue;
  for (std::size_t p = 0; p < points.size(); ++p)
    for (const std::int64_t seed : spec.seeds)
      queue.push_back({points[p], p, seed, fs::path(spec.out_dir) / sweep_point_name(points[p]) / ("seed" + std::to_string(seed))});
  const auto cores = static_cast<std::int64_t>(usable_cores());
  Sweep sweep(spec, train, eval, std::max<std::int64_t>(1, cores / jobs), dry_run);
  std::cerr << "[sweep] " << points.size() << " points x " << spec.seeds.size() << " seeds x "
            << combinations(spec.eval_grid).size() << " eval variants into " << spec.out_dir << ", " << jobs << " at once\n";

  std::atomic<std::size_t> next{0};
  std::mutex failed_lock;
  std::vector<std::string> failed;
  std::vector<std::thread> workers;
  for (std::int64_t w = 0; w < std::min<std::int64_t>(jobs, static_cast<std::int64_t>(queue.size())); ++w)
    workers.emplace_back([&] {
      for (std::size_t i; (i = next++) < queue.size();) {
        if (sweep.run(queue[i], i + 1, queue.size())) continue;
        const std::lock_guard<std::mutex> lock(failed_lock);
        failed.push_back(queue[i].dir.string());
      }
    });
  for (std::thread& t : workers) t.join();
  if (dry_run) return 0;

  // The summary over whatever finished: every (point, eval variant) is a point of the table.
  std::vector<SweepPoint> table_points;
  std::vector<SweepRun> runs;
  const std::vector<KeyValues> variants = combinations(spec.eval_grid);
  for (std::size_t p = 0; p < points.size(); ++p)
    for (std::size_t v = 0; v < variants.size(); ++v) {
      SweepPoint point{points[p]};
      point.values.insert(point.values.end(), variants[v].begin(), variants[v].end());
      table_points.push_back(point);
      for (const std::int64_t seed : spec.seeds) {
        const fs::path results = fs::path(spec.out_dir) / sweep_point_name(points[p]) / ("seed" + std::to_string(seed)) /
                                 "eval" / sweep_point_name(variants[v]) / "results.json";
        if (fs::exists(results)) runs.push_back({table_points.size() - 1, seed, read_results_json(results.string())});
      }
    }
  const SweepSummary summary = summarize_sweep(keys, table_points, runs, spec.metric, heuristic_policy_names());
  const std::string table = sweep_markdown(summary);
  write_file_atomic((fs::path(spec.out_dir) / "summary.md").string(), table);
  write_file_atomic((fs::path(spec.out_dir) / "summary.csv").string(), sweep_csv(summary));
  const std::vector<std::string> plots =
      KVBOUND_WITH_PLOTS ? write_sweep_plots(summary, (fs::path(spec.out_dir) / "plots").string(), spec.source)
                         : std::vector<std::string>{};
  std::cout << table;
  std::cerr << "[sweep] wrote " << spec.out_dir << "/summary.md, summary.csv and " << plots.size() << " plots"
            << (KVBOUND_WITH_PLOTS ? "" : " (this kvbound was built without cairo, KVBOUND_WITH_PLOTS=OFF)") << "\n";
  if (failed.empty()) return 0;
  std::cerr << "[sweep] " << failed.size() << " of " << queue.size() << " runs failed (re-run the sweep to retry them):";
  for (const std::string& f : failed) std::cerr << " " << f;
  std::cerr << "\n";
  return 1;
}

}  // namespace kvbound
