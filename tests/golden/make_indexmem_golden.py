"""IndexMem loss golden: a tiny random Llama (GQA 8/2), random indexer and latent-memory weights under their
export names, and a padded batch; the stage-1 indexer loss L_KL (at four pool / window / min_gap / lead settings)
and the stage-2 memory loss L_MSE (streaming_llm evictions replayed at two budgets; add and slot reads), per layer and in total,
plus their gradients, computed here in float64 with plain PyTorch from DESIGN.md's formulas as the C++
implements them. The teacher q/k/v are recomputed by hand from transformers' layer inputs (checked against
transformers' own forward). tests/test_indexmem_golden.cpp requires IndexMemIndexerMethod::loss and
MemoryMethod::loss to reproduce every number."""
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from golden_io import tiny_random_llama

# Stage 1: the indexer (key_heads kv, rope on, relu off) and the (pool, window, min_gap) settings.
D_INDEX = 8
# (pool, window, min_gap, lead); window 0: every later query; lead: the student sees the first L − lead columns.
KL_SETTINGS = [("mean", 6, 0, 0), ("max", 5, 2, 0), ("logsumexp", 0, 1, 0), ("mean", 4, 0, 3)]
# Stage 2: the latent memory under streaming_llm.
D_MEMORY, BUDGETS, CHUNK, SINKS, MEM_EPS = 4, (6, 10), 4, 4, 1e-6
RMS_EPS_INDEXER = 1e-6
ROPE_THETA = 1000.0


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(x, positions, theta):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def rms_unweighted(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS_INDEXER)


def teacher_layers(model, ids):
    """Per layer: x = input_layernorm(h), pre-RoPE q, k and v, post-RoPE q, k, and o_full (full causal attention
    output before o_proj), all [B, H, T, D] (x: [B, T, hidden]). Checked against transformers' hidden states."""
    cfg = model.config
    B, T = ids.shape
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    G = Hq // Hkv
    with torch.no_grad():
        hs = model.model(ids, output_hidden_states=True).hidden_states
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]  # [s, t]
    out = []
    for li, layer in enumerate(model.model.layers):
        a = layer.self_attn
        h = hs[li]
        x = layer.input_layernorm(h)
        q_pre = a.q_proj(x).view(B, T, Hq, D).transpose(1, 2)
        k_pre = a.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        q, k = rope(q_pre, pos, ROPE_THETA), rope(k_pre, pos, ROPE_THETA)
        logits = q @ k.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(D)
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # A_h[s, t]
        o_full = probs @ v.repeat_interleave(G, 1)
        if li + 1 < len(model.model.layers):  # this layer by hand gives transformers' next layer input
            h2 = h + a.o_proj(o_full.transpose(1, 2).reshape(B, T, -1))
            h2 = h2 + layer.mlp(layer.post_attention_layernorm(h2))
            assert torch.allclose(h2, hs[li + 1], atol=1e-9), "hand-written layer differs from transformers"
        out.append(dict(x=x, q_pre=q_pre, k_pre=k_pre, v=v, probs=probs, o_full=o_full))
    return out


def window_starts(L, window, min_gap):
    return (torch.arange(L) + min_gap).clamp(min=(L - window) if window > 0 else 0)


def pool_over_omega(x, pool, window, min_gap, empty):
    """x [..., s, t] (L x L) → [..., t]: pooled over s ∈ Ω(t) = [start(t), L); `empty` where Ω(t) is empty."""
    L = x.shape[-1]
    start = window_starts(L, window, min_gap)
    in_omega = torch.arange(L)[:, None] >= start[None, :]  # [s, t]
    valid = start < L
    count = in_omega.sum(0).clamp(min=1).to(x.dtype)
    if pool == "mean":
        pooled = x.masked_fill(~in_omega, 0).sum(-2) / count
    elif pool == "max":
        pooled = x.masked_fill(~in_omega, float("-inf")).amax(-2)
    else:
        pooled = x.masked_fill(~in_omega, float("-inf")).logsumexp(-2)
    return torch.where(valid, pooled, torch.full_like(pooled, empty)), valid


