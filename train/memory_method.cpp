#include "train/memory_method.h"

#include <ATen/core/grad_mode.h>

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros_like.h>

#include "base/errors.h"
#include "losses/distillation.h"
#include "losses/memory_mse.h"
#include "modules/budgeted_cache.h"
#include "modules/memory_cache.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

// Every layer's call of one plain forward over whole rows: q/k/v (post- and pre-RoPE) and the
// full-attention output o_full.
class TeacherCapture final : public AttentionHook {
 public:
  void after_attention(AttentionCall& call, KVCache&) override { calls.push_back(call); }
  std::vector<AttentionCall> calls;
};

// Positions [s, s + n) of a captured call: what the engine's hook would see for that chunk.
AttentionCall chunk_of(const AttentionCall& full, std::int64_t s, std::int64_t n) {
  AttentionCall c;
  c.layer = full.layer;
  c.normed_input = full.normed_input.narrow(1, s, n);
  c.q = full.q.narrow(2, s, n);
  c.k = full.k.narrow(2, s, n);
  c.v = full.v.narrow(2, s, n);
  c.q_pre_rope = full.q_pre_rope.narrow(2, s, n);
  c.k_pre_rope = full.k_pre_rope.narrow(2, s, n);
  c.inv_freq = full.inv_freq;
  c.positions = full.positions.narrow(0, s, n);
  c.start = full.start + s;
  return c;
}

TrainedModules with_live_memory(TrainedModules modules, const std::shared_ptr<LatentMemory>& memory) {
  modules.add<LatentMemory>(memory);
  return modules;
}

// Whether a chunk's attention ran after an eviction, so that the memory could shape its output: an earlier
// chunk's eviction, or this chunk's own pre-eviction (a pre-evicting policy cuts only before attention; any other
// policy's cut during the call came after the chunk's attention). Before that, the output is the full model's.
bool attended_after_an_eviction(const EvictionPolicy& policy, std::int64_t evictions_before, std::int64_t evictions_after) {
  return evictions_before > 0 || (policy.pre_evicts() && evictions_after > evictions_before);
}

}  // namespace

MemoryMethod::MemoryMethod(const Backbone& model, const MemorySettings& settings, std::uint64_t seed)
    : model_(model), settings_(settings), seed_(seed),
      memory_(std::make_shared<LatentMemory>(LatentMemory::init(model.config(), settings.memory, seed))),
      base_(settings.policy, settings.policy_config, settings.base_modules),
      with_memory_(settings.policy + "+mem", settings.policy_config, with_live_memory(settings.base_modules, memory_)) {
  memory_->to(model.device());
  if (settings.loss == MemoryLoss::Kl) head_.emplace(model.lm_head());
  if (base_.make(seed)->needs_hindsight())
    fail("config", "memory.policy", "'" + settings.policy + "' ranks by the full model's future attention, which only evaluation hands it");
  if (settings.chunk < 1) fail("config", "memory.chunk", "must be >= 1");
  if (settings.budgets.empty()) fail("config", "memory.budgets", "needs at least one budget");
  for (std::int64_t b : settings.budgets)
    if (b < 1) fail("config", "memory.budgets", "every budget must be >= 1, got " + std::to_string(b));
}

MemoryLoss parse_memory_loss(const std::string& name) {
  if (name == "mse") return MemoryLoss::Mse;
  if (name == "kl") return MemoryLoss::Kl;
  fail("config", "memory.loss", "must be mse or kl, got '" + name + "'");
}

std::string memory_loss_name(MemoryLoss loss) { return loss == MemoryLoss::Kl ? "kl" : "mse"; }

StepLoss MemoryMethod::loss(const Batch& batch) {
  return settings_.loss == MemoryLoss::Kl ? kl_loss(batch) : mse_loss(batch);
}

