// Architecture hyper-parameters of a Llama-family decoder, in Hugging Face's vocabulary.
// Filled from an HF config.json or from GGUF metadata; validated by validate().
#pragma once
#include <cstdint>
#include <string>

namespace kvbound {

struct RopeScaling {
  // "default" (plain RoPE) or "llama3" (Llama-3.1 frequency-dependent scaling).
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string architecture;  // "llama", "mistral", "qwen2", "qwen3" (model_type in config.json)
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2)
  bool qk_norm = false;         // per-head RMSNorm on q and k before RoPE (Qwen3)
  std::string hidden_act = "silu";
  std::int64_t bos_token_id = -1;
  std::int64_t eos_token_id = -1;

  // Throws kvbound::Error("source: field: ...") when a value is missing or inconsistent.
  void validate(const std::string& source) const;
  // The Hugging Face config.json a transformers model of this architecture is built from (model_type,
  // architectures, sizes, RoPE, activation, tying, special tokens), as a JSON object's text.
  std::string to_hf_json() const;
};

}  // namespace kvbound