def indexer_kl(layers, weights, ix, cfg, pool, window, min_gap, lead):
    """L_KL per layer and total. Rows grouped by real length L (weight > 0), run on their first L columns; the
    student on the first S = L − lead of them, against the teacher's importance of those S keys."""
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    G = Hq // Hkv
    lengths = (weights > 0).sum(1).tolist()
    n_layers = len(layers)
    layer_sum = [torch.zeros((), dtype=torch.float64) for _ in range(n_layers)]
    rows = 0
    for L in sorted(set(lengths)):
        members = [b for b, n in enumerate(lengths) if n == L]
        S = L - lead
        if S < 1:
            continue
        valid = window_starts(S, window, min_gap) < S
        if not valid.any():
            continue
        pos = torch.arange(S)
        for li, t in enumerate(layers):
            p = f"model.layers.{li}.self_attn.indexer."
            x = t["x"][members, :S]
            q_pre = t["q_pre"][members, :, :S]
            A = t["probs"][members, :, :L, :L]  # causal softmax over t <= s: the prefix is its own forward
            Bg = len(members)
            # teacher: mean over the group's heads of pool_{s∈Ω(t)} A_h[s, t]; 0 at invalid keys
            a_h, _ = pool_over_omega(A, pool, window, min_gap, 0.0)  # [Bg, Hq, L]
            a = a_h.view(Bg, Hkv, G, L).mean(2)[..., :S]
            # student
            qI = rope(rms_unweighted(q_pre @ ix[p + "wq"].T), pos, ROPE_THETA)  # [Bg, Hq, L, dI]
            kI = rope(rms_unweighted((x @ ix[p + "wk"].T).view(Bg, S, Hkv, D_INDEX).transpose(1, 2)), pos, ROPE_THETA)
            w = torch.sigmoid(x @ ix[p + "ww"].T + ix[p + "bw"]).permute(0, 2, 1)  # [Bg, Hq, L]
            dots = qI @ kI.repeat_interleave(G, 1).transpose(-1, -2)  # [Bg, Hq, s, t]
            I = (w[..., None] * dots).view(Bg, Hkv, G, S, S).sum(2) / math.sqrt(D_INDEX)
            z, _ = pool_over_omega(I, pool, window, min_gap, float("-inf"))
            # KL(p_T ‖ p_S) over the valid keys, mean over rows and KV heads
            av = a[..., valid]
            p_t = av / av.sum(-1, keepdim=True)
            log_ps = torch.log_softmax(z[..., valid], -1)
            kl = (torch.xlogy(p_t, p_t) - p_t * log_ps).sum(-1)  # [Bg, Hkv]
            layer_sum[li] = layer_sum[li] + kl.mean() * Bg
        rows += len(members)
    per_layer = [s / rows for s in layer_sum]
    return sum(per_layer) / n_layers, per_layer


def phi(x):
    return F.elu(x) + 1


