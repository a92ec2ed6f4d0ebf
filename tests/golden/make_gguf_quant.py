"""Reference data for the GGUF loader tests, from the gguf package (llama.cpp's gguf-py).

OUTDIR/TYPE.raw + TYPE.f32/.json for every ggml type the C++ dequantizer supports: raw blocks and
gguf.quants.dequantize's float32 of them. Types gguf-py can quantize get half their rows from
gguf.quants.quantize on random data; every type also gets rows of random bytes (random bit
patterns in F16/BF16, NaN excluded) with valid f16 scales, which reach every code path.

OUTDIR/smollm2_layer0_{q,k,v}_proj.f32/.json: layer 0's attention weights of the default
SmolLM2 GGUF ($KVBOUND_DEFAULT_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf), dequantized
by gguf-py and with q/k un-permuted by transformers' GGUF loader (LlamaTensorProcessor). Skipped
when the model file is absent (the C++ test then skips too).
"""
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

from golden_io import write_tensor

ROWS = 8
ROW_ELEMENTS = 1024  # four K-quant blocks, 32 legacy blocks per row

# Byte offsets of the f16 scale fields in each block, which random bytes must not turn into
# inf/NaN (ggml's block_q4_0, block_q4_1, ..., block_q6_k).
SCALE_OFFSETS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
ALL_TYPES = QUANTIZABLE + [T.Q4_K, T.Q5_K, T.Q6_K]


def random_floats(rng, rows):
    # Rows of different magnitudes so the per-block scales vary.
    scale = np.float32(10.0) ** rng.uniform(-3, 2, size=(rows, 1)).astype(np.float32)
    return (rng.standard_normal((rows, ROW_ELEMENTS)).astype(np.float32) * scale).astype(np.float32)


def random_raw_rows(rng, qtype, rows):
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * ROW_ELEMENTS // block_size
    if qtype in (T.F16, T.BF16):
        bits = rng.integers(0, 1 << 16, size=n_blocks, dtype=np.uint16)
        exponent_mask = 0x7C00 if qtype == T.F16 else 0x7F80
        mantissa_mask = 0x03FF if qtype == T.F16 else 0x007F
        nan = ((bits & exponent_mask) == exponent_mask) & ((bits & mantissa_mask) != 0)
        bits[nan] &= np.uint16(0x8000 | exponent_mask)  # NaN -> same-signed infinity
        return bits.view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def write_quant_goldens(out_dir):
    rng = np.random.default_rng(20240611)
    for qtype in ALL_TYPES:
        n_quantized = ROWS if qtype == T.F32 else ROWS // 2 if qtype in QUANTIZABLE else 0
        parts = []
        if n_quantized:
            quantized = gguf.quants.quantize(random_floats(rng, n_quantized), qtype)
            parts.append(np.ascontiguousarray(quantized).view(np.uint8).reshape(n_quantized, -1))
        if n_quantized < ROWS:
            parts.append(random_raw_rows(rng, qtype, ROWS - n_quantized))
        raw = np.concatenate(parts, axis=0)
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        assert values.shape == (ROWS, ROW_ELEMENTS), (qtype.name, values.shape)
        assert not np.isnan(values).any(), qtype.name
        raw.tofile(os.path.join(out_dir, qtype.name + ".raw"))
        write_tensor(out_dir, qtype.name, values, type=qtype.name)


def write_smollm2_goldens(out_dir):
    default = os.path.join(os.path.dirname(__file__), "..", "..", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = os.environ.get("KVBOUND_DEFAULT_MODEL", default)
    if not os.path.exists(path):
        print(f"make_gguf_quant: {path} is missing; run scripts/setup.sh", file=sys.stderr)
        sys.exit(1)
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = gguf.GGUFReader(path)
    fields = {name: reader.fields[name].contents() for name in ("llama.attention.head_count", "llama.attention.head_count_kv")}
    processor = LlamaTensorProcessor(
        config={
            "num_attention_heads": fields["llama.attention.head_count"],
            "num_key_value_heads": fields["llama.attention.head_count_kv"],
        }
    )
    tensors = {t.name: t for t in reader.tensors}
    for proj in ("q", "k", "v"):
        name = f"blk.0.attn_{proj}.weight"
        t = tensors[name]
        weights = gguf.quants.dequantize(t.data, t.tensor_type)  # torch layout [out, in]
        weights = processor.process(weights, name).weights
        write_tensor(out_dir, f"smollm2_layer0_{proj}_proj", weights, gguf_type=t.tensor_type.name)


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    write_quant_goldens(out_dir)
    write_smollm2_goldens(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
