// `kvbound train CONFIG [--set key=value ...] [--resume] [--stop-after N]`: trains a learned method's
// modules on the frozen backbone (train.method: any registered method, train/method_list.h) and writes the run folder
// described in train/run_state.h. `--resume` continues run.out_dir's latest checkpoint bit-identically
// (same config required; model.threads may differ); `--stop-after N` ends this invocation after N
// updates with a checkpoint (time-sliced jobs).
#include <ATen/core/grad_mode.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "cli/parse_arguments.h"
#include "base/errors.h"
#include "modules/budgeted_cache.h"
#include "base/usable_cores.h"
#include "train/run_checkpoint.h"
#include "data/tokenizer.h"
#include "data/text_windows.h"
#include "modules/backbone.h"
#include "cli/commands.h"
#include "base/config.h"
#include "cli/command_schemas.h"
#include "cli/model_setup.h"
#include "modules/policies/registry.h"
#include "train/method_registry.h"
#include "train/callbacks.h"
#include "train/data_parallel.h"
#include "train/run_state.h"
#include "train/trainer.h"

namespace kvbound {
namespace {

// The method train.method names, built by its registration; train.init_from must be consumed by it.
std::unique_ptr<TrainingMethod> make_method(const Config& c, const Backbone& model) {
  const MethodRegistration& registration = find_method(c.get_string("train.method"));
  MethodSetup setup{c, model, static_cast<std::uint64_t>(c.get_int("train.seed")), {}, {}};
  std::unique_ptr<TrainingMethod> method = registration.make(setup);
  if (!c.get_string("train.init_from").empty() && setup.init_metadata.empty())
    fail("config", "train.init_from", std::string("method ") + registration.name + " does not start from an earlier run");
  return method;
}

TrainerSettings trainer_settings(const Config& c) {
  TrainerSettings s;
  s.steps = c.get_int("train.steps");
  s.batch_size = c.get_int("train.batch_size");
  s.grad_accum = c.get_int("train.grad_accum");
  s.warmup = c.get_int("train.warmup");
  s.lr = c.get_float("train.lr");
  s.min_lr = c.get_float("train.min_lr");
  s.grad_clip = c.get_float("train.grad_clip");
  s.adamw.weight_decay = c.get_float("train.weight_decay");
  s.checkpoint_every = c.get_int("train.checkpoint_every");
  if (!(s.lr > 0)) fail("config", "train.lr", "must be > 0");
  if (s.warmup < 0) fail("config", "train.warmup", "must be >= 0");
  if (c.get_int("train.keep_checkpoints") < 1) fail("config", "train.keep_checkpoints", "must be >= 1");
  for (const char* key : {"train.log_every", "train.checkpoint_every", "train.eval_every"})
    if (c.get_int(key) < 0) fail("config", key, "must be >= 0 (0: off)");
  return s;
}

PeriodicEvalSettings periodic_eval(const Config& c, const Backbone& model, const Tokenizer& tokenizer) {
  PeriodicEvalSettings e;
  e.budget = c.get_int("train.eval_budget");
  e.every = c.get_int("train.eval_every");
  e.continuation.prefill_len = e.continuation.score_from = c.get_int("train.eval_prefill_len");
  e.continuation.chunk_size = c.get_int("train.eval_chunk_size");
  if (const std::string scope = c.get_string("train.eval_budget_scope"); scope != "policy")
    e.continuation.budget_scope = parse_budget_scope(scope, "train.eval_budget_scope");
  const std::string text = c.get_string("data.eval_text");
  if (text.empty()) return e;
  if (e.budget < 1) fail("config", "train.eval_budget", "must be >= 1");
  const std::int64_t windows = c.get_int("train.eval_windows");
  if (windows < 1) fail("config", "train.eval_windows", "must be >= 1");
  const at::NoGradGuard no_grad;
  const TextWindows held_out(text, text_part(c, "data.eval_text_part"), "data.eval_text_part");
  for (const auto& w : held_out.sample(tokenizer, windows, c.get_int("train.eval_context_len"),
                                       static_cast<std::uint64_t>(c.get_int("train.seed"))))
    e.references.push_back(continuation_reference(model, w, e.continuation));
  return e;
}

// --resume continues a run only with the config it was started with: the run's config.yaml, read with
// today's schema (keys added since take their defaults), must resolve to the same YAML as this invocation's.
// model.threads and model.device are runtime settings, not part of the run's identity (bit-identity then
// holds only on the same device and up to the reduction order of multithreaded kernels). Returns the run's
// config hash.
std::string check_same_run(const ConfigSchema& schema, const std::string& config_path,
                    const std::vector<std::string>& overrides, const std::string& run_dir) {
  const std::string saved_path = run_dir + "/config.yaml";
  if (!std::filesystem::exists(saved_path)) fail(run_dir, "config.yaml", "missing: not a run folder of kvbound train");
  const Config saved = Config::load(schema, saved_path, {});
  std::vector<std::string> same_runtime = overrides;
  same_runtime.push_back("model.threads=" + std::to_string(saved.get_int("model.threads")));
  same_runtime.push_back("model.device=" + yaml_quote(saved.get_string("model.device")));
  const std::string want = saved.to_yaml(), got = Config::load(schema, config_path, same_runtime).to_yaml();
  if (want == got) return saved.hash();
  std::istringstream a(want), b(got);
  std::string la, lb;
  while (std::getline(a, la) && std::getline(b, lb) && la == lb) {}
  const auto trim = [](std::string& line) { line.erase(0, line.find_first_not_of(' ')); };
  trim(la);
  trim(lb);
  fail(saved_path, "--resume", "this config differs from the run's (run: '" + la + "', now: '" + lb +
                                   "'); resume needs the same config");
}

// A free TCP port on this machine for the local ranks' rendezvous (released before they bind it).
std::int64_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    fail("--nproc", "", "no free local port for the ranks' rendezvous");
  ::close(fd);
  return ntohs(addr.sin_port);
}

// `--nproc N`: this same command as N local processes under torchrun's environment contract, each with 1/N of
// the cores unless model.threads fixes them. The first rank to fail stops the others; returns its exit code.
int launch_local_ranks(const std::vector<std::string>& args, std::int64_t nproc, std::int64_t threads) {
  const std::string port = std::to_string(free_port());
  const auto cores = static_cast<std::int64_t>(usable_cores());
  std::vector<std::string> child_args = args;
  if (threads == 0) child_args.insert(child_args.end(), {"--set", "model.threads=" + std::to_string(std::max<std::int64_t>(1, cores / nproc))});
  std::cerr << "[train] " << nproc << " local processes (rendezvous 127.0.0.1:" << port << ")\n";
  std::vector<pid_t> pids;
  for (std::int64_t rank = 0; rank < nproc; ++rank) {
    std::vector<std::string> argv_text{"kvbound", "train"};
    argv_text.insert(argv_text.end(), child_args.begin(), child_args.end());
    std::vector<char*> argv;
    for (std::string& a : argv_text) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string rank_text = std::to_string(rank), world_text = std::to_string(nproc);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", rank_text.c_str(), 1);
      ::setenv("LOCAL_RANK", rank_text.c_str(), 1);
      ::setenv("WORLD_SIZE", world_text.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execv("/proc/self/exe", argv.data());
      ::_exit(127);
    }
    if (pid < 0) fail("--nproc", "", "cannot start a process");
    pids.push_back(pid);
  }
  int code = 0;
  for (std::size_t left = pids.size(); left > 0; --left) {
    int status = 0;
    const pid_t done = ::wait(&status);
    const int exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (exit_code != 0 && code == 0) {
      code = exit_code;
      for (pid_t p : pids)
        if (p != done) ::kill(p, SIGTERM);  // the others would wait for the failed rank until their timeout
    }
  }
  return code;
}

}  // namespace

