// Which micro-kernel forms this CPU's bfloat16 × bfloat16 → float32 products where kvbound packs its own operands
// (causal attention, the pooled importance's logits, the distillation loss's products with the head): AMX tiles
// (ops/amx_panels.h) where this CPU has them, faster than VDPBF16PS at every size measured; else VDPBF16PS
// (ops/bf16_dot_panels.h) where it has AVX512-BF16; else none, and the caller takes ATen's float32 path.
#pragma once

namespace kvbound::ops {

enum class Bf16ProductEngine { kTiles, kDot, kNone };

// Asked at each call: the AMX answer follows ATen's mkldnn switch.
Bf16ProductEngine bf16_product_engine();

}  // namespace kvbound::ops