def memory_mse(layers, weights, mem, cfg, read_mode):
    """L_MSE per layer and total: streaming_llm's evictions replayed chunk by chunk at each budget. read_mode
    add: o = o_attn + sigmoid(w_g.q + c_g) m(q); slot: m(q) is one more softmax entry beside the attended keys,
    logit log(q^.z / d_m) + w_g.q + c_g."""
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G = Hq // Hkv
    B, T = weights.shape
    n_layers = len(layers)
    real = (weights > 0).to(torch.float64).view(B, 1, T, 1)
    layer_mse = [torch.zeros((), dtype=torch.float64) for _ in range(n_layers)]
    budgets_used = 0
    for budget in BUDGETS:
        cached = [[] for _ in range(n_layers)]     # positions held, in position order (same for every row/head)
        state = [None] * n_layers                  # (Mem [B, Hkv, d_m, D], z [B, Hkv, d_m])
        sse = [torch.zeros((), dtype=torch.float64) for _ in range(n_layers)]
        elements = 0.0
        evicted_any = False
        for s in range(0, T, CHUNK):
            n = min(CHUNK, T - s)
            scored = evicted_any  # an eviction already happened before this chunk
            mask = real[:, :, s:s + n]
            for li, t in enumerate(layers):
                p = f"model.layers.{li}.self_attn.latent_memory."
                lam = torch.sigmoid(mem[p + "theta"])  # [Hkv]
                q_pre = t["q_pre"][:, :, s:s + n]
                # (1) read from the memory as it stands: m(q) and the logit beside it, per query head
                m_read, logit = None, None
                if state[li] is not None:
                    Mem, zz = state[li]
                    m_read = torch.empty(B, Hq, n, D, dtype=torch.float64)
                    logit = torch.empty(B, Hq, n, 1, dtype=torch.float64)
                    for h in range(Hq):
                        g = h // G
                        qhat = phi(q_pre[:, h] @ mem[p + "wq"][g].T)  # [B, n, d_m]
                        num = qhat @ Mem[:, g]  # [B, n, D]
                        den = (qhat * zz[:, g, None, :]).sum(-1, keepdim=True) + MEM_EPS
                        m_read[:, h] = num / den
                        logit[:, h] = (q_pre[:, h] @ mem[p + "wg"][h] + mem[p + "cg"][h])[..., None]
                        if read_mode == "slot":
                            logit[:, h] = logit[:, h] + torch.log(den / D_MEMORY)
                # (2) attention of the chunk's queries over everything cached + the chunk (causal within it)
                cached[li] += list(range(s, s + n))
                idx = torch.tensor(cached[li])
                q = rope(q_pre, torch.arange(s, s + n), ROPE_THETA)
                k = rope(t["k_pre"][:, :, idx], idx, ROPE_THETA).repeat_interleave(G, 1)
                v = t["v"][:, :, idx].repeat_interleave(G, 1)
                visible = idx[None, :] <= torch.arange(s, s + n)[:, None]
                logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~visible, float("-inf"))
                o_attn = torch.softmax(logits, -1) @ v
                # (3) over budget: keep the sinks and the newest, write the evicted in position order
                if len(cached[li]) > budget:
                    kept = sorted([c for c in cached[li] if c < SINKS] +
                                  sorted(c for c in cached[li] if c >= SINKS)[-(budget - SINKS):])
                    evicted = [c for c in cached[li] if c not in kept]
                    Mem, zz = state[li] if state[li] is not None else (
                        torch.zeros(B, Hkv, D_MEMORY, D, dtype=torch.float64),
                        torch.zeros(B, Hkv, D_MEMORY, dtype=torch.float64))
                    for i in evicted:  # the one-token recurrence
                        khat = phi(torch.einsum("bgd,gmd->bgm", t["k_pre"][:, :, i], mem[p + "wk"]))
                        Mem = lam[None, :, None, None] * Mem + khat[..., None] * t["v"][:, :, i, None, :]
                        zz = lam[None, :, None] * zz + khat
                    state[li] = (Mem, zz)
                    cached[li] = kept
                    evicted_any = True
                # (4) the read mixed into the attention output
                if m_read is None:
                    o = o_attn
                elif read_mode == "add":
                    o = o_attn + torch.sigmoid(logit) * m_read
                else:
                    alpha = torch.sigmoid(logit - torch.logsumexp(logits, -1, keepdim=True))
                    o = o_attn + alpha * (m_read - o_attn)
                if scored:
                    sse[li] = sse[li] + (((o - t["o_full"][:, :, s:s + n]) * mask) ** 2).sum()
            if scored:
                elements += mask.sum().item() * Hq * D
        if elements == 0:
            continue
        budgets_used += 1
        for li in range(n_layers):
            layer_mse[li] = layer_mse[li] + sse[li] / elements
    per_layer = [m / budgets_used for m in layer_mse]
    return sum(per_layer) / n_layers, per_layer


