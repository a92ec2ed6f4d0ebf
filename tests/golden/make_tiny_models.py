"""Tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints (tied and untied, GQA, Llama-3 RoPE scaling,
sharded and bf16 files) written by transformers with a fixed seed, plus transformers' fp32 logits on a
batch of prompts longer than one attention block. The C++ backbone must reproduce these logits."""
import sys

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from golden_io import write_tensor

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2)

MODELS = {
    "llama_tied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "llama3_untied": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "mistral_untied": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3_untied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, use_sliding_window=False)),
}


def main(out_dir):
    torch.manual_seed(1234)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 150))
    for name, (config_cls, model_cls, extra) in MODELS.items():
        config = config_cls(**COMMON, **extra)
        model = model_cls(config).eval()
        with torch.no_grad():
            for p in model.parameters():  # the default init is too small to give distinctive logits
                p.normal_(0.0, 0.15)
        folder = f"{out_dir}/{name}"
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            logits = model(ids).logits
        write_tensor(folder, "logits", logits.numpy(), input_ids=ids.tolist())
    # Sharded: the same untied Llama-3 weights split over several files with an index.
    model = LlamaForCausalLM.from_pretrained(f"{out_dir}/llama3_untied")
    model.save_pretrained(f"{out_dir}/llama3_sharded", max_shard_size="40KB")
    with torch.no_grad():
        write_tensor(f"{out_dir}/llama3_sharded", "logits", model(ids).logits.numpy(), input_ids=ids.tolist())
    # bf16 on disk, fp32 compute: the reference is the bf16-rounded weights computed in fp32.
    model = Qwen3ForCausalLM.from_pretrained(f"{out_dir}/qwen3_untied").to(torch.bfloat16)
    model.save_pretrained(f"{out_dir}/qwen3_bf16")
    model = model.float()
    with torch.no_grad():
        write_tensor(f"{out_dir}/qwen3_bf16", "logits", model(ids).logits.numpy(), input_ids=ids.tolist())


if __name__ == "__main__":
    main(sys.argv[1])
