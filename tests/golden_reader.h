// Reads what tests/golden/golden_io.py writes: NAME.f32 (raw float32) + NAME.json (shape, input_ids, ...),
// and the training batch the loss goldens (make_trimkv_golden.py, make_indexmem_golden.py) store.
#pragma once
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "checkpoints/safetensors_io.h"
#include "data/training_rows.h"

namespace kvbound::test {

// The batch of a loss golden: "inputs", "targets", "weights" tensors of its golden.safetensors.
inline Batch golden_batch(const SafetensorsFile& g) {
  Batch b;
  b.inputs = g.tensors.at("inputs").to(at::kLong);
  b.targets = g.tensors.at("targets").to(at::kLong);
  b.weights = g.tensors.at("weights");
  b.tokens = static_cast<std::int64_t>(b.weights.sum().item<double>());
  return b;
}

struct Golden {
  nlohmann::json meta;
  at::Tensor values;     // float32, meta["shape"]
  at::Tensor input_ids;  // int64 from meta["input_ids"], when present
};

inline Golden read_golden(const std::string& dir, const std::string& name) {
  Golden g;
  std::ifstream meta(dir + "/" + name + ".json");
  if (!meta) throw std::runtime_error("missing golden " + dir + "/" + name + ".json");
  g.meta = nlohmann::json::parse(meta);
  const auto shape = g.meta["shape"].get<std::vector<std::int64_t>>();
  g.values = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  std::ifstream raw(dir + "/" + name + ".f32", std::ios::binary);
  raw.read(reinterpret_cast<char*>(g.values.data_ptr<float>()), static_cast<std::streamsize>(g.values.nbytes()));
  if (raw.gcount() != static_cast<std::streamsize>(g.values.nbytes()))
    throw std::runtime_error("short golden " + dir + "/" + name + ".f32");
  if (g.meta.contains("input_ids")) {
    const auto& ids = g.meta["input_ids"];
    if (ids.size() > 0 && ids[0].is_array()) {
      std::vector<std::int64_t> flat;
      for (const auto& row : ids)
        for (const auto& v : row) flat.push_back(v.get<std::int64_t>());
      g.input_ids = at::tensor(flat, at::kLong).view({static_cast<std::int64_t>(ids.size()), -1});
    } else {
      g.input_ids = at::tensor(ids.get<std::vector<std::int64_t>>(), at::kLong).unsqueeze(0);
    }
  }
  return g;
}

}  // namespace kvbound::test