def main(out_dir):
    torch.manual_seed(2025)
    model = tiny_random_llama(out_dir, head_dim=8, rope_theta=ROPE_THETA)
    config = model.config
    Hq, Hkv, D, hidden = 8, 2, 8, 32

    # The batch: rows 0 and 2 end their documents (last position: no target, weight 0), so they share a real
    # length of 23; row 1 has 17 tokens then padding (BOS ids, weight 0 from position 16 on).
    B, T = 3, 24
    ids = torch.randint(3, config.vocab_size, (B, T))
    ids[:, 0] = 1
    weights = torch.ones(B, T, dtype=torch.float64)
    weights[:, -1] = 0
    ids[1, 17:] = 1
    weights[1, 16:] = 0
    targets = torch.roll(ids, -1, 1).masked_fill(weights == 0, -1)

    ix, mem = {}, {}
    for li in range(config.num_hidden_layers):
        p = f"model.layers.{li}.self_attn.indexer."
        ix[p + "wq"] = torch.randn(D_INDEX, D) * 0.5
        ix[p + "wk"] = torch.randn(Hkv * D_INDEX, hidden) * 0.5
        ix[p + "ww"] = torch.randn(Hq, hidden) * 0.5
        ix[p + "bw"] = torch.randn(Hq) * 0.5
        p = f"model.layers.{li}.self_attn.latent_memory."
        mem[p + "wk"] = torch.randn(Hkv, D_MEMORY, D) * 0.4
        mem[p + "wq"] = torch.randn(Hkv, D_MEMORY, D) * 0.4
        mem[p + "theta"] = torch.tensor([1.0, 3.0]) + torch.randn(Hkv) * 0.2
        mem[p + "wg"] = torch.randn(Hq, D) * 0.3
        mem[p + "cg"] = torch.rand(Hq) * 2.0
    save_file({k: v.contiguous() for k, v in ix.items()}, f"{out_dir}/indexer.safetensors")
    save_file({k: v.contiguous() for k, v in mem.items()}, f"{out_dir}/memory.safetensors")

    layers = teacher_layers(model, ids)
    out = {"inputs": ids.float(), "targets": targets.float(), "weights": weights.float()}
    meta = {"d_index": str(D_INDEX), "d_memory": str(D_MEMORY), "budgets": ",".join(map(str, BUDGETS)),
            "chunk": str(CHUNK), "sinks": str(SINKS), "kl_settings": str(len(KL_SETTINGS))}

    for i, (pool, window, min_gap, lead) in enumerate(KL_SETTINGS):
        ix64 = {k: v.double().requires_grad_(True) for k, v in ix.items()}
        total, per_layer = indexer_kl(layers, weights, ix64, config, pool, window, min_gap, lead)
        total.backward()
        meta.update({f"kl{i}.pool": pool, f"kl{i}.window": str(window), f"kl{i}.min_gap": str(min_gap),
                     f"kl{i}.lead": str(lead),
                     f"kl{i}.total": repr(total.item())})
        for li, v in enumerate(per_layer):
            meta[f"kl{i}.layer{li}"] = repr(v.item())
        for k, v in ix64.items():
            out[f"kl{i}.grad.{k}"] = v.grad.float()

    for read_mode in ("add", "slot"):
        key = f"mse_{read_mode}"
        mem64 = {k: v.double().requires_grad_(True) for k, v in mem.items()}
        total, per_layer = memory_mse(layers, weights, mem64, config, read_mode)
        total.backward()
        meta[f"{key}.total"] = repr(total.item())
        for li, v in enumerate(per_layer):
            meta[f"{key}.layer{li}"] = repr(v.item())
        for k, v in mem64.items():
            out[f"{key}.grad.{k}"] = v.grad.float()
    save_file(out, f"{out_dir}/golden.safetensors", metadata=meta)


if __name__ == "__main__":
    main(sys.argv[1])
