"""CPU peer for kvbound's TRIM-KV training update (bench/bench_train_step, same model, shapes and threads):
the formulas of tests/golden/make_trimkv_golden.py (DESIGN.md) written with plain PyTorch the way one would
train on a CPU — transformers' model from the same GGUF as the frozen teacher (forward, no grad), the student
= the same layers with the gated attention softmax(q·kᵀ/√D + (t−i)·log β_i) through SDPA's float mask (GQA
without repeating K/V), KL(teacher‖student) + CE on the full vocabulary, the per-head capacity loss, backward,
gradient clipping and fused AdamW on the gates (width H, bias init 8, as kvbound's defaults). Random tokens from
torch.manual_seed(0), as bench_train_step draws them. DTYPE (float32, bfloat16) is the frozen model's compute
dtype; the gates, the decay and the loss stay float32, as in kvbound. Prints one JSON line.
Usage: trimkv_step_cpu.py GGUF T B [steps=5] [threads=2] [gate_hidden=128] [budget=32] [dtype=float32]"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from update_timing import time_updates

W_KL, W_NTP, LAMBDA_CAP = 0.5, 0.5, 1.0


def make_gates(cfg, hidden):
    gates = []
    for _ in range(cfg.num_hidden_layers):
        l1 = torch.nn.Linear(cfg.hidden_size, hidden)
        l2 = torch.nn.Linear(hidden, cfg.num_key_value_heads, bias=False)
        bias = torch.nn.Parameter(torch.full((cfg.num_key_value_heads,), 8.0))
        gates.append((l1, l2, bias))
    return gates


def student_hidden(model, ids, gates, age):
    m, cfg = model.model, model.config
    B, T = ids.shape
    D = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    pos = torch.arange(T).unsqueeze(0).expand(B, T)
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, pos)
    causal = torch.zeros(T, T).masked_fill(age < 0, float("-inf"))
    log_betas = []
    for layer, (l1, l2, bias) in zip(m.layers, gates):
        a = layer.self_attn
        x = layer.input_layernorm(h)
        q = a.q_proj(x).view(B, T, -1, D).transpose(1, 2)
        k = a.k_proj(x).view(B, T, -1, D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, -1, D).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        lb = F.logsigmoid(l2(F.silu(l1(x.float()))) + bias).transpose(1, 2)  # [B, Hkv, T]
        log_betas.append(lb)
        group = q.shape[1] // k.shape[1]
        mask = ((age.clamp(min=0) * lb[:, :, None, :]).repeat_interleave(group, 1) + causal).to(q.dtype)  # [B, Hq, T, T]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = h + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h), log_betas


def capacity(log_betas, weights, age, budget):
    lb = torch.stack(log_betas, 1)  # [B, L, Hkv, T]
    T = lb.shape[-1]
    terms = torch.where(age >= 0, torch.exp(age.clamp(min=0) * lb[..., None, :]), torch.zeros(()))
    S = terms.sum(-1)
    norm = torch.clamp(torch.arange(T) + 1 - budget, min=1)
    excess = torch.relu(S - budget) / norm
    return (excess.sum((1, 2)) * weights).sum() / (weights.sum() * lb.shape[1] * lb.shape[2])


def main(gguf_path, T, B, steps=5, threads=2, hidden=128, budget=32, dtype="float32"):
    torch.set_num_threads(threads)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    model.requires_grad_(False)
    cfg = model.config
    torch.manual_seed(0)
    gates = make_gates(cfg, hidden)
    params = [p for g in gates for p in (g[0].weight, g[0].bias, g[1].weight, g[2])]
    decay = [g[0].weight for g in gates] + [g[1].weight for g in gates]
    no_decay = [g[0].bias for g in gates] + [g[2] for g in gates]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, fused=True)
    torch.manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (B, T))
    targets = torch.full_like(ids, -1)
    targets[:, : T - 1] = ids[:, 1:]
    weights = (targets >= 0).float()
    t = torch.arange(T)
    age = (t[:, None] - t[None, :]).float()
    head = model.lm_head.weight.float()

    def update():
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            lt = F.log_softmax(model.model(ids).last_hidden_state.float() @ head.T, -1)
        hs, log_betas = student_hidden(model, ids, gates, age)
        ls = F.log_softmax(hs.float() @ head.T, -1)
        kl = ((lt.exp() * (lt - ls)).sum(-1) * weights).sum() / weights.sum()
        ce = (F.cross_entropy(ls.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
              * weights.flatten()).sum() / weights.sum()
        total = W_KL * kl + W_NTP * ce + LAMBDA_CAP * capacity(log_betas, weights, age, budget)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return total.item()

    time_updates(update, "trimkv", T, B, steps, threads, dtype)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:8]), *sys.argv[8:9])
