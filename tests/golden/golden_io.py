"""Helpers of the golden scripts: NAME.f32 (raw little-endian float32) + NAME.json (shape, ids) for the C++
tests, and the tiny random Llama (GQA 8/2) the loss goldens run on."""
import json
import os

import numpy as np


def write_tensor(out_dir, name, array, **extra):
    os.makedirs(out_dir, exist_ok=True)
    array = np.ascontiguousarray(array, dtype="<f4")
    tmp = os.path.join(out_dir, name + ".f32.part")
    array.tofile(tmp)
    os.replace(tmp, os.path.join(out_dir, name + ".f32"))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"shape": list(array.shape), **extra}, f)


def tiny_random_llama(out_dir, **config):
    """A 2-layer Llama (hidden 32, 8 query / 2 KV heads, weights ~ N(0, 0.2) from torch's current seed) saved
    to out_dir in the HF layout the C++ loads, returned in float64 with gradients off. `config` overrides
    LlamaConfig fields (head_dim, rope_theta, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=4, max_position_embeddings=256, rms_norm_eps=1e-5,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True, hidden_act="silu")
    settings.update(config)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    model = model.double()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
