"""A Llama checkpoint with random weights for speed benchmarks on the GPU machine (no model can travel there):
config.json + model.safetensors in the Hugging Face layout kvbound loads, Llama-3.2-1B's shapes by default
(hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128256, tied embeddings), bf16,
weights N(0, 0.02) and norms 1. Speed only: what such a model says means nothing.
Usage: make_random_llama.py OUT_DIR [--layers N]"""
import argparse
import json
import pathlib

import torch
from safetensors.torch import save_file

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--layers", type=int, default=16)
args = parser.parse_args()
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": args.layers, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
}
d, inter, kv = config["hidden_size"], config["intermediate_size"], config["num_key_value_heads"] * config["head_dim"]
gen = torch.Generator(device="cuda").manual_seed(0)


def rand(*shape):
    return (torch.randn(*shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16).cpu()


tensors = {"model.embed_tokens.weight": rand(config["vocab_size"], d),
           "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)}
for i in range(args.layers):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": rand(d, d), p + "self_attn.k_proj.weight": rand(kv, d),
        p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, d),
        p + "mlp.gate_proj.weight": rand(inter, d), p + "mlp.up_proj.weight": rand(inter, d),
        p + "mlp.down_proj.weight": rand(d, inter),
    })
out = pathlib.Path(args.out_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "config.json").write_text(json.dumps(config, indent=1))
save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
print(json.dumps({"model": str(out), "parameters": sum(t.numel() for t in tensors.values())}))
