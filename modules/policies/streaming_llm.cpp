// streaming_llm (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"): keep the
// first `sinks` tokens (attention sinks) and the most recent ones; score = +inf for a sink, else position.
#include <ATen/ops/full_like.h>
#include <ATen/ops/where.h>

#include <limits>

#include "modules/policies/policy_factories.h"

namespace kvbound::policies {
namespace {

class StreamingLlm final : public EvictionPolicy {
 public:
  explicit StreamingLlm(std::int64_t sinks) : sinks_(sinks) {}
  at::Tensor score(const PolicyView& view) override {
    const at::Tensor pos = view.cache->positions(view.layer).to(at::kDouble);
    return at::where(pos < static_cast<double>(sinks_),
                     at::full_like(pos, std::numeric_limits<double>::infinity()), pos);
  }

 private:
  std::int64_t sinks_;
};

}  // namespace

std::unique_ptr<EvictionPolicy> make_streaming_llm(const PolicyOptions& o) {
  return std::make_unique<StreamingLlm>(o.sinks);
}

}  // namespace kvbound::policies
