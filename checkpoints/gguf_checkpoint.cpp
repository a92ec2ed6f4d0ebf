#include "checkpoints/gguf_checkpoint.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <vector>

#include "base/errors.h"

namespace kvbound {
namespace {

const char* const kArchitectures[] = {"llama", "mistral", "qwen2", "qwen3"};
constexpr double kPi = 3.14159265358979323846;

// Only convert_hf_to_gguf.py's LlamaModel (llama, and mistral which derives from it) permutes q/k
// rows; Qwen2/Qwen3 are written in Hugging Face order.
bool has_permuted_qk(const std::string& architecture) {
  return architecture == "llama" || architecture == "mistral";
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// GGUF lists dims innermost first (ne0 = in_features); torch lists them outermost first.
std::vector<std::int64_t> torch_shape(const GgufTensorInfo& t) { return {t.dims.rbegin(), t.dims.rend()}; }

// Llama-3.1-style RoPE scaling, which GGUF stores only as per-frequency divisors (rope_freqs.weight,
// written by convert_hf_to_gguf.py from factor, low/high_freq_factor and the original context).
// factor is the largest divisor; the other three are not stored, so they are taken at the values
// every Llama 3.x release uses and the divisors must agree with them.
RopeScaling llama3_scaling_from_divisors(const GgufFile& file, const GgufTensorInfo& t, std::int64_t head_dim,
                                         double theta) {
  const std::int64_t n = head_dim / 2;
  if (t.type != GgmlType::F32 || t.dims.size() != 1 || t.dims[0] != n)
    fail(file.path(), t.name,
         "expected F32 " + shape_text({n}) + " (head_dim / 2), got " + ggml_type_name(t.type) + " " +
             shape_text(torch_shape(t)));
  std::vector<float> divisors(static_cast<std::size_t>(n));
  dequantize_row(GgmlType::F32, file.tensor_data(t), n, divisors.data());

  RopeScaling s;
  s.type = "llama3";
  s.factor = *std::max_element(divisors.begin(), divisors.end());
  const double low_wavelen = static_cast<double>(s.original_max_position_embeddings) / s.low_freq_factor;
  const double high_wavelen = static_cast<double>(s.original_max_position_embeddings) / s.high_freq_factor;
  for (std::int64_t i = 0; i < n; ++i) {
    const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    const double wavelen = 2.0 * kPi / inv_freq;
    double expected = 1.0;
    if (wavelen > low_wavelen) {
      expected = s.factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (static_cast<double>(s.original_max_position_embeddings) / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      expected = 1.0 / ((1.0 - smooth) / s.factor + smooth);
    }
    const double got = divisors[static_cast<std::size_t>(i)];
    if (!(std::fabs(got - expected) <= 1e-3 * expected))
      fail(file.path(), t.name,
           "divisor " + std::to_string(i) + " is " + std::to_string(got) + ", but Llama-3 RoPE scaling with factor " +
               std::to_string(s.factor) + " (low_freq_factor 1, high_freq_factor 4, original context 8192) gives " +
               std::to_string(expected));
  }
  return s;
}

// One backbone tensor: its GGUF name, its Hugging Face name, its torch shape, and for q/k the
// number of heads whose rows llama.cpp interleaved (0: stored as is).
struct ExpectedTensor {
  std::string gguf_name;
  std::string hf_name;
  std::vector<std::int64_t> shape;
  std::int64_t permuted_heads = 0;
};

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c) {
  const std::int64_t q_out = c.num_heads * c.head_dim;
  const std::int64_t kv_out = c.num_kv_heads * c.head_dim;
  const bool permuted = has_permuted_qk(c.architecture);
  std::vector<ExpectedTensor> out = {
      {"token_embd.weight", "model.embed_tokens.weight", {c.vocab_size, c.hidden_size}},
      {"output_norm.weight", "model.norm.weight", {c.hidden_size}},
  };
  if (!c.tie_word_embeddings) out.push_back({"output.weight", "lm_head.weight", {c.vocab_size, c.hidden_size}});
  for (std::int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string g = "blk." + std::to_string(layer) + ".";
    const std::string h = "model.layers." + std::to_string(layer) + ".";
    auto add = [&](const std::string& gguf, const std::string& hf, std::vector<std::int64_t> shape,
                   std::int64_t permuted_heads = 0) {
      out.push_back({g + gguf, h + hf, std::move(shape), permuted ? permuted_heads : 0});
    };
    add("attn_norm.weight", "input_layernorm.weight", {c.hidden_size});
    add("attn_q.weight", "self_attn.q_proj.weight", {q_out, c.hidden_size}, c.num_heads);
    add("attn_k.weight", "self_attn.k_proj.weight", {kv_out, c.hidden_size}, c.num_kv_heads);
    add("attn_v.weight", "self_attn.v_proj.weight", {kv_out, c.hidden_size});
    add("attn_output.weight", "self_attn.o_proj.weight", {c.hidden_size, q_out});
    if (c.attention_bias) {
      add("attn_q.bias", "self_attn.q_proj.bias", {q_out}, c.num_heads);
      add("attn_k.bias", "self_attn.k_proj.bias", {kv_out}, c.num_kv_heads);
      add("attn_v.bias", "self_attn.v_proj.bias", {kv_out});
    }
    if (c.qk_norm) {
      add("attn_q_norm.weight", "self_attn.q_norm.weight", {c.head_dim});
      add("attn_k_norm.weight", "self_attn.k_norm.weight", {c.head_dim});
    }
    add("ffn_norm.weight", "post_attention_layernorm.weight", {c.hidden_size});
    add("ffn_gate.weight", "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size});
    add("ffn_up.weight", "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size});
    add("ffn_down.weight", "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size});
  }
  return out;
}

std::optional<at::ScalarType> stored_scalar_type(GgmlType type) {
  switch (type) {
    case GgmlType::F32: return at::kFloat;
    case GgmlType::F16: return at::kHalf;
    case GgmlType::BF16: return at::kBFloat16;
    default: return std::nullopt;
  }
}

// The tensor in `dtype`: a view of the mapping when it is stored in that dtype, else decoded to
// float32 (rows in parallel) and cast.
at::Tensor decode(const GgufFile& file, const GgufTensorInfo& t, at::ScalarType dtype) {
  const std::vector<std::int64_t> shape = torch_shape(t);
  const std::uint8_t* src = file.tensor_data(t);
  if (stored_scalar_type(t.type) == dtype && reinterpret_cast<std::uintptr_t>(src) % at::elementSize(dtype) == 0) {
    // The mapping is read-only and outlives every tensor that views it.
    return at::from_blob(const_cast<std::uint8_t*>(src), shape, [mapping = file.mapping()](void*) {},
                         at::TensorOptions().dtype(dtype));
  }
  at::Tensor out = at::empty(shape, at::kFloat);
  const std::int64_t row = t.dims[0];
  const std::int64_t rows = t.n_elements / row;
  const std::int64_t row_bytes = ggml_row_bytes(t.type, row);
  float* dst = out.data_ptr<float>();
  const std::int64_t rows_per_task = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / row);
  at::parallel_for(0, rows, rows_per_task, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) dequantize_row(t.type, src + r * row_bytes, row, dst + r * row);
  });
  // The quantized bytes are not needed again: keep peak memory at the decoded weights, not both.
  if (file.mapping()) file.mapping()->release(src, static_cast<std::size_t>(t.n_bytes));
  return dtype == at::kFloat ? out : out.to(dtype);
}

// convert_hf_to_gguf.py stores each head's q/k rows as interleaved pairs for ggml's RoPE:
// GGUF row (head, 2i + j) holds HF row (head, j * head_dim/2 + i). Regroup them into HF's halves.
at::Tensor undo_qk_permutation(const at::Tensor& w, std::int64_t n_heads) {
  std::vector<std::int64_t> split = {n_heads, w.size(0) / n_heads / 2, 2};
  split.insert(split.end(), w.sizes().begin() + 1, w.sizes().end());
  return w.reshape(split).transpose(1, 2).reshape(w.sizes());
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& file) {
  const std::string& path = file.path();
  ModelConfig c;
  c.architecture = file.get_string("general.architecture");
  if (std::find(std::begin(kArchitectures), std::end(kArchitectures), c.architecture) == std::end(kArchitectures))
    fail(path, "general.architecture", "unsupported '" + c.architecture + "' (supported: llama, mistral, qwen2, qwen3)");
  const std::string p = c.architecture + ".";
  auto count = [&](const std::string& key) { return static_cast<std::int64_t>(file.get_u32(p + key)); };

  c.hidden_size = count("embedding_length");
  c.intermediate_size = count("feed_forward_length");
  c.num_layers = count("block_count");
  c.num_heads = count("attention.head_count");
  c.num_kv_heads = file.get_u32(p + "attention.head_count_kv", static_cast<std::uint32_t>(c.num_heads));
  c.max_position_embeddings = count("context_length");
  if (auto vocab = file.find_u32(p + "vocab_size")) c.vocab_size = *vocab;
  else if (file.has("tokenizer.ggml.tokens")) c.vocab_size = static_cast<std::int64_t>(file.array_size("tokenizer.ggml.tokens"));
  else fail(path, p + "vocab_size", "missing, and there is no tokenizer.ggml.tokens to count");

  const std::optional<std::uint32_t> rope_dims = file.find_u32(p + "rope.dimension_count");
  if (auto key_length = file.find_u32(p + "attention.key_length")) c.head_dim = *key_length;
  else if (rope_dims) c.head_dim = *rope_dims;
  else if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  if (rope_dims && *rope_dims != c.head_dim)
    fail(path, p + "rope.dimension_count",
         "partial RoPE (" + std::to_string(*rope_dims) + " of head_dim " + std::to_string(c.head_dim) + ") is not supported");
  if (auto value_length = file.find_u32(p + "attention.value_length"); value_length && *value_length != c.head_dim)
    fail(path, p + "attention.value_length",
         std::to_string(*value_length) + " differs from the key length " + std::to_string(c.head_dim) + ", not supported");

  c.rms_norm_eps = file.get_f32(p + "attention.layer_norm_rms_epsilon");
  c.rope_theta = file.get_f32(p + "rope.freq_base", 10000.0f);
  if (auto scaling = file.find_string(p + "rope.scaling.type"); scaling && *scaling != "none")
    fail(path, p + "rope.scaling.type", "'" + *scaling + "' RoPE scaling is not supported");

  c.tie_word_embeddings = file.find_tensor("output.weight") == nullptr;
  c.attention_bias = c.architecture == "qwen2" || file.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = c.architecture == "qwen3";
  if (auto bos = file.find_u32("tokenizer.ggml.bos_token_id")) c.bos_token_id = *bos;
  if (auto eos = file.find_u32("tokenizer.ggml.eos_token_id")) c.eos_token_id = *eos;
  c.validate(path);
  if (const GgufTensorInfo* divisors = file.find_tensor("rope_freqs.weight"))
    c.rope_scaling = llama3_scaling_from_divisors(file, *divisors, c.head_dim, c.rope_theta);
  return c;
}

LoadedCheckpoint load_gguf_checkpoint(const std::string& path, at::ScalarType dtype) {
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16)
    fail(path, "", std::string("cannot load weights as ") + c10::toString(dtype) + " (float32, float16, bfloat16)");
  const GgufFile file = GgufFile::open(path);
  LoadedCheckpoint checkpoint;
  checkpoint.config = gguf_model_config(file);
  checkpoint.source = path;
  checkpoint.format = "gguf";
  checkpoint.name = file.get_string("general.name", std::filesystem::path(path).stem().string());
  checkpoint.weight_files = {path};

  // Check names, shapes and types of everything before decoding anything.
  const std::vector<ExpectedTensor> expected = expected_tensors(checkpoint.config);
  std::set<std::string> known = {"rope_freqs.weight"};  // consumed by gguf_model_config
  std::vector<const GgufTensorInfo*> infos;
  infos.reserve(expected.size());
  for (const ExpectedTensor& e : expected) {
    const GgufTensorInfo* t = file.find_tensor(e.gguf_name);
    if (t == nullptr) fail(path, e.gguf_name, "missing");
    if (torch_shape(*t) != e.shape)
      fail(path, e.gguf_name, "shape " + shape_text(torch_shape(*t)) + " expected " + shape_text(e.shape));
    if (!find_ggml_type(static_cast<std::uint32_t>(t->type))->dequantizable)
      fail(path, e.gguf_name,
           "tensor type " + ggml_type_name(t->type) + " is not supported (supported: " + dequantizable_ggml_types() + ")");
    known.insert(e.gguf_name);
    infos.push_back(t);
  }
  for (const GgufTensorInfo& t : file.tensors())
    if (known.count(t.name) == 0)
      fail(path, t.name, "unexpected tensor: not part of a " + checkpoint.config.architecture + " decoder as this loader reads it");

  for (std::size_t i = 0; i < expected.size(); ++i) {
    at::Tensor tensor = decode(file, *infos[i], dtype);
    if (expected[i].permuted_heads > 0) tensor = undo_qk_permutation(tensor, expected[i].permuted_heads);
    checkpoint.tensors.emplace(expected[i].hf_name, std::move(tensor));
    ++checkpoint.stored_types[ggml_type_name(infos[i]->type)];
  }
  return checkpoint;
}

}  // namespace kvbound
