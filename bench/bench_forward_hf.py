"""transformers' forward throughput on the same GGUF, T tokens, same thread count, in DTYPE (float32, bfloat16): one
JSON line. Usage: bench_forward_hf.py GGUF [T=512] [threads=2] [repeats=5] [dtype=float32]"""
import json
import os
import resource
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main(gguf_path, T=512, threads=2, repeats=5, dtype="float32"):
    torch.set_num_threads(threads)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, T))
    best = 1e30
    with torch.inference_mode():
        model(ids, use_cache=False)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, use_cache=False)
            best = min(best, time.perf_counter() - t0)
    print(json.dumps({"impl": "transformers", "T": T, "threads": threads, "dtype": dtype, "best_s": round(best, 4),
                      "tok_s": round(T / best, 1), "peak_rss_after_load_bytes": rss}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:5]), *sys.argv[5:6])
