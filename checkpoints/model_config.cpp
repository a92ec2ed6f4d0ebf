#include "checkpoints/model_config.h"

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

}  // namespace kvbound
