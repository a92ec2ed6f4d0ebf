// The full-cache model's attention over a whole sequence: the hindsight an oracle policy ranks the cache by
// (modules/policies/oracle.cpp). An analysis reference, not a deployable input: it holds the attention of queries
// that have not been computed when the cache is cut.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "modules/backbone.h"

namespace kvbound {

struct Hindsight {
  // Per layer [B, Hkv, T, T] float32 on the model's device: row s is query s's attention over positions 0..s
  // (0 after s), averaged over the query heads of each KV group. L·Hkv·T² floats: 62 MB for SmolLM2 at T = 416.
  std::vector<at::Tensor> attention;
  std::int64_t first_scored_row = 0;  // the rows from here on are the ones the task scores
};

// One full-cache forward over `tokens` [B, T]. Fails naming `first_scored_row` unless it is in [0, T).
Hindsight hindsight_attention(const Backbone& model, const at::Tensor& tokens, std::int64_t first_scored_row);

}  // namespace kvbound
