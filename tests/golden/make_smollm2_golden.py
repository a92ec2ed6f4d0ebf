"""transformers' fp32 logits for SmolLM2-135M-Instruct loaded from the same GGUF file the C++ code reads
(transformers dequantizes Q4_1/Q8_0 with the gguf package and undoes llama.cpp's q/k permutation)."""
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from golden_io import write_tensor

PROMPTS = {
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
}


def main(gguf_path, out_dir):
    if not os.path.exists(gguf_path):
        print(f"missing {gguf_path}; run scripts/setup.sh", file=sys.stderr)
        sys.exit(1)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    torch.set_num_threads(2)
    for key, text in PROMPTS.items():
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            logits = model(ids).logits
        write_tensor(out_dir, key, logits[0].numpy(), input_ids=ids[0].tolist(), text=text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
