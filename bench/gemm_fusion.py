"""Would fusing SmolLM2's q/k/v and gate/up projections speed the CPU forward? Times one layer's projections
at T = 512 in ATen, separate vs concatenated weights, per thread count (weights random: speed only).
Usage: .venv/bin/python bench/gemm_fusion.py [THREADS ...]   (default: 1 2)"""
import sys
import time

import torch
import torch.nn.functional as F

HIDDEN, Q_DIM, KV_DIM, INTERMEDIATE, T = 576, 576, 192, 1536, 512


def ms_per_call(fn, reps=200):
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    for threads in [int(a) for a in sys.argv[1:]] or [1, 2]:
        torch.set_num_threads(threads)
        x = torch.randn(T, HIDDEN)
        wq, wk, wv = torch.randn(Q_DIM, HIDDEN), torch.randn(KV_DIM, HIDDEN), torch.randn(KV_DIM, HIDDEN)
        wqkv = torch.cat([wq, wk, wv])
        wg, wu = torch.randn(INTERMEDIATE, HIDDEN), torch.randn(INTERMEDIATE, HIDDEN)
        wgu = torch.cat([wg, wu])
        qkv = ms_per_call(lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)))
        qkv_fused = ms_per_call(lambda: F.linear(x, wqkv).split([Q_DIM, KV_DIM, KV_DIM], -1))
        mlp = ms_per_call(lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu))
        mlp_fused = ms_per_call(lambda: (lambda y: F.silu(y[:, :INTERMEDIATE]) * y[:, INTERMEDIATE:])(F.linear(x, wgu)))
        print(f"threads {threads}: qkv separate {qkv:.3f} ms fused {qkv_fused:.3f}; "
              f"gate/up separate {mlp:.3f} fused {mlp_fused:.3f}")


if __name__ == "__main__":
    main()
