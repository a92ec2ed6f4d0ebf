#include "train/memory_method.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scaled_dot_product_attention.h>

#include <optional>

#include "checkpoints/errors.h"
#include "modules/budgeted_cache.h"
#include "modules/memory_cache.h"
#include "modules/policies/registry.h"

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
  c.positions = full.positions.narrow(0, s, n);
  return c;
}

// The chunk's attention over the layer's cache (already holding the chunk), with the backbone's mask rule:
// every cached entry precedes the chunk, so "all cached + causal within the chunk".
at::Tensor attend(const AttentionCall& call, const KVCache& cache) {
  const std::int64_t T = call.q.size(2), cached = cache.size(call.layer) - T;
  std::optional<at::Tensor> mask;
  bool causal = false;
  if (T > 1 && cached == 0) {
    causal = true;
  } else if (T > 1) {
    const auto opts = at::TensorOptions().dtype(at::kBool);
    mask = at::cat({at::ones({T, cached}, opts), at::ones({T, T}, opts).tril()}, 1);
  }
  return at::scaled_dot_product_attention(call.q, cache.keys(call.layer), cache.values(call.layer), mask, 0.0, causal,
                                          std::nullopt, /*enable_gqa=*/call.q.size(1) != call.k.size(1));
}

}  // namespace

MemoryMethod::MemoryMethod(const Backbone& model, const MemorySettings& settings, std::uint64_t seed)
    : model_(model), settings_(settings),
      memory_(std::make_shared<LatentMemory>(LatentMemory::init(model.config(), settings.memory, seed))) {
  if (settings.chunk < 1) fail("config", "memory.chunk", "must be >= 1");
  if (settings.budgets.empty()) fail("config", "memory.budgets", "needs at least one budget");
  for (std::int64_t b : settings.budgets)
    if (b < 1) fail("config", "memory.budgets", "every budget must be >= 1, got " + std::to_string(b));
  if (!make_policy(settings.policy, settings.policy_options)->bounded())
    fail("config", "memory.policy", "'" + settings.policy + "' never evicts: nothing would reach the memory");
}

StepLoss MemoryMethod::loss(const Batch& batch) {
  TeacherCapture teacher;
  {
    const at::NoGradGuard no_grad;
    KVCache cache = model_.make_cache();
    model_.forward_hidden(batch.inputs, cache, &teacher);
  }
  const ModelConfig& c = model_.config();
  const std::int64_t num_layers = c.num_layers, T = batch.inputs.size(1);
  // Padding and a document's last token carry no weight; padding only ever follows real tokens.
  const at::Tensor real = batch.weights.gt(0).to(at::kFloat).view({batch.inputs.size(0), 1, T, 1});
  std::vector<at::Tensor> layer_mse(static_cast<std::size_t>(num_layers));
  std::int64_t budgets_used = 0;
  for (std::int64_t budget : settings_.budgets) {
    // The engine's hook, driven chunk by chunk with the teacher's q/k/v instead of a forward.
    auto policy = make_policy(settings_.policy, settings_.policy_options);
    BudgetedCache budgeted(*policy, budget);
    MemoryAugmentedCache hook(budgeted, memory_);
    KVCache cache = model_.make_cache();
    std::vector<at::Tensor> sse(static_cast<std::size_t>(num_layers));
    double elements = 0;
    for (std::int64_t s = 0; s < T; s += settings_.chunk) {
      const std::int64_t n = std::min(settings_.chunk, T - s);
      // Before the first eviction o equals o_full and the memory is empty: such chunks teach nothing. Every
      // layer holds as many entries, so layer 0 decides for the chunk: evicted before its attention (a
      // pre-evicting policy) or after an earlier chunk's.
      bool scored = false;
      const at::Tensor mask = real.narrow(2, s, n);
      for (std::int64_t l = 0; l < num_layers; ++l) {
        const AttentionCall& full = teacher.calls[static_cast<std::size_t>(l)];
        AttentionCall call = chunk_of(full, s, n);
        hook.before_attention(call, cache);  // a pre-evicting policy's cut (writing the memory)
        if (l == 0) scored = budgeted.evictions() > 0;
        cache.append(l, call.k, call.v, call.positions);
        call.output = attend(call, cache);
        hook.after_attention(call, cache);  // read, evict (writing the memory), o += g·m: the eval's order
        if (!scored) continue;
        const at::Tensor err = (call.output.to(at::kFloat) - full.output.narrow(2, s, n).to(at::kFloat)) * mask;
        at::Tensor& e = sse[static_cast<std::size_t>(l)];
        e = e.defined() ? e + err.pow(2).sum() : err.pow(2).sum();
      }
      cache.advance(n);
      if (scored) elements += mask.sum().item<double>() * static_cast<double>(c.num_heads * c.head_dim);
    }
    if (elements == 0) continue;  // rows too short for this budget to evict
    ++budgets_used;
    for (std::size_t l = 0; l < sse.size(); ++l) {
      const at::Tensor mse = sse[l] / elements;
      layer_mse[l] = layer_mse[l].defined() ? layer_mse[l] + mse : mse;
    }
  }
  return layer_mean_loss(std::move(layer_mse), static_cast<double>(budgets_used), "mse", memory_->parameters());
}

std::unique_ptr<EvictionPolicy> MemoryMethod::eval_policy() const {
  PolicyOptions o = settings_.policy_options;
  o.memory = memory_;
  return make_policy(settings_.policy + "+mem", o);
}

std::map<std::string, std::string> MemoryMethod::metadata() const {
  const ModelConfig& c = model_.config();
  std::string budgets;
  for (std::int64_t b : settings_.budgets) budgets += (budgets.empty() ? "" : ",") + std::to_string(b);
  std::map<std::string, std::string> m = settings_.base_weights;
  m.insert({{"method", "memory"},
          {"stage", "memory"},
          {"backbone", model_.source()},
          {"architecture", c.architecture},
          {"num_layers", std::to_string(c.num_layers)},
          {"hidden_size", std::to_string(c.hidden_size)},
          {"num_kv_heads", std::to_string(c.num_kv_heads)},
          {"d_memory", std::to_string(memory_->dim())},
          {"memory_policy", settings_.policy},
          {"memory_budgets", budgets},
          {"memory_chunk", std::to_string(settings_.chunk)}});
  return m;
}

}  // namespace kvbound
