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
#include "train/joint_method.h"
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
      .add("train.init_from", ConfigType::String, "\"\"",
           "memory under trimkv/indexmem: the stage-1 run folder (its best.safetensors, else latest checkpoint) or export")
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
      .add("indexmem.lambda_mse", ConfigType::Float, "1.0", "memory.joint: weight of L_MSE in L_KL + lambda_mse * L_MSE")
      .add("indexmem.lr", ConfigType::Float, "2e-3", "memory.joint: the indexer's peak learning rate (train.lr: the memory's)")
      .add("memory.dim", ConfigType::Int, "16", "latent memory size d_m (16..64)")
      .add("memory.policy", ConfigType::String, "h2o", "base eviction policy the memory is trained (and evaluated) with")
      .add("memory.budgets", ConfigType::IntList, "[16, 32]", "budgets M whose evictions are replayed (loss averaged)")
      .add("memory.chunk", ConfigType::Int, "16", "replay chunk size (the engine's prefill chunk)")
      .add("memory.joint", ConfigType::Bool, "false", "memory.policy indexmem: train the indexer too (L_KL + lambda_mse * L_MSE)")
      .add("run.out_dir", ConfigType::String, "runs/trimkv", "run folder");
  add_policy_keys(s);  // the policy a memory is trained under (memory.policy), and indexmem's eval policy
  return s;
}

std::uint64_t seed_of(const Config& c) { return static_cast<std::uint64_t>(c.get_int("train.seed")); }

IndexerSettings indexer_settings_of(const Config& c) {
  IndexerSettings s;
  s.d_index = c.get_int("indexmem.d_index");
  s.key_heads = c.get_string("indexmem.key_heads");
  s.rope = c.get_bool("indexmem.rope");
  s.relu = c.get_bool("indexmem.relu");
  return s;
}

// The KL target (indexmem.pool/window/min_gap) and eval policy of an indexer with `indexer` settings.
IndexMemSettings indexmem_settings(const Config& c, const IndexerSettings& indexer) {
  IndexMemSettings m;
  m.indexer = indexer;
  m.pool_name = c.get_string("indexmem.pool");
  if (m.pool_name != "mean" && m.pool_name != "max" && m.pool_name != "logsumexp")
    fail("config", "indexmem.pool", "'" + m.pool_name + "' (mean, max, logsumexp)");
  m.pool = ops::parse_pool_mode(m.pool_name);
  m.window = c.get_int("indexmem.window");
  m.min_gap = c.get_int("indexmem.min_gap");
  if (m.min_gap < 0) fail("config", "indexmem.min_gap", "must be >= 0");
  m.policy_options = configured_policy_options(c);
  return m;
}

std::unique_ptr<TrainingMethod> make_method(const Config& c, const Backbone& model) {
  const std::string method = c.get_string("train.method");
  if (method != "memory" && !c.get_string("train.init_from").empty())
    fail("config", "train.init_from", "only train.method memory starts from a stage-1 run (got method '" + method + "')");
  if (method != "memory" && c.get_bool("memory.joint"))
    fail("config", "memory.joint", "only train.method memory trains a memory (got method '" + method + "')");
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
    return std::make_unique<TrimKVMethod>(model, t, seed_of(c));
  }
  if (method == "indexmem") {
    return std::make_unique<IndexMemIndexerMethod>(model, indexmem_settings(c, indexer_settings_of(c)), seed_of(c));
  }
  if (method == "memory") {
    MemorySettings m;
    m.memory.dim = c.get_int("memory.dim");
    if (m.memory.dim < 1) fail("config", "memory.dim", "must be >= 1");
    m.policy = c.get_string("memory.policy");
    if (m.policy.size() > 4 && m.policy.substr(m.policy.size() - 4) == "+mem")
      fail("config", "memory.policy", "the base policy, without +mem (got '" + m.policy + "')");
    m.policy_options = configured_policy_options(c);
    m.policy_options.seed = seed_of(c);
    m.budgets = c.get_int_list("memory.budgets");
    m.chunk = c.get_int("memory.chunk");
    const bool joint = c.get_bool("memory.joint");
    if (joint && m.policy != "indexmem") fail("config", "memory.joint", "needs memory.policy indexmem (got '" + m.policy + "')");
    // A learned base policy evicts with stage 1's weights; nothing else is read from train.init_from.
    const std::string init_from = c.get_string("train.init_from");
    const bool learned = m.policy == "trimkv" || m.policy == "indexmem";
    if (!learned && !init_from.empty())
      fail("config", "train.init_from", "memory.policy '" + m.policy + "' has no trained weights to start from");
    if (learned && init_from.empty())
      fail("config", "train.init_from", "memory.policy '" + m.policy + "' needs the stage-1 run folder or its export");
    const std::string weights = learned && std::filesystem::is_directory(init_from)
                                    ? run_weights_path(init_from, std::filesystem::exists(init_from + "/best.safetensors"),
                                                       "train.init_from")
                                    : init_from;
    if (learned) {
      const auto meta = read_weights(weights, "train.init_from").metadata;
      m.base_weights = {{"init_from", weights},
                        {"init_from_step", meta.count("step") ? meta.at("step") : ""},
                        {"init_from_config_hash", meta.count("config_hash") ? meta.at("config_hash") : ""}};
    }
    if (m.policy == "trimkv") m.policy_options.trimkv_gates = load_gates(weights, model.config(), "train.init_from");
    if (m.policy != "indexmem") return std::make_unique<MemoryMethod>(model, m, seed_of(c));

    const std::shared_ptr<const Indexer> stage1 = load_indexer(weights, model.config(), "train.init_from");
    if (!joint) {
      m.policy_options.indexer = stage1;
      return std::make_unique<MemoryMethod>(model, m, seed_of(c));
    }
    // Joint: the stage-1 indexer (its own settings; the KL target from this config's indexmem.*) becomes the
    // trainable one. The copy shares stage1's tensors, which nothing else holds: making them leaves is enough.
    auto indexer = std::make_shared<Indexer>(*stage1);
    for (at::Tensor& p : indexer->parameters()) p.set_requires_grad(true);
    auto kl = std::make_unique<IndexMemIndexerMethod>(model, indexmem_settings(c, indexer->settings()), indexer);
    m.policy_options.indexer = indexer;
    return std::make_unique<JointMethod>(std::move(kl), std::make_unique<MemoryMethod>(model, m, seed_of(c)),
                                         c.get_float("indexmem.lambda_mse"), c.get_float("indexmem.lr") / c.get_float("train.lr"));
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
