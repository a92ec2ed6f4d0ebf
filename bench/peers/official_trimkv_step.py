"""GPU peer for kvbound's TRIM-KV training step: the official TRIM-KV package (PyPI trimkv 0.1.5, with
transformers 4.57.1) doing one gate-training update on a random-initialised model with Llama-3.2-1B shapes:
teacher forward (vanilla attention, no grad) + student forward with FlexAttention gated attention + forward KL
+ NTP + capacity loss (Triton retention_sum) + backward + AdamW on the gates. Speed only (weights random).
Prints JSON lines: tokens/s per (B, T). Usage: official_trimkv_step.py [T ...]
Needs trimkv==0.1.5 with transformers==4.57.1 (the GPU image has 5.x): scripts/gpu_wheels.sh downloads the wheels
into .whl/, which scripts/gpu_check.sh installs into a private folder on the device when it is carried there.
Same shapes and settings as kvbound's side in scripts/gpu_check.sh (bench_train_step: gate width 512, M_train 512,
bf16)."""
import json, sys, time, types
import torch

# flash_attn is imported by the package's dynamic-budget cache path only (not used here); absent on the GPU image.
# transformers probes for it with find_spec, so load transformers' modules before the stub goes in.
import transformers.activations, transformers.modeling_utils, transformers.models.llama.modeling_llama  # noqa: E401
import transformers.integrations.flash_attention, transformers.modeling_flash_attention_utils  # noqa: E401
import importlib.machinery
_fa = types.ModuleType('flash_attn'); _fa.__spec__ = importlib.machinery.ModuleSpec('flash_attn', None); _fai = types.ModuleType('flash_attn.flash_attn_interface')
_fai.flash_attn_varlen_func = _fai.flash_attn_with_kvcache = None; _fa.flash_attn_interface = _fai
sys.modules.setdefault('flash_attn', _fa); sys.modules.setdefault('flash_attn.flash_attn_interface', _fai)

from trimkv.models.llama.configuration_trimkv_llama import TrimKVLlamaConfig
from trimkv.models.llama.modeling_trimkv_llama import TrimKVLlamaForCausalLM

torch.manual_seed(0)
dev = 'cuda'
cfg = TrimKVLlamaConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rope_theta=500000.0, tie_word_embeddings=True, hidden_act='silu', rms_norm_eps=1e-5,
    retention_gate='rg', retention_gate_intermediate_size=512, retention_gate_bias_init=8.0,
    memory_size=512, base_loss='fwkl_ntp', attn_impl='rg_attn_flex', global_capacity=False,
    trainable_params='retention_gate', logit_block_size=0, rg_dropout=0.0, compress_memory=False, torch_dtype=torch.bfloat16)
cfg._attn_implementation = 'flex_attention'  # masks become BlockMasks, as rg_attn_flex needs
t0 = time.time()
with torch.device(dev):
    model = TrimKVLlamaForCausalLM(cfg).to(torch.bfloat16)
for n, p in model.named_parameters():
    p.requires_grad_('retention_gate' in n)
gates = [p for p in model.parameters() if p.requires_grad]
print(json.dumps({"model_params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                  "gate_params_M": round(sum(p.numel() for p in gates) / 1e6, 2), "init_s": round(time.time() - t0, 1)}), flush=True)
opt = torch.optim.AdamW(gates, lr=2e-4)


def step(ids):
    labels = ids.clone()
    pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0).expand(ids.shape[0], -1)
    model.eval()
    with torch.no_grad():
        base = model(input_ids=ids, position_ids=pos, vanilla_forward=True, use_cache=False).logits
    model.train()
    out = model(input_ids=ids, labels=labels, position_ids=pos, base_logits=base, use_cache=False)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    opt.step()
    return out


for T in [int(x) for x in (sys.argv[1:] or [4096, 8192])]:
    B = max(1, 8192 // T)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    try:
        t0 = time.time()
        out = step(ids); torch.cuda.synchronize()
        first = time.time() - t0
        step(ids); torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(4):
            t0 = time.time(); step(ids); torch.cuda.synchronize(); times.append(time.time() - t0)
        ms = sorted(times)[len(times) // 2] * 1e3
        print(json.dumps({"peer": "official_trimkv_0.1.5_train_step", "B": B, "T": T, "median_ms": round(ms, 1),
                          "tokens_per_s": round(B * T / (ms / 1e3)), "first_step_s": round(first, 1),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
                          "loss": round(float(out.loss), 4), "retention_loss": round(float(out.retention_loss), 4)}), flush=True)
    except Exception as e:
        print(json.dumps({"peer": "official_trimkv_0.1.5_train_step", "B": B, "T": T, "error": repr(e)[:400]}), flush=True)
