"""TRIM-KV loss golden: a tiny random Llama (GQA 8/2), random retention gates in the official layout, a padded
batch, and the loss terms + gate gradients of DESIGN.md's formulas computed here in float64 with plain PyTorch
(teacher = transformers' own forward; student = the same layers with gated attention written out). The C++
trainer's TrimKVMethod must reproduce them (tests/test_trimkv.cpp)."""
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from golden_io import tiny_random_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

H_GATE, BUDGET, W_KL, W_NTP, LAMBDA_CAP = 16, 8, 0.5, 0.5, 1.0


def gated_student_hidden(model, ids, gates):
    m = model.model
    B, T = ids.shape
    cfg = model.config
    D = cfg.head_dim
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, pos)
    log_betas = []
    t_idx = torch.arange(T, dtype=h.dtype)
    age = (t_idx[:, None] - t_idx[None, :])  # [t, i]
    causal = age >= 0
    for li, layer in enumerate(m.layers):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, -1, D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, -1, D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        p = f"model.layers.{li}.self_attn.retention_gate."
        z = F.linear(F.silu(F.linear(x, gates[p + "linear1.weight"], gates[p + "linear1.bias"])), gates[p + "linear2.weight"])
        lb = F.logsigmoid(z + gates[p + "bias"]).transpose(1, 2)  # [B, Hkv, T]
        log_betas.append(lb)
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
        lbq = lb.repeat_interleave(group, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D) + age * lbq[:, :, None, :]
        scores = scores.masked_fill(~causal, float("-inf"))
        o = torch.softmax(scores, -1) @ v
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h), log_betas


def capacity(log_betas, w):
    lb = torch.stack(log_betas, 1)  # [B, L, Hkv, T]
    T = lb.shape[-1]
    t = torch.arange(T, dtype=lb.dtype)
    age = t[:, None] - t[None, :]
    terms = torch.where(age >= 0, torch.exp(age.clamp(min=0) * lb[..., None, :]), torch.zeros((), dtype=lb.dtype))
    S = terms.sum(-1)  # [B, L, Hkv, T]
    norm = torch.clamp(t + 1 - BUDGET, min=1)
    excess = torch.relu(S - BUDGET) / norm
    return (excess.sum((1, 2)) * w).sum() / (w.sum() * lb.shape[1] * lb.shape[2])


def main(out_dir):
    torch.manual_seed(2024)
    model = tiny_random_llama(out_dir, head_dim=4)
    config = model.config

    gates = {}
    for li in range(config.num_hidden_layers):
        p = f"model.layers.{li}.self_attn.retention_gate."
        gates[p + "linear1.weight"] = torch.randn(H_GATE, config.hidden_size) * 0.3
        gates[p + "linear1.bias"] = torch.randn(H_GATE) * 0.1
        gates[p + "linear2.weight"] = torch.randn(config.num_key_value_heads, H_GATE) * 0.3
        gates[p + "bias"] = torch.tensor([1.5, 3.0])
    save_file({k: v.float().contiguous() for k, v in gates.items()}, f"{out_dir}/gates.safetensors")
    g64 = {k: v.float().double().requires_grad_(True) for k, v in gates.items()}

    B, T = 2, 40
    ids = torch.randint(3, config.vocab_size, (B, T))
    ids[:, 0] = 1
    targets = torch.roll(ids, -1, 1)
    weights = torch.ones(B, T, dtype=torch.float64)
    targets[0, -1] = -1  # row 0: its document ends with the row, so the last position has no target
    weights[0, -1] = 0
    ids[1, 30:] = 1      # row 1: 30 real tokens, then padding (BOS ids, no targets, weight 0)
    targets[1, 29:] = -1
    weights[1, 29:] = 0

    with torch.no_grad():
        teacher = model.model(ids).last_hidden_state
    student, log_betas = gated_student_hidden(model, ids, g64)
    head = model.lm_head.weight
    lt = F.log_softmax(teacher @ head.T, -1)
    ls = F.log_softmax(student @ head.T, -1)
    kl_rows = (lt.exp() * (lt - ls)).sum(-1)
    ce_rows = -ls.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    kl = (kl_rows * weights).sum() / weights.sum()
    ce = (ce_rows * weights).sum() / weights.sum()
    cap = capacity(log_betas, weights)
    total = W_KL * kl + W_NTP * ce + LAMBDA_CAP * cap
    total.backward()

    out = {"inputs": ids.float(), "targets": targets.float(), "weights": weights.float(),
           "kl": kl.detach().reshape(1).float(), "ce": ce.detach().reshape(1).float(),
           "cap": cap.detach().reshape(1).float(), "total": total.detach().reshape(1).float()}
    for k, v in g64.items():
        out["grad." + k] = v.grad.float()
    save_file(out, f"{out_dir}/golden.safetensors",
              metadata={"kl": repr(kl.item()), "ce": repr(ce.item()), "cap": repr(cap.item()), "total": repr(total.item()),
                        "budget": str(BUDGET), "gate_hidden": str(H_GATE)})


if __name__ == "__main__":
    main(sys.argv[1])
