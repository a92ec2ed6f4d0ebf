// `kvbound train CONFIG [--set key=value ...] [--resume] [--stop-after N]`: trains a learned method's
// modules on the frozen backbone (train.method: trimkv | indexmem | memory) and writes the run folder
// described in train/trainer.h. `--resume` continues run.out_dir's latest checkpoint bit-identically
// (same config required; model.threads may differ); `--stop-after N` ends this invocation after N
// updates with a checkpoint (time-sliced jobs).
#include <ATen/core/grad_mode.h>

#include <cxxopts.hpp>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "checkpoints/errors.h"
#include "checkpoints/run_checkpoint.h"
#include "data/tokenizer.h"
#include "eval/text_windows.h"
#include "modules/backbone.h"
#include "train/commands.h"
#include "train/config.h"
#include "train/indexmem_method.h"
#include "train/memory_method.h"
#include "train/model_setup.h"
#include "train/trainer.h"
#include "train/trimkv_method.h"

namespace kvbound {
namespace {

ConfigSchema train_schema() {
  ConfigSchema s;
  add_model_keys(s);
  s.add_required("data.train_text", ConfigType::String, "training documents: .txt/.jsonl, or an .h5 from `kvbound prepare`")
      .add("data.eval_text", ConfigType::String, "\"\"", "held-out plain text for the periodic budgeted eval (empty: none)")
      .add("train.method", ConfigType::String, "trimkv", "what to train: trimkv | indexmem | memory")
      .add("train.steps", ConfigType::Int, "200", "optimizer updates")
      .add("train.seq_len", ConfigType::Int, "256", "tokens per row T (BOS included); rows never cross documents")
      .add("train.batch_size", ConfigType::Int, "8", "rows per micro-batch")
      .add("train.grad_accum", ConfigType::Int, "1", "micro-batches per update")
      .add("train.lr", ConfigType::Float, "2e-3", "peak learning rate (2e-3 tiny models, 2e-4 billion-scale)")
      .add("train.min_lr", ConfigType::Float, "0.0", "learning rate at the end of the cosine decay")
      .add("train.warmup", ConfigType::Int, "20", "linear warm-up updates")
      .add("train.weight_decay", ConfigType::Float, "0.01", "AdamW weight decay (matrices only)")
      .add("train.grad_clip", ConfigType::Float, "1.0", "max global gradient norm (<= 0: off)")
      .add("train.seed", ConfigType::Int, "0", "seed for initialisation and data order")
      .add("train.loss_block_rows", ConfigType::Int, "128", "positions whose vocabulary logits exist at once")
      .add("train.log_every", ConfigType::Int, "1", "updates between metrics.jsonl lines")
      .add("train.checkpoint_every", ConfigType::Int, "50", "updates between checkpoints (0: only at the end)")
      .add("train.keep_checkpoints", ConfigType::Int, "3", "checkpoint files kept")
      .add("train.eval_every", ConfigType::Int, "50", "updates between budgeted evals (0: only at the end)")
      .add("train.eval_budget", ConfigType::Int, "128", "deployment budget M of the periodic eval")
      .add("train.eval_windows", ConfigType::Int, "4", "held-out windows per eval")
      .add("train.eval_context_len", ConfigType::Int, "256", "eval window length (BOS included)")
      .add("train.eval_prefill_len", ConfigType::Int, "128", "eval prefill (then teacher-forced decode, scored)")
      .add("train.eval_chunk_size", ConfigType::Int, "32", "eval prefill chunk size")
      .add("trimkv.budget", ConfigType::Int, "32", "M_train of the capacity loss (tighter than the deployment M)")
      .add("trimkv.gate_hidden", ConfigType::Int, "128", "gate MLP width h (128 tiny models, 512 billion-scale)")
      .add("trimkv.bias_init", ConfigType::Float, "8.0", "gate bias at init (8: released Qwen3 gates; 18: paper)")
      .add("trimkv.capacity", ConfigType::String, "per_head", "capacity loss: per_head | global")
      .add("trimkv.w_kl", ConfigType::Float, "0.5", "weight of KL(teacher || student)")
      .add("trimkv.w_ntp", ConfigType::Float, "0.5", "weight of next-token cross-entropy")
      .add("trimkv.lambda_cap", ConfigType::Float, "1.0", "weight of the capacity loss")
      .add("indexmem.d_index", ConfigType::Int, "32", "indexer key/query size d_I (16..64; even with rope)")
      .add("indexmem.key_heads", ConfigType::String, "kv", "indexer keys: kv (one per KV head) | 1 (one shared key)")
      .add("indexmem.rope", ConfigType::Bool, "true", "RoPE on the indexer's queries and keys")
      .add("indexmem.relu", ConfigType::Bool, "false", "ReLU on indexer logits before the head-weighted sum")
      .add("indexmem.pool", ConfigType::String, "mean", "pooling over each key's query window: mean | max | logsumexp")
      .add("indexmem.window", ConfigType::Int, "32", "pool over the last W queries of the row (<= 0: every later query)")
      .add("indexmem.min_gap", ConfigType::Int, "0", "pool only over queries >= key position + min_gap")
      .add("indexmem.recent", ConfigType::Int, "8", "eval policy: newest tokens always kept")
      .add("memory.dim", ConfigType::Int, "16", "latent memory size d_m (16..64)")
      .add("memory.policy", ConfigType::String, "h2o", "base eviction policy the memory is trained (and evaluated) with")
      .add("memory.budgets", ConfigType::IntList, "[16, 32]", "budgets M whose evictions are replayed (loss averaged)")
      .add("memory.chunk", ConfigType::Int, "16", "replay chunk size (the engine's prefill chunk)")
      .add("run.out_dir", ConfigType::String, "runs/trimkv", "run folder");
  add_policy_keys(s);  // the heuristics a memory is trained under (memory.policy)
  return s;
}

std::unique_ptr<TrainingMethod> make_method(const Config& c, const Backbone& model) {
  const std::string method = c.get_string("train.method");
  if (method == "trimkv") {
    TrimKVSettings t;
    t.gate.hidden = c.get_int("trimkv.gate_hidden");
    t.gate.bias_init = c.get_float("trimkv.bias_init");
    t.budget = c.get_int("trimkv.budget");
    if (t.budget < 1) fail("config", "trimkv.budget", "must be >= 1");
    if (t.gate.hidden < 1) fail("config", "trimkv.gate_hidden", "must be >= 1");
    t.capacity = losses::parse_capacity_mode(c.get_string("trimkv.capacity"), "trimkv.capacity");
    t.w_kl = c.get_float("trimkv.w_kl");
    t.w_ntp = c.get_float("trimkv.w_ntp");
    t.lambda_cap = c.get_float("trimkv.lambda_cap");
    for (const char* key : {"trimkv.w_kl", "trimkv.w_ntp", "trimkv.lambda_cap"})
      if (!(c.get_float(key) >= 0)) fail("config", key, "must be >= 0");
    t.loss_block_rows = c.get_int("train.loss_block_rows");
    if (t.loss_block_rows < 1) fail("config", "train.loss_block_rows", "must be >= 1");
    return std::make_unique<TrimKVMethod>(model, t, static_cast<std::uint64_t>(c.get_int("train.seed")));
  }
  if (method == "indexmem") {
    IndexMemSettings m;
    m.indexer.d_index = c.get_int("indexmem.d_index");
    m.indexer.key_heads = c.get_string("indexmem.key_heads");
    m.indexer.rope = c.get_bool("indexmem.rope");
    m.indexer.relu = c.get_bool("indexmem.relu");
    m.pool_name = c.get_string("indexmem.pool");
    if (m.pool_name != "mean" && m.pool_name != "max" && m.pool_name != "logsumexp")
      fail("config", "indexmem.pool", "'" + m.pool_name + "' (mean, max, logsumexp)");
    m.pool = ops::parse_pool_mode(m.pool_name);
    m.window = c.get_int("indexmem.window");
    m.min_gap = c.get_int("indexmem.min_gap");
    if (m.min_gap < 0) fail("config", "indexmem.min_gap", "must be >= 0");
    m.recent = c.get_int("indexmem.recent");
    if (m.recent < 0) fail("config", "indexmem.recent", "must be >= 0");
    return std::make_unique<IndexMemIndexerMethod>(model, m, static_cast<std::uint64_t>(c.get_int("train.seed")));
  }
  if (method == "memory") {
    MemorySettings m;
    m.memory.dim = c.get_int("memory.dim");
    if (m.memory.dim < 1) fail("config", "memory.dim", "must be >= 1");
    m.policy = c.get_string("memory.policy");
    if (m.policy.size() > 4 && m.policy.substr(m.policy.size() - 4) == "+mem")
      fail("config", "memory.policy", "the base policy, without +mem (got '" + m.policy + "')");
    if (m.policy == "trimkv" || m.policy == "indexmem")
      fail("config", "memory.policy", "a memory under the learned '" + m.policy + "' policy is not built yet (use a heuristic)");
    m.policy_options = heuristic_policy_options(c);
    m.policy_options.seed = static_cast<std::uint64_t>(c.get_int("train.seed"));
    m.budgets = c.get_int_list("memory.budgets");
    m.chunk = c.get_int("memory.chunk");
    return std::make_unique<MemoryMethod>(model, m, static_cast<std::uint64_t>(c.get_int("train.seed")));
  }
  fail("config", "train.method", "'" + method + "' (trimkv, indexmem, memory)");
}

TrainerSettings trainer_settings(const Config& c) {
  TrainerSettings s;
  s.run_dir = c.get_string("run.out_dir");
  s.config_hash = c.hash();
  s.steps = c.get_int("train.steps");
  s.batch_size = c.get_int("train.batch_size");
  s.grad_accum = c.get_int("train.grad_accum");
  s.warmup = c.get_int("train.warmup");
  s.lr = c.get_float("train.lr");
  s.min_lr = c.get_float("train.min_lr");
  s.grad_clip = c.get_float("train.grad_clip");
  s.adamw.weight_decay = c.get_float("train.weight_decay");
  s.log_every = c.get_int("train.log_every");
  s.checkpoint_every = c.get_int("train.checkpoint_every");
  s.keep_checkpoints = c.get_int("train.keep_checkpoints");
  if (!(s.lr > 0)) fail("config", "train.lr", "must be > 0");
  if (s.warmup < 0) fail("config", "train.warmup", "must be >= 0");
  if (s.keep_checkpoints < 1) fail("config", "train.keep_checkpoints", "must be >= 1");
  for (const char* key : {"train.log_every", "train.checkpoint_every", "train.eval_every"})
    if (c.get_int(key) < 0) fail("config", key, "must be >= 0 (0: off)");
  return s;
}

PeriodicEval periodic_eval(const Config& c, const Backbone& model, const Tokenizer& tokenizer) {
  PeriodicEval e;
  e.budget = c.get_int("train.eval_budget");
  e.every = c.get_int("train.eval_every");
  e.settings.prefill_len = e.settings.score_from = c.get_int("train.eval_prefill_len");
  e.settings.chunk_size = c.get_int("train.eval_chunk_size");
  const std::string text = c.get_string("data.eval_text");
  if (text.empty()) return e;
  if (e.budget < 1) fail("config", "train.eval_budget", "must be >= 1");
  const std::int64_t windows = c.get_int("train.eval_windows");
  if (windows < 1) fail("config", "train.eval_windows", "must be >= 1");
  const at::NoGradGuard no_grad;
  for (const auto& w : TextWindows(text).sample(tokenizer, windows, c.get_int("train.eval_context_len"),
                                                static_cast<std::uint64_t>(c.get_int("train.seed"))))
    e.references.push_back(continuation_reference(model, w, e.settings));
  return e;
}

// --resume continues a run only with the config it was started with: the run's config.yaml, read with
// today's schema (keys added since take their defaults), must resolve to the same YAML as this invocation's.
// model.threads is a runtime setting, not part of the run's identity (bit-identity then holds only up to
// the reduction order of multithreaded kernels). Returns the run's config hash.
std::string check_same_run(const ConfigSchema& schema, const std::string& config_path,
                    const std::vector<std::string>& overrides, const std::string& run_dir) {
  const std::string saved_path = run_dir + "/config.yaml";
  if (!std::filesystem::exists(saved_path)) fail(run_dir, "config.yaml", "missing: not a run folder of kvbound train");
  const Config saved = Config::load(schema, saved_path, {});
  std::vector<std::string> same_threads = overrides;
  same_threads.push_back("model.threads=" + std::to_string(saved.get_int("model.threads")));
  const std::string want = saved.to_yaml(), got = Config::load(schema, config_path, same_threads).to_yaml();
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

}  // namespace

int cmd_train(int argc, char** argv) {
  const std::vector<std::string> overrides = extract_overrides(argc, argv);
  const ConfigSchema schema = train_schema();
  cxxopts::Options o("kvbound train", "Train a learned KV-eviction method on the frozen backbone. Override any config "
                                      "key with --set key=value (e.g. --set train.lr=1e-3).");
  o.add_options()("config", "YAML config (see configs/trimkv/)", cxxopts::value<std::string>())(
      "resume", "continue run.out_dir's latest checkpoint (same config; model.threads may differ)")(
      "stop-after", "stop after N updates in this invocation, with a checkpoint", cxxopts::value<std::int64_t>())(
      "h,help", "show help");
  o.parse_positional({"config"});
  o.positional_help("CONFIG");
  const auto r = o.parse(argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\nconfig keys:\n" << schema.describe() << "\n";
    return 0;
  }
  const std::string config_path = r.count("config") ? r["config"].as<std::string>() : "";
  const Config config = Config::load(schema, config_path, overrides);
  TrainerSettings settings = trainer_settings(config);
  settings.resume = r.count("resume") > 0;
  // A resumed run keeps its identity (the hash its checkpoints and exports carry), whatever model.threads is now.
  if (settings.resume) settings.config_hash = check_same_run(schema, config_path, overrides, settings.run_dir);
  if (r.count("stop-after")) {
    settings.stop_after = r["stop-after"].as<std::int64_t>();
    if (settings.stop_after < 1) fail("--stop-after", "N", "must be >= 1");
  }
  const ConfiguredModel loaded = load_configured_model(config);
  const std::string& model_path = loaded.model_path;
  const auto& tokenizer = loaded.tokenizer;
  const auto& model = loaded.model;
  auto method = make_method(config, *model);
  const TrainingRows rows(config.get_string("data.train_text"), *tokenizer, config.get_int("train.seq_len"),
                          static_cast<std::uint64_t>(config.get_int("train.seed")));
  std::cerr << "[train] " << method->name() << " on " << model_path << ": " << rows.num_rows() << " rows of <= "
            << rows.seq_len() << " tokens from " << rows.num_tokens() << " tokens\n";

  std::filesystem::create_directories(settings.run_dir);
  if (!settings.resume) {
    if (!latest_checkpoint_path(settings.run_dir).empty())
      fail(settings.run_dir, "run.out_dir", "already holds a run; pass --resume to continue it or choose another folder");
    config.write(settings.run_dir + "/config.yaml");
  }
  const PeriodicEval eval = periodic_eval(config, *model, *tokenizer);
  const TrainSummary summary = train(*model, *method, rows, settings, &eval);
  std::cout << "[train] steps " << summary.first_step << " -> " << summary.last_step << " in " << summary.seconds
            << " s (" << summary.tokens_per_second << " tokens/s), last loss " << summary.last_loss;
  if (summary.best_step >= 0)
    std::cout << ", best eval KL " << summary.best_eval_kl << " at step " << summary.best_step << " (M="
              << eval.budget << ")";
  std::cout << "\n[train] run folder: " << settings.run_dir << " (export: kvbound export " << settings.run_dir
            << " --best --out " << method->name() << ".safetensors)\n";
  return 0;
}

}  // namespace kvbound
