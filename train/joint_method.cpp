#include "train/joint_method.h"

#include "base/errors.h"
#include "modules/indexer.h"
#include "train/method_registry.h"

namespace kvbound {

JointMethod::JointMethod(std::unique_ptr<IndexMemIndexerMethod> indexer, std::unique_ptr<MemoryMethod> memory,
                         double lambda_mse, double indexer_lr_scale)
    : indexer_(std::move(indexer)), memory_(std::move(memory)), lambda_mse_(lambda_mse), indexer_lr_scale_(indexer_lr_scale) {
  if (!(lambda_mse >= 0)) fail("config", "joint.lambda_mse", "must be >= 0");
  if (!(indexer_lr_scale > 0)) fail("config", "joint.indexer_lr", "must be > 0");
}

double JointMethod::lr_scale(const std::string& name) const {
  return indexer_->named_parameters().count(name) ? indexer_lr_scale_ : 1.0;
}

std::map<std::string, at::Tensor> JointMethod::named_parameters() const {
  std::map<std::string, at::Tensor> all = indexer_->named_parameters();
  for (auto& [name, t] : memory_->named_parameters()) all.emplace(name, t);
  return all;
}

StepLoss JointMethod::loss(const Batch& batch) {
  StepLoss kl = indexer_->loss(batch);
  StepLoss mse = memory_->loss(batch);
  StepLoss out;
  out.total = kl.total + mse.total * lambda_mse_;
  out.terms = std::move(kl.terms);
  for (auto& term : mse.terms) out.terms.push_back(std::move(term));
  out.stats = std::move(kl.stats);
  out.stats.insert(mse.stats.begin(), mse.stats.end());
  out.per_layer = std::move(mse.per_layer);
  return out;
}

std::map<std::string, std::string> JointMethod::metadata() const {
  std::map<std::string, std::string> m = memory_->metadata();
  for (auto& [key, value] : indexer_->metadata()) m.emplace(key, value);  // memory's method/stage win...
  m["method"] = "joint";  // ...then name both
  m["stage"] = "joint";
  m["lambda_mse"] = std::to_string(lambda_mse_);
  m["indexer_lr_scale"] = std::to_string(indexer_lr_scale_);
  return m;
}

namespace methods {
namespace {

std::unique_ptr<TrainingMethod> make(MethodSetup& setup) {
  const Config& c = setup.config;
  load_init_from(setup, find_method("indexmem"));
  // The stage-1 indexer (its own settings; the KL target from this config's indexmem.*) becomes the trainable
  // one. The copy shares the loaded tensors, which nothing else holds: making them leaves is enough.
  auto indexer = std::make_shared<Indexer>(*setup.init_modules.find<Indexer>());
  for (at::Tensor& p : indexer->parameters()) p.set_requires_grad(true);
  auto kl = std::make_unique<IndexMemIndexerMethod>(setup.model, indexmem_settings(c, indexer->settings()), indexer);
  // The memory replays the indexmem policy with the live indexer, so it learns what the indexer evicts now.
  MemorySettings m = memory_settings(setup);
  if (m.loss != MemoryLoss::Mse)  // its objective is L_KL (the indexer's) + lambda * L_MSE (the memory's)
    fail("config", "memory.loss", "train.method joint trains the memory with mse; kl is train.method memory's");
  m.policy = "indexmem";
  m.base_modules = TrainedModules();
  m.base_modules.add<Indexer>(indexer);
  return std::make_unique<JointMethod>(std::move(kl), std::make_unique<MemoryMethod>(setup.model, m, setup.seed),
                                       c.get_float("joint.lambda_mse"), c.get_float("joint.indexer_lr") / c.get_float("train.lr"));
}

// A joint export holds an indexer and a memory: it serves as indexmem.weights and as memory.weights.
void load_both(const SafetensorsFile& file, const std::string& path, const Backbone& model, TrainedModules& modules) {
  find_method("indexmem").load(file, path, model, modules);
  find_method("memory").load(file, path, model, modules);
}

}  // namespace

extern const MethodRegistration joint{
    "joint",
    "IndexMem stage 2, joint: the stage-1 indexer (train.init_from) and the latent memory, L_KL + lambda * L_MSE; "
    "evaluated by indexmem+mem",
    "indexmem",
    {"indexmem.weights", "memory.weights"},
    [](ConfigSchema& s) {
      s.add("joint.lambda_mse", ConfigType::Float, "1.0", "weight of L_MSE in L_KL + lambda_mse * L_MSE")
          .add("joint.indexer_lr", ConfigType::Float, "2e-3", "the indexer's peak learning rate (train.lr: the memory's)");
    },
    [](ConfigSchema&) {},  // its export is read through indexmem.weights and memory.weights
    [](const Config&) { return std::string("indexmem+mem"); },
    make,
    load_both,
    [](const Config&, const Backbone&, TrainedModules&, std::map<std::string, std::string>&) {},
    {}};

}  // namespace methods
}  // namespace kvbound