StepLoss MemoryMethod::kl_loss(const Batch& batch) {
  const at::Tensor teacher_hidden = model_.teacher_hidden(batch.inputs);
  const std::int64_t T = batch.inputs.size(1);
  at::Tensor kl_sum;
  std::int64_t budgets_used = 0;
  StepLoss out;
  for (std::int64_t budget : settings_.budgets) {
    // The engine's forward (eval/continuation's prefill), with gradients: no chunk is replayed on teacher inputs.
    auto policy = with_memory_.make(seed_);
    BudgetedHook hook(*policy, budget);
    KVCache cache = model_.make_cache();
    std::vector<at::Tensor> hidden, weights;
    for (std::int64_t s = 0; s < T; s += settings_.chunk) {
      const std::int64_t n = std::min(settings_.chunk, T - s);
      const std::int64_t evictions_before = hook.budgeted().evictions();
      hidden.push_back(model_.forward_hidden(batch.inputs.narrow(1, s, n), cache, hook.get()));
      const bool scored = attended_after_an_eviction(*policy, evictions_before, hook.budgeted().evictions());
      const at::Tensor w = batch.weights.narrow(1, s, n);
      weights.push_back(scored ? w : at::zeros_like(w));
    }
    const at::Tensor w = at::cat(weights, 1);
    // Every step logs every budget (data-parallel ranks reduce the stats by name): 0 where nothing was scored
    // (rows too short for this budget to evict).
    const std::string stat = "kl_M" + std::to_string(budget);
    if (w.sum().item<double>() == 0) {
      out.stats[stat] = 0;
      continue;
    }
    const losses::DistillationTerms d =
        losses::distillation_loss(at::cat(hidden, 1), teacher_hidden, *head_, batch.targets, w,
                                  settings_.loss_block_rows, losses::DistillationGradients::kKlOnly);
    out.stats[stat] = d.kl.item<double>();
    kl_sum = kl_sum.defined() ? kl_sum + d.kl : d.kl;
    ++budgets_used;
  }
  if (budgets_used == 0) return layer_mean_loss({}, 0, "kl", memory_->parameters());
  out.total = kl_sum / static_cast<double>(budgets_used);
  out.terms = {{"kl", out.total}};
  return out;
}

StepLoss MemoryMethod::mse_loss(const Batch& batch) {
  TeacherCapture teacher;
  model_.teacher_hidden(batch.inputs, &teacher);
  const ModelConfig& c = model_.config();
  const std::int64_t num_layers = c.num_layers, T = batch.inputs.size(1);
  // Padding and a document's last token carry no weight; padding only ever follows real tokens.
  const at::Tensor real = batch.weights.gt(0).to(at::kFloat).view({batch.inputs.size(0), 1, T, 1});
  const at::Tensor real_per_position = batch.weights.gt(0).sum(0).to(at::kCPU);  // [T], for the element counts
  const auto real_at = real_per_position.accessor<std::int64_t, 1>();
  std::vector<at::Tensor> layer_mse(static_cast<std::size_t>(num_layers));
  std::int64_t budgets_used = 0;
  for (std::int64_t budget : settings_.budgets) {
    // The engine's hook, driven chunk by chunk with the teacher's q/k/v instead of a forward.
    auto policy = base_.make(seed_);
    BudgetedCache budgeted(*policy, budget);
    MemoryAugmentedCache hook(budgeted, memory_);
    KVCache cache = model_.make_cache();
    losses::MemoryMSE mse(num_layers);
    for (std::int64_t s = 0; s < T; s += settings_.chunk) {
      const std::int64_t n = std::min(settings_.chunk, T - s);
      // Before the first eviction o equals o_full and the memory is empty: such chunks teach nothing. Every
      // layer holds as many entries, so layer 0 decides for the chunk.
      const std::int64_t evictions_before = budgeted.evictions();
      bool scored = false;
      const at::Tensor mask = real.narrow(2, s, n);
      for (std::int64_t l = 0; l < num_layers; ++l) {
        const AttentionCall& full = teacher.calls[static_cast<std::size_t>(l)];
        AttentionCall call = chunk_of(full, s, n);
        attend_over_cache(call, cache, &hook);  // the eval's order: pre-evict, attend, read, evict, o += g·m
        if (l == 0)
          scored = attended_after_an_eviction(*policy, evictions_before, budgeted.evictions());
        if (scored) mse.add(l, call.output, full.output.narrow(2, s, n), mask);
      }
      cache.advance(n);
      if (!scored) continue;
      std::int64_t real_positions = 0;
      for (std::int64_t p = s; p < s + n; ++p) real_positions += real_at[p];
      mse.count(static_cast<double>(real_positions * c.num_heads * c.head_dim));
    }
    if (mse.empty()) continue;  // rows too short for this budget to evict
    ++budgets_used;
    const std::vector<at::Tensor> per_layer = mse.per_layer();
    for (std::size_t l = 0; l < per_layer.size(); ++l)
      layer_mse[l] = layer_mse[l].defined() ? layer_mse[l] + per_layer[l] : per_layer[l];
  }
  return layer_mean_loss(std::move(layer_mse), static_cast<double>(budgets_used), "mse", memory_->parameters());
}

