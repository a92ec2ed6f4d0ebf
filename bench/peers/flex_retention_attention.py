"""The peer of bench/bench_cuda_ops.cpp: PyTorch FlexAttention with TRIM-KV's score_mod
score + (t - i) * log_beta_i (how the official TRIM-KV code trains its gates), on the same shapes (bf16, B 1,
Hq 32, Hkv 8, D 128, causal block mask) and timed the same way: median of 10 runs after warm-up (compilation
included in the warm-up), host clock after torch.cuda.synchronize(), peak = allocator bytes above those before.
Prints JSON lines in bench_cuda_ops' format with impl "flex". Usage: flex_retention_attention.py [T ...]"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, HQ, HKV, D = 1, 32, 8, 128
GROUP = HQ // HKV
flex = torch.compile(flex_attention, dynamic=False)


def measure(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), (torch.cuda.max_memory_allocated() - before) / 2**20


def line(pass_name, T, flops, ms, peak):
    print(json.dumps({"op": "retention_attention", "impl": "flex", "pass": pass_name, "B": B, "Hq": HQ, "Hkv": HKV,
                      "D": D, "T": T, "dtype": "bfloat16", "ms": round(ms, 4),
                      "tflops": round(flops / (ms * 1e-3) / 1e12, 2), "peak_extra_mib": round(peak, 1)}), flush=True)


for T in [int(x) for x in sys.argv[1:]] or [1024, 4096, 8192]:
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v, w = (torch.randn(B, h, T, D, **opts) for h in (HQ, HKV, HKV, HQ))
    log_beta = F.logsigmoid(torch.randn(B, HKV, T, device="cuda") * 2 + 6)
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device="cuda")

    def attend(x, lb):
        def score_mod(score, b, h, qi, ki):
            return score + (qi - ki).to(torch.float32) * lb[b, h // GROUP, ki]
        return flex(x[0], x[1], x[2], score_mod=score_mod, block_mask=mask, enable_gqa=True)

    fwd_flops = 2.0 * B * HQ * T * T * D
    with torch.no_grad():
        ms, peak = measure(lambda: attend((q, k, v), log_beta))
    line("fwd", T, fwd_flops, ms, peak)
    x = [t.detach().requires_grad_(True) for t in (q, k, v)]
    lb = log_beta.detach().requires_grad_(True)
    ms, peak = measure(lambda: torch.autograd.grad((attend(x, lb) * w).sum(), x + [lb]))
    line("fwd+bwd", T, 3.5 * fwd_flops, ms, peak)