int cmd_train(int argc, char** argv) {
  const std::vector<std::string> original_args(argv + 1, argv + argc);
  const std::vector<std::string> overrides = extract_overrides(argc, argv);
  const ConfigSchema schema = train_schema();
  cxxopts::Options o("kvbound train", "Train a learned KV-eviction method on the frozen backbone. Override any config "
                                      "key with --set key=value (e.g. --set train.lr=1e-3).");
  o.add_options()("config", "YAML config (see configs/trimkv/)", cxxopts::value<std::string>())(
      "resume", "continue run.out_dir's latest checkpoint (same config; model.threads and model.device may differ)")(
      "stop-after", "stop after N updates in this invocation, with a checkpoint", cxxopts::value<std::int64_t>())(
      "nproc", "data-parallel over N local processes (each trains on its share of every batch)",
      cxxopts::value<std::int64_t>()->default_value("1"))(
      "h,help", "show help");
  o.parse_positional({"config"});
  o.positional_help("CONFIG");
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\nmethods (train.method):\n";
    for (const MethodRegistration* m : method_registry())
      std::cout << "  " << m->name << std::string(10 - std::min<std::size_t>(9, std::strlen(m->name)), ' ') << m->summary << "\n";
    std::cout << "\nconfig keys:\n" << schema.describe() << "\n";
    return 0;
  }
  const std::string config_path = r.count("config") ? r["config"].as<std::string>() : "";
  const std::optional<DistributedEnv> env = distributed_env();
  std::vector<std::string> resolved = overrides;
  // One CUDA device per process: `cuda` without an index means this rank's local one.
  if (env && Config::load(schema, config_path, overrides).get_string("model.device") == "cuda")
    resolved.push_back("model.device=cuda:" + std::to_string(env->local_rank));
  const Config config = Config::load(schema, config_path, resolved);
  const std::int64_t nproc = r["nproc"].as<std::int64_t>();
  if (nproc < 1) fail("--nproc", "", "must be >= 1");
  if (nproc > 1) {
    if (env) fail("--nproc", "", "this process is already rank " + std::to_string(env->rank) + " of a launched group");
    std::vector<std::string> args;
    for (std::size_t i = 0; i < original_args.size(); ++i) {
      if (original_args[i] == "--nproc") ++i;  // and its value
      else if (original_args[i].rfind("--nproc=", 0) != 0) args.push_back(original_args[i]);
    }
    return launch_local_ranks(args, nproc, config.get_int("model.threads"));
  }
  const std::int64_t rank = env ? env->rank : 0;
  TrainerSettings settings = trainer_settings(config);
  settings.resume = r.count("resume") > 0;
  settings.shard = {rank, env ? env->world : 1};
  const std::string run_dir = config.get_string("run.out_dir");
  // A resumed run keeps its identity (the hash its checkpoints and exports carry), whatever model.threads is now.
  const std::string config_hash = settings.resume ? check_same_run(schema, config_path, overrides, run_dir) : config.hash();
  if (r.count("stop-after")) {
    settings.stop_after = r["stop-after"].as<std::int64_t>();
    if (settings.stop_after < 1) fail("--stop-after", "N", "must be >= 1");
  }
  const ConfiguredModel loaded = load_configured_model(config);
  const auto& model = loaded.model;
  auto method = make_method(config, *model);
  const TrainingRows rows(config.get_string("data.train_text"), *loaded.tokenizer, config.get_int("train.seq_len"),
                          static_cast<std::uint64_t>(config.get_int("train.seed")),
                          RowCutting{config.get_bool("data.pack"), config.get_bool("data.shift_rows")},
                          config.get_float("data.recall_share"));
  if (rank == 0)
    std::cerr << "[train] " << method->name() << " on " << loaded.model_path << ": " << rows.num_rows() << " rows of <= "
              << rows.seq_len() << " tokens from " << rows.num_tokens() << " tokens\n";
  RunState run(run_dir, config_hash, config.get_int("train.keep_checkpoints"));
  if (rank == 0) {  // the run folder is rank 0's
    std::filesystem::create_directories(run_dir);
    if (!settings.resume) {
      if (!latest_checkpoint_path(run_dir).empty())
        fail(run_dir, "run.out_dir", "already holds a run; pass --resume to continue it or choose another folder");
      config.write(run_dir + "/config.yaml");
    }
  }
  std::unique_ptr<DataParallel> data_parallel = env ? std::make_unique<DataParallel>(*env, model->device()) : nullptr;
  Trainer trainer(*method, rows, settings, run, data_parallel.get());
  MetricsLog metrics(run.metrics_path(), config.get_int("train.log_every"));
  TensorBoardSink tensorboard((std::filesystem::path(run_dir) / "tensorboard").string());
  if (config.get_bool("run.tensorboard")) metrics.add_sink(&tensorboard);
  ProgressLine progress;
  std::unique_ptr<PeriodicEval> eval;
  if (rank == 0) {  // logs and evaluations are rank 0's
    eval = std::make_unique<PeriodicEval>(*model, periodic_eval(config, *model, *loaded.tokenizer), metrics, run);
    for (TrainerCallback* callback : std::initializer_list<TrainerCallback*>{&metrics, &progress, eval.get()})
      trainer.add_callback(callback);
  }
  const TrainSummary summary = trainer.run();
  if (rank != 0) return 0;
  std::cout << "[train] steps " << summary.first_step << " -> " << summary.last_step << " in " << summary.seconds
            << " s (" << summary.tokens_per_second << " tokens/s), last loss " << summary.last_loss;
  if (eval->best())
    std::cout << ", best eval KL " << eval->best()->kl << " at step " << eval->best()->step << " (M=" << eval->budget() << ")";
  std::cout << "\n[train] run folder: " << run_dir << " (export: kvbound export " << run_dir << " --best --out "
            << method->name() << ".safetensors)\n";
  return 0;
}

}  // namespace kvbound