std::map<std::string, std::string> MemoryMethod::metadata() const {
  std::string budgets;
  for (std::int64_t b : settings_.budgets) budgets += (budgets.empty() ? "" : ",") + std::to_string(b);
  std::map<std::string, std::string> m = settings_.base_weights;
  m.merge(backbone_metadata(model_));
  m.insert({{"method", "memory"},
            {"stage", "memory"},
            {"d_memory", std::to_string(memory_->dim())},
            {"memory_policy", settings_.policy},
            {"memory_read", memory_read_name(memory_->read_mode())},
            {"memory_budgets", budgets},
            {"memory_chunk", std::to_string(settings_.chunk)},
            {"memory_loss", memory_loss_name(settings_.loss)}});
  return m;
}

MemorySettings memory_settings(const MethodSetup& setup) {
  const Config& c = setup.config;
  MemorySettings m;
  m.memory.dim = c.get_int("memory.dim");
  if (m.memory.dim < 1) fail("config", "memory.dim", "must be >= 1");
  m.memory.read = parse_memory_read(c.get_string("memory.read"), "config", "memory.read");
  m.memory.gate_bias_init = initial_gate_bias(m.memory.read);
  m.loss = parse_memory_loss(c.get_string("memory.loss"));
  m.loss_block_rows = c.get_int("train.loss_block_rows");
  if (m.loss_block_rows < 1) fail("config", "train.loss_block_rows", "must be >= 1");
  m.policy = c.get_string("memory.policy");
  if (m.policy.size() > 4 && m.policy.substr(m.policy.size() - 4) == "+mem")
    fail("config", "memory.policy", "the base policy, without +mem (got '" + m.policy + "')");
  m.budgets = c.get_int_list("memory.budgets");
  m.chunk = c.get_int("memory.chunk");
  m.policy_config = c;
  m.base_modules = setup.init_modules;
  m.base_weights = setup.init_metadata;
  return m;
}

