// The tiny random Llama of the golden fixture (tests/golden/make_tiny_models.py) and its first 60 prompt
// tokens, loaded once per test binary: the engine, policy and memory tests run on it.
#pragma once
#include <memory>
#include <string>

#include "golden_reader.h"
#include "modules/backbone.h"
#include "modules/indexer.h"
#include "modules/latent_memory.h"
#include "modules/retention_gate.h"
#include "modules/trained_modules.h"
#include "test_env.h"

namespace kvbound::test {

struct TinyModel {
  std::unique_ptr<Backbone> model;
  at::Tensor tokens;  // [1, 60]
};

inline const TinyModel& tiny_model() {
  static const TinyModel f = [] {
    TinyModel x;
    const std::string dir = test_data("tiny/llama_tied");
    x.model = Backbone::load(dir, at::kFloat);
    x.tokens = read_golden(dir, "logits").input_ids.narrow(0, 0, 1).narrow(1, 0, 60);
    return x;
  }();
  return f;
}

// Random learned modules for the tiny model's learned policies: trimkv gates with spread-out retention
// (bias 2, std 0.5, so the scores differ per token), an indexer, and `memory` (when given) for every +mem.
inline TrainedModules tiny_learned_modules(std::shared_ptr<const LatentMemory> memory = nullptr) {
  const ModelConfig& c = tiny_model().model->config();
  TrainedModules m;
  m.add<RetentionGates>(std::make_shared<const RetentionGates>(RetentionGates::init(c, {16, 2.0, 0.5}, 9)));
  m.add<Indexer>(std::make_shared<const Indexer>(Indexer::init(c, {8, "kv", true, false, 0.5}, 9)));
  if (memory) m.add<LatentMemory>(std::move(memory));
  return m;
}

}  // namespace kvbound::test
