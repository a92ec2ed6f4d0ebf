#include "ops/bf16_product_engine.h"

#include "ops/amx_panels.h"
#include "ops/bf16_dot_panels.h"

namespace kvbound::ops {

Bf16ProductEngine bf16_product_engine() {
  if (amx::bf16_available()) return Bf16ProductEngine::kTiles;
  return bf16_dot::available() ? Bf16ProductEngine::kDot : Bf16ProductEngine::kNone;
}

}  // namespace kvbound::ops
