#include "train/trimkv_method.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/exp.h>

#include "base/errors.h"
#include "losses/distillation.h"
#include "losses/future_attention.h"
#include "modules/budgeted_cache.h"
#include "train/method_registry.h"
#include "train/trimkv_official_export.h"

namespace kvbound {
namespace {

TrainedModules live(const std::shared_ptr<RetentionGates>& gates) {
  TrainedModules m;
  m.add<RetentionGates>(gates);
  return m;
}

// On the teacher's forward: each layer's attention paid after each cut point, the target of L_future. Reduced
// layer by layer, so the T×T attention of one layer at a time exists.
struct FutureAttentionHook final : AttentionHook {
  std::vector<std::int64_t> cuts;
  at::Tensor weights;
  std::vector<at::Tensor> mass;  // per layer [B, Hkv, C, T]
  void after_attention(AttentionCall& call, KVCache& cache) override {
    mass.push_back(losses::future_attention_mass(chunk_attention_probs(call, cache).mean(2), cuts, weights));
  }
};

}  // namespace

TrimKVMethod::TrimKVMethod(const Backbone& model, const TrimKVSettings& settings, std::uint64_t seed,
                           const RetentionGates* start)
    : model_(model), settings_(settings),
      gates_(std::make_shared<RetentionGates>(RetentionGates::init(model.config(), settings.gate, seed))),
      policy_("trimkv", settings.policy_config, live(gates_)),
      head_(model.lm_head()) {
  gates_->to(model.device());
  if (start == nullptr) return;
  if (start->hidden() != gates_->hidden())
    fail("config", "trimkv.gate_hidden", std::to_string(gates_->hidden()) + " but the gates of train.init_from are " +
                                             std::to_string(start->hidden()) + " wide");
  const at::NoGradGuard no_grad;
  const std::map<std::string, at::Tensor> from = start->named_tensors();
  for (auto& [name, p] : gates_->named_tensors()) p.copy_(from.at(name));
}

StepLoss TrimKVMethod::loss(const Batch& batch) {
  FutureAttentionHook future;
  const bool with_future = settings_.w_future > 0;
  if (with_future) {
    future.cuts = losses::future_cuts(batch.inputs.size(1), settings_.future_stride);
    future.weights = batch.weights;
  }
  const at::Tensor teacher_hidden = model_.teacher_hidden(batch.inputs, with_future ? &future : nullptr);
  GatedAttentionHook hook(*gates_, settings_.sinks, settings_.cut_budget, settings_.cut_chunk);
  KVCache cache = model_.make_cache();
  const at::Tensor student_hidden = model_.forward_hidden(batch.inputs, cache, &hook);
  // The ce term is always logged; its gradient (one more product into the head per block) only when it is used.
  const losses::DistillationTerms d = losses::distillation_loss(
      student_hidden, teacher_hidden, head_, batch.targets, batch.weights, settings_.loss_block_rows,
      settings_.w_ntp != 0 ? losses::DistillationGradients::kBoth : losses::DistillationGradients::kKlOnly);
  const at::Tensor cap = losses::capacity_loss(hook.log_betas(), settings_.budget, settings_.capacity, batch.weights);
  StepLoss out;
  out.total = settings_.w_kl * d.kl + settings_.w_ntp * d.ce + settings_.lambda_cap * cap;
  out.terms = {{"kl", d.kl}, {"ce", d.ce}, {"cap", cap}};
  if (with_future) {
    const at::Tensor f = losses::future_attention_loss(hook.log_betas(), future.mass, future.cuts, batch.weights);
    out.total = out.total + settings_.w_future * f;
    out.terms.emplace_back("future", f);
  }
  const at::NoGradGuard no_grad;
  out.stats["capacity"] = losses::expected_cache_size(hook.log_betas(), batch.weights);
  // Mean β per layer over real positions: how much each layer forgets.
  const at::Tensor w = batch.weights.unsqueeze(1);  // [B, 1, T]
  for (const at::Tensor& lb : hook.log_betas())
    out.per_layer.push_back(((at::exp(lb.detach()) * w).sum() / (w.sum() * lb.size(1))).item<double>());
  return out;
}

std::map<std::string, std::vector<at::Tensor>> TrimKVMethod::distributions(const Backbone& model,
                                                                           const std::vector<at::Tensor>& windows) const {
  // Every layer's normalised input of a plain forward over each window, through the current gates.
  struct NormedInputs : AttentionHook {
    std::vector<at::Tensor> x;
    void before_attention(AttentionCall& call, KVCache&) override { x.push_back(call.normed_input); }
  };
  const at::NoGradGuard no_grad;
  std::vector<std::vector<at::Tensor>> per_layer(static_cast<std::size_t>(model.config().num_layers));
  for (const at::Tensor& tokens : windows) {
    NormedInputs hook;
    KVCache cache = model.make_cache();
    model.forward_hidden(tokens.view({1, -1}), cache, &hook);
    for (std::size_t l = 0; l < per_layer.size(); ++l)
      per_layer[l].push_back(gates_->log_beta(static_cast<std::int64_t>(l), hook.x[l]).flatten());
  }
  std::vector<at::Tensor> log_beta;
  for (const auto& parts : per_layer) log_beta.push_back(at::cat(parts));
  return {{"log_beta", log_beta}};
}

std::map<std::string, std::string> TrimKVMethod::metadata() const {
  std::map<std::string, std::string> m = backbone_metadata(model_);
  m.insert({{"method", "trimkv"},
            {"retention_gate_intermediate_size", std::to_string(gates_->hidden())},
            {"retention_gate_bias_init", std::to_string(settings_.gate.bias_init)},
            {"hidden_act", model_.config().hidden_act},
            {"budget", std::to_string(settings_.budget)},
            {"sinks", std::to_string(settings_.sinks)}});
  return m;
}

namespace methods {
extern const MethodRegistration trimkv;
namespace {

void load_gates(const SafetensorsFile& file, const std::string& path, const Backbone& model, TrainedModules& modules) {
  auto gates = std::make_shared<RetentionGates>(RetentionGates::from_tensors(file.tensors, model.config(), path));
  gates->to(model.device());
  modules.add<RetentionGates>(gates);
}

std::unique_ptr<TrainingMethod> make(MethodSetup& setup) {
  const Config& c = setup.config;
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
  t.w_future = c.get_float("trimkv.w_future");
  t.future_stride = c.get_int("trimkv.future_stride");
  if (t.future_stride < 1) fail("config", "trimkv.future_stride", "must be >= 1");
  for (const char* key : {"trimkv.w_kl", "trimkv.w_ntp", "trimkv.lambda_cap", "trimkv.w_future"})
    if (!(c.get_float(key) >= 0)) fail("config", key, "must be >= 0");
  t.loss_block_rows = c.get_int("train.loss_block_rows");
  if (t.loss_block_rows < 1) fail("config", "train.loss_block_rows", "must be >= 1");
  t.sinks = c.get_int("trimkv.sinks");  // the policy's key: training and deployment keep the same sinks
  if (t.sinks < 0) fail("config", "trimkv.sinks", "must be >= 0");
  t.cut_budget = c.get_int("trimkv.cut_budget");
  t.cut_chunk = c.get_int("trimkv.cut_chunk");
  if (t.cut_budget < 0) fail("config", "trimkv.cut_budget", "must be >= 0");
  if (t.cut_chunk < 1) fail("config", "trimkv.cut_chunk", "must be >= 1");
  // The cut student simulates the policy's plain rules only.
  if (t.cut_budget > 0) {
    const auto plain_only = [](const std::string& key, const std::string& plain) {
      fail("config", key, "must stay " + plain + " with trimkv.cut_budget > 0 (the cut student simulates the plain policy)");
    };
    if (c.get_string("trimkv.cut") != "exceeds") plain_only("trimkv.cut", "exceeds");
    if (c.get_int("trimkv.score_offset") != 0) plain_only("trimkv.score_offset", "0");
    if (c.get_int("trimkv.lookahead") != 1) plain_only("trimkv.lookahead", "1");
    if (c.get_int("trimkv.sliding_window") != 0) plain_only("trimkv.sliding_window", "0");
    if (c.get_float("trimkv.attention_weight") != 0) plain_only("trimkv.attention_weight", "0");
    if (c.get_bool("trimkv.gated_read")) plain_only("trimkv.gated_read", "false");
  }
  t.policy_config = c;
  // Optional: continue from earlier gates (a run folder or an export), e.g. to fine-tune under another loss.
  if (c.get_string("train.init_from").empty()) return std::make_unique<TrimKVMethod>(setup.model, t, setup.seed);
  load_init_from(setup, trimkv);
  return std::make_unique<TrimKVMethod>(setup.model, t, setup.seed, setup.init_modules.find<RetentionGates>().get());
}

}  // namespace

extern const MethodRegistration trimkv{
    "trimkv",
    "TRIM-KV retention gates (distillation + capacity loss); evaluated by the trimkv policy",
    nullptr,
    {"trimkv.gates"},
    [](ConfigSchema& s) {
      s.add("trimkv.budget", ConfigType::Int, "32", "M_train of the capacity loss (tighter than the deployment M)")
          .add("trimkv.gate_hidden", ConfigType::Int, "128", "gate MLP width h (128 tiny models, 512 billion-scale)")
          .add("trimkv.bias_init", ConfigType::Float, "8.0", "gate bias at init (8: released Qwen3 gates; 18: paper)")
          .add("trimkv.capacity", ConfigType::String, "per_head", "capacity loss: per_head | global")
          .add("trimkv.w_kl", ConfigType::Float, "0.5", "weight of KL(teacher || student)")
          .add("trimkv.w_ntp", ConfigType::Float, "0.5", "weight of next-token cross-entropy")
          .add("trimkv.lambda_cap", ConfigType::Float, "1.0", "weight of the capacity loss")
          .add("trimkv.w_future", ConfigType::Float, "0.0",
               "weight of the hindsight ranking loss (retention vs the full model's later attention)")
          .add("trimkv.future_stride", ConfigType::Int, "64", "cut points of that loss: every stride-th position")
          .add("trimkv.cut_budget", ConfigType::Int, "0",
               "M of the cut student: the forward the trimkv policy's cut at M gives, the gradient the gated attention's "
               "(0: the soft student)")
          .add("trimkv.cut_chunk", ConfigType::Int, "64", "the cut student's chunk: cut after every C positions, as eval.chunk_size");
    },
    [](ConfigSchema& s) {
      s.add("trimkv.gates", ConfigType::String, "\"\"", "trimkv: gates file from `kvbound export` (required by policy trimkv)");
    },
    [](const Config&) { return std::string("trimkv"); },
    make,
    load_gates,
    [](const Config& c, const Backbone& model, TrainedModules& modules, std::map<std::string, std::string>& meta) {
      load_weights_key(c, "trimkv.gates", model, modules, meta, load_gates);
    },
    {{"trimkv", "a folder the official TRIM-KV release loads (trimkv_weights.pth + config.json)",
      write_trimkv_official_folder}}};

}  // namespace methods
}  // namespace kvbound