namespace methods {
namespace {

// A memory serves the policy it was trained under (`serves`; "" accepts any).
void load_memory(const SafetensorsFile& file, const std::string& path, const Backbone& model, TrainedModules& modules,
                 const std::string& serves) {
  const auto trained_under = file.metadata.find("memory_policy");
  if (!serves.empty() && trained_under != file.metadata.end() && trained_under->second != serves)
    fail(path, "memory_policy", "this memory was trained under '" + trained_under->second + "', not '" + serves + "'");
  // Files written before slot reads existed carry no memory_read: they are add.
  const auto read = file.metadata.find("memory_read");
  const MemoryRead mode = read == file.metadata.end() ? MemoryRead::Add : parse_memory_read(read->second, path, "memory_read");
  auto memory = std::make_shared<LatentMemory>(LatentMemory::from_tensors(file.tensors, model.config(), mode, path));
  memory->to(model.device());
  modules.add<LatentMemory>(memory, serves);
}

void load_any(const SafetensorsFile& file, const std::string& path, const Backbone& model, TrainedModules& modules) {
  load_memory(file, path, model, modules, "");
}

void load_for_eval(const Config& c, const Backbone& model, TrainedModules& modules, std::map<std::string, std::string>& meta) {
  load_weights_key(c, "memory.weights", model, modules, meta, load_any);
  std::string memory_for;
  for (const std::string& entry : c.get_string_list("memory.weights_for")) {
    const auto eq = entry.find('=');
    const std::string policy = entry.substr(0, eq);
    const std::vector<std::string> known = policy_names();
    if (eq == std::string::npos || eq + 1 == entry.size() || std::find(known.begin(), known.end(), policy) == known.end())
      fail("config", "memory.weights_for", "'" + entry + "' is not POLICY=FILE with a known base policy");
    load_weights(entry.substr(eq + 1), "memory.weights_for", model, modules,
                 [&policy](const SafetensorsFile& file, const std::string& path, const Backbone& m, TrainedModules& into) {
                   load_memory(file, path, m, into, policy);
                 });
    memory_for += (memory_for.empty() ? "" : ", ") + entry;
  }
  if (!memory_for.empty()) meta["memory.weights_for"] = memory_for;
}

std::unique_ptr<TrainingMethod> make(MethodSetup& setup) {
  // A learned base policy evicts with stage 1's weights (train.init_from); a heuristic needs none.
  const std::string policy = setup.config.get_string("memory.policy");
  const MethodRegistration* stage1 = method_serving(policy, setup.config);
  if (stage1) {
    load_init_from(setup, *stage1);
  } else if (!setup.config.get_string("train.init_from").empty()) {
    fail("config", "train.init_from", "memory.policy '" + policy + "' has no trained weights to start from");
  }
  return std::make_unique<MemoryMethod>(setup.model, memory_settings(setup), setup.seed);
}

}  // namespace

extern const MethodRegistration memory{
    "memory",
    "IndexMem stage 2: the latent memory under memory.policy (MSE to full attention); evaluated by <memory.policy>+mem",
    nullptr,
    {"memory.weights"},
    [](ConfigSchema& s) {
      s.add("memory.dim", ConfigType::Int, "16", "latent memory size d_m (16..64)")
          .add("memory.read", ConfigType::String, "slot",
               "how the read enters attention: slot (one more softmax entry beside the retained keys, logit "
               "log(q.z / d_m) + w.q + c; c starts at 0) | add (o + g(q) m(q); gate bias starts at -4)")
          .add("memory.loss", ConfigType::String, "mse",
               "what the memory matches: mse (each layer's full-attention output, on the teacher's q/k/v) | kl (the "
               "full model's next-token distribution through the budgeted forward, end to end; slower)")
          .add("memory.policy", ConfigType::String, "h2o",
               "base eviction policy the memory is trained (and evaluated) with; a learned one (trimkv, indexmem) "
               "starts from train.init_from")
          .add("memory.budgets", ConfigType::IntList, "[16, 32]", "budgets M whose evictions are replayed (loss averaged)")
          .add("memory.chunk", ConfigType::Int, "16", "replay chunk size (the engine's prefill chunk)");
    },
    [](ConfigSchema& s) {
      s.add("memory.weights", ConfigType::String, "\"\"", "latent memory file from `kvbound export` (required by every <policy>+mem)")
          .add("memory.weights_for", ConfigType::StringList, "[]",
               "POLICY=FILE entries: POLICY+mem uses FILE (the memory trained under POLICY) instead of memory.weights");
    },
    [](const Config& c) { return c.get_string("memory.policy") + "+mem"; },
    make,
    load_any,
    load_for_eval,
    {}};

}  // namespace methods
}  // namespace kvbound
