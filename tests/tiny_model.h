// The tiny random Llama of the golden fixture (tests/golden/make_tiny_models.py) and its first 60 prompt
// tokens, loaded once per test binary: the engine, policy and memory tests run on it.
#pragma once
#include <memory>
#include <string>

#include "golden_reader.h"
#include "modules/backbone.h"
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

}  // namespace kvbound::test
