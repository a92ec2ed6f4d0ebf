"""Parity of kvbound's TRIM-KV with the official release (PyPI trimkv 0.1.5, transformers 4.57.1).

    official_trimkv_parity.py EXPORT_DIR BACKBONE_DIR REFERENCE.safetensors

EXPORT_DIR is `kvbound export --format trimkv` of a kvbound run; REFERENCE.safetensors is what
tests/test_official_trimkv.cpp computed with kvbound on the same backbone and window: the window's tokens,
kvbound's per-token log beta [L, Hkv, T], the positions its trimkv policy keeps after every token of a
token-by-token decode [T, L, Hkv, K] (-1 pads) in official mode (score offset 2, cut when M + buffer is
reached), and the per-token KL of that decode to the full cache [T]; metadata: memory_size, buffer_size.

Checks, each printed with its number, exit 1 on the first failure:
  (a) the official loader takes the folder unchanged, and its gate keys are exactly the export's;
  (b) the official gates' log beta equals kvbound's (max |diff| <= 1e-5);
  (c) the official TrimKVCache keeps the same positions per layer and KV head after every token, and the
      per-token KL to the full cache equals kvbound's (max |diff| <= 1e-5).

Workarounds for running the package on a CPU machine, none of which changes it:
  - `trimkv.attn` imports flash_attn (a CUDA-only build) at import time for its dynamic-budget and paged
    caches: a stub module stands in for it (those caches are not used here).
  - the official attention passes is_causal=True to sdpa on one-token decode steps, where PyTorch's causal
    mask (aligned top-left) hides every cached entry but the first; its `eager` path is not registered with
    transformers 4.57.1 ("eager" is a KeyError there) and builds no causal mask for multi-token forwards.
    Every forward here is a single token, so each attention module's is_causal is set to False: one query
    after all cached entries needs no mask.
Run with PYTHONPATH pointing at the test-only install of the package (scripts/setup.sh --test).
"""
import importlib.machinery
import os
import sys
import types

import torch

flash_attn = types.ModuleType("flash_attn")
flash_attn.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
interface = types.ModuleType("flash_attn.flash_attn_interface")
interface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)
interface.flash_attn_varlen_func = interface.flash_attn_with_kvcache = None
flash_attn.flash_attn_interface = interface
sys.modules.setdefault("flash_attn", flash_attn)
sys.modules.setdefault("flash_attn.flash_attn_interface", interface)

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from trimkv.cache_utils import TrimKVCache  # noqa: E402
from trimkv.models.llama.modeling_trimkv_llama import TrimKVLlamaForCausalLM  # noqa: E402


def fail(what):
    print(f"FAIL: {what}")
    sys.exit(1)


def main(export_dir, backbone_dir, reference_path):
    with safe_open(reference_path, "pt") as f:
        meta = f.metadata()
        ref = {k: f.get_tensor(k) for k in f.keys()}
    memory_size, buffer_size = int(meta["memory_size"]), int(meta["buffer_size"])
    tokens = ref["tokens"].to(torch.long)
    T = tokens.numel()
    print(f"official trimkv parity: transformers {transformers.__version__}, window of {T} tokens, "
          f"memory_size {memory_size}, buffer_size {buffer_size}")

    # (a) the folder as the official loader takes it
    model = TrimKVLlamaForCausalLM.from_pretrained(
        export_dir, load_trimkv_weights=True, download_from="local", base_model=backbone_dir,
        dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    for layer in model.model.layers:
        layer.self_attn.is_causal = False  # single-token forwards only (see the module docstring)
    exported = torch.load(os.path.join(export_dir, "trimkv_weights.pth"))
    gate_keys = {k for k in model.state_dict() if "retention_gate" in k}
    if set(exported) != gate_keys:
        fail(f"gate keys differ: missing {sorted(gate_keys - set(exported))[:3]}, "
             f"unexpected {sorted(set(exported) - gate_keys)[:3]}")
    result = model.load_state_dict(exported, strict=False)
    if result.unexpected_keys:
        fail(f"unexpected keys {result.unexpected_keys[:3]}")
    print(f"(a) loaded unchanged: {len(exported)} gate tensors, no missing or unexpected gate key")

    layers = model.model.layers
    log_betas = [[] for _ in layers]
    hooks = [layer.self_attn.retention_gate.register_forward_hook(
        lambda module, args, out, l=l: log_betas[l].append(out.detach()[0].transpose(0, 1)))
        for l, layer in enumerate(layers)]

    def decode(cache):
        logits = []
        kept = []
        with torch.no_grad():
            for t in range(T):
                out = model(input_ids=tokens[t:t + 1].view(1, 1), past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1].float())
                kept.append([cache.kv_positions[l][0].sort(dim=-1).values.clone() for l in range(len(layers))])
        return torch.stack(logits), kept

    full_logits, _ = decode(TrimKVCache(memory_size=None))
    for h in hooks:
        h.remove()
    # (b) log beta of every token, as the gates computed it in the full-cache decode
    official_lb = torch.stack([torch.cat(steps, dim=-1) for steps in log_betas])  # [L, Hkv, T]
    lb_diff = (official_lb - ref["log_beta"]).abs().max().item()
    print(f"(b) log beta: max |official - kvbound| = {lb_diff:.3g} over {official_lb.numel()} values")
    if not lb_diff <= 1e-5:
        fail("log beta differs by more than 1e-5")

    budgeted_logits, kept = decode(TrimKVCache(memory_size=memory_size, buffer_size=buffer_size))
    ref_kept = ref["kept"].to(torch.long)  # [T, L, Hkv, K], -1 pads
    evictions = 0
    for t in range(T):
        for l in range(len(layers)):
            want = ref_kept[t, l]
            got = kept[t][l]
            n = int((want[0] >= 0).sum())
            if got.shape[-1] != n or not torch.equal(got, want[:, :n]):
                fail(f"kept positions differ after token {t}, layer {l}: official {got.tolist()}, "
                     f"kvbound {want[:, :n].tolist()}")
        evictions += int(t + 1 > kept[t][0].shape[-1])
    full = torch.log_softmax(full_logits, -1)
    budgeted = torch.log_softmax(budgeted_logits, -1)
    kl = (full.exp() * (full - budgeted)).sum(-1)
    kl_diff = (kl - ref["kl"]).abs().max().item()
    print(f"(c) kept positions equal after all {T} tokens x {len(layers)} layers x {ref_kept.shape[2]} KV heads "
          f"({evictions} steps with evicted tokens); KL to full: official mean {kl.mean().item():.6g}, "
          f"kvbound mean {ref['kl'].mean().item():.6g}, max |diff| {kl_diff:.3g}")
    if not kl_diff <= 1e-5:
        fail("per-token KL to the full cache differs by more than 1e-5")
    print("parity: OK")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__)
        sys.exit(2)
    main(*sys.argv[1:])
