"""PyTorch peer for kvbound's IndexMem stage-1 update (bench/bench_train_step METHOD indexmem, same model, shapes,
device and threads): the formulas of tests/golden/make_indexmem_golden.py (DESIGN.md, defaults d_I 32, one key per KV head,
RoPE on, mean pooling over the row's last `window` queries, min_gap 0) written with plain PyTorch — transformers'
model from the same checkpoint as the frozen teacher (forward, no grad; forward hooks keep
each layer's normalised input and pre-RoPE q/k), the teacher importance from the window's attention rows only
(window × L logits, never L × L), the indexer's pooled scores, KL(p_T ‖ p_S) per (row, KV head) averaged over
layers, backward, gradient clipping and fused AdamW on the indexers. Random tokens from torch.manual_seed(0), as
bench_train_step draws them; every position but the last has a target, so each row has L = T − 1 real tokens.
DTYPE (float32, bfloat16) is the frozen model's compute dtype; the indexer and the loss stay float32, as in kvbound.
MODEL is a GGUF file (the CPU comparison, scripts/bench_train_step.sh) or a Hugging Face folder (the GPU check's
random Llama-3.2-1B shapes, scripts/gpu_check.sh). Each update ends with its loss read on the host, as
bench_train_step's does, so the host clock times the device's work too. Prints one JSON line.
Usage: indexmem_step.py MODEL T B [steps=5] [threads=2] [d_index=32] [window=32] [dtype=float32] [device=cpu]"""
import math
import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from update_timing import time_updates


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    emb = (positions.float()[:, None] * inv_freq[None, :]).repeat(1, 2)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def rms_unweighted(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def main(model_path, T, B, steps=5, threads=2, d_index=32, window=32, dtype="float32", device="cpu"):
    torch.set_num_threads(threads)
    if os.path.isdir(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    else:
        folder, name = os.path.split(os.path.abspath(model_path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    model.requires_grad_(False)
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    Hq, Hkv, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    G = Hq // Hkv
    # transformers 5 keeps rope settings in rope_parameters, 4.x (the GPU check's peer site) in rope_theta
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    torch.manual_seed(0)  # drawn on the CPU, then moved: the same initial indexers on every device
    indexers = []
    for _ in range(cfg.num_hidden_layers):
        wq = torch.nn.Parameter((torch.randn(d_index, D) * 0.02).to(device))
        wk = torch.nn.Parameter((torch.randn(Hkv * d_index, hidden) * 0.02).to(device))
        ww = torch.nn.Parameter((torch.randn(Hq, hidden) * 0.02).to(device))
        bw = torch.nn.Parameter(torch.zeros(Hq, device=device))
        indexers.append((wq, wk, ww, bw))
    params = [p for ix in indexers for p in ix]
    opt = torch.optim.AdamW([{"params": [p for ix in indexers for p in ix[:3]], "weight_decay": 0.01},
                             {"params": [ix[3] for ix in indexers], "weight_decay": 0.0}], lr=1e-4, fused=True)
    captured = []  # per layer, in call order: x, q_pre, k_pre
    for layer in model.model.layers:
        for module in (layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj):
            module.register_forward_hook(lambda _m, _i, out: captured.append(out.float()))
    torch.manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (B, T)).to(device)
    L = T - 1  # real tokens per row (the last position has no target)
    pos = torch.arange(L, device=device)
    start = (pos).clamp(min=L - window)  # Ω(t) = [max(t, L − window), L): the window's queries at or after t
    s_idx = torch.arange(L - window, L, device=device)
    in_omega = s_idx[:, None] >= start[None, :]  # [window, L]
    count = in_omega.sum(0).clamp(min=1).float()

    def update():
        opt.zero_grad(set_to_none=True)
        captured.clear()
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(torch.empty(0, device=device), pos.unsqueeze(0))
            model.model(ids[:, :L])
        total = 0.0
        for li, (wq, wk, ww, bw) in enumerate(indexers):
            x, q_pre, k_pre = captured[3 * li: 3 * li + 3]
            q_pre = q_pre.view(B, L, Hq, D).transpose(1, 2)
            k_pre = k_pre.view(B, L, Hkv, D).transpose(1, 2)
            with torch.no_grad():  # teacher: mean over the group's heads of the window-pooled attention
                q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
                logits = q[:, :, L - window:] @ k.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(D)
                causal = s_idx[:, None] >= pos[None, :]
                probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [B, Hq, window, L]
                a = (probs.masked_fill(~in_omega, 0).sum(-2) / count).view(B, Hkv, G, L).mean(2)
                p_t = a / a.sum(-1, keepdim=True)
            qI = rope(rms_unweighted(q_pre[:, :, L - window:] @ wq.T), s_idx, theta)  # [B, Hq, window, dI]
            kI = rope(rms_unweighted((x @ wk.T).view(B, L, Hkv, d_index).transpose(1, 2)), pos, theta)
            w = torch.sigmoid(x[:, L - window:] @ ww.T + bw).permute(0, 2, 1)  # [B, Hq, window]
            dots = qI @ kI.repeat_interleave(G, 1).transpose(-1, -2)  # [B, Hq, window, L]
            I = (w[..., None] * dots).view(B, Hkv, G, window, L).sum(2) / math.sqrt(d_index)
            z = I.masked_fill(~in_omega, 0).sum(-2) / count
            kl = (torch.xlogy(p_t, p_t) - p_t * torch.log_softmax(z, -1)).sum(-1)  # [B, Hkv]
            total = total + kl.mean()
        loss = total / len(indexers)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    time_updates(update, "indexmem", T, B, steps, threads, dtype, device)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:8]), *sys.argv[8:10])
