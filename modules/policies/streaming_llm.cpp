// streaming_llm (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"): keep the
// first `sinks` tokens (attention sinks) and the most recent ones; score = +inf for a sink, else position.
#include <ATen/ops/full_like.h>
#include <ATen/ops/where.h>

#include <limits>

#include "base/errors.h"
#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

class StreamingLlm final : public EvictionPolicy {
 public:
  explicit StreamingLlm(std::int64_t sinks) : sinks_(sinks) {}
  at::Tensor score(const PolicyView& view) override {
    const at::Tensor pos = view.cache->positions(view.layer).to(at::kFloat);
    return at::where(pos < static_cast<double>(sinks_), at::full_like(pos, std::numeric_limits<float>::infinity()), pos);
  }

 private:
  std::int64_t sinks_;
};

}  // namespace

extern const PolicyRegistration streaming_llm{
    "streaming_llm", PolicyKind::Heuristic, "the first streaming_llm.sinks tokens (attention sinks) and the most recent ones",
    [](ConfigSchema& s) { s.add("streaming_llm.sinks", ConfigType::Int, "4", "streaming_llm: attention-sink tokens always kept"); },
    [](const Config& c, const TrainedModules&) -> PolicyMaker {
      const std::int64_t sinks = c.get_int("streaming_llm.sinks");
      if (sinks < 0) fail("config", "streaming_llm.sinks", "must be >= 0");
      return [sinks](std::uint64_t) { return std::make_unique<StreamingLlm>(sinks); };
    }};

}  // namespace kvbound::policies
