#include "checkpoints/model_config.h"

#include <map>
#include <nlohmann/json.hpp>

#include "base/errors.h"

namespace kvbound {

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](std::int64_t v, const char* field) {
    if (v <= 0) fail(source, field, "must be positive, got " + std::to_string(v));
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_layers, "num_hidden_layers");
  positive(num_heads, "num_attention_heads");
  positive(num_kv_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  if (num_heads % num_kv_heads != 0)
    fail(source, "num_key_value_heads",
         std::to_string(num_kv_heads) + " does not divide num_attention_heads " + std::to_string(num_heads));
  if (head_dim % 2 != 0) fail(source, "head_dim", "must be even for RoPE, got " + std::to_string(head_dim));
  if (!(rms_norm_eps > 0)) fail(source, "rms_norm_eps", "must be positive");
  if (!(rope_theta > 0)) fail(source, "rope_theta", "must be positive");
  if (hidden_act != "silu" && hidden_act != "gelu" && hidden_act != "gelu_pytorch_tanh" && hidden_act != "relu")
    fail(source, "hidden_act", "unsupported activation '" + hidden_act + "' (silu, gelu, gelu_pytorch_tanh, relu)");
  if (rope_scaling.type != "default" && rope_scaling.type != "llama3")
    fail(source, "rope_scaling.rope_type", "unsupported '" + rope_scaling.type + "' (default, llama3)");
}

std::string ModelConfig::to_hf_json() const {
  static const std::map<std::string, std::string> causal_lm = {
      {"llama", "LlamaForCausalLM"}, {"mistral", "MistralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"},
      {"qwen3", "Qwen3ForCausalLM"}};
  nlohmann::ordered_json j;
  j["architectures"] = {causal_lm.count(architecture) ? causal_lm.at(architecture) : architecture};
  j["model_type"] = architecture;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_layers;
  j["num_attention_heads"] = num_heads;
  j["num_key_value_heads"] = num_kv_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.type == "default") {
    j["rope_scaling"] = nullptr;
  } else {
    j["rope_scaling"] = {{"rope_type", rope_scaling.type},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  }
  j["hidden_act"] = hidden_act;
  j["attention_bias"] = attention_bias;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  return j.dump(2);
}

}  // namespace kvbound
