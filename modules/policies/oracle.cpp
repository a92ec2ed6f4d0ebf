// oracle (hindsight; an analysis reference, not deployable): keep the tokens that the full-cache model's own
// queries will attend to — what no policy can know when it cuts, so how close a policy comes says how much a
// better predictor of future attention could still gain. The engine hands it the full model's attention over the
// sequence before the sequence starts (EvictionPolicy::set_hindsight, modules/hindsight_attention.h). Per layer
// and KV head, averaged over the group's query heads, the score is
//   oracle.queries = scored: the mean attention of the queries the task scores (continuation: the rows whose
//                    next-token distributions the KL is measured at; retrieval: the question's and the full
//                    model's answer's rows), the same ranking at every cut;
//   oracle.queries = later:  the summed attention of every query after the cut's newest position, prefill rows
//                    included (whose outputs feed the deeper layers' keys and values of what is scored).
// Positions past the hindsight's end (a budgeted answer running longer than the full model's) are kept first.
#include <ATen/ops/flip.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <limits>

#include "base/errors.h"
#include "modules/policies/registry.h"

namespace kvbound::policies {
namespace {

enum class OracleQueries { Scored, Later };

class Oracle final : public EvictionPolicy {
 public:
  explicit Oracle(OracleQueries queries) : queries_(queries) {}
  bool needs_hindsight() const override { return true; }

  void set_hindsight(Hindsight hindsight) override {
    received_.clear();
    for (const at::Tensor& a : hindsight.attention) {  // [B, Hkv, Tq, T]
      const std::int64_t first = hindsight.first_scored_row, rows = a.size(2) - first;
      if (queries_ == OracleQueries::Scored) received_.push_back(a.narrow(2, first, rows).mean(2));  // [B, Hkv, T]
      else received_.push_back(a.flip({2}).cumsum(2).flip({2}));  // row r: Σ over queries s >= r
    }
  }

  at::Tensor score(const PolicyView& v) override {
    if (received_.empty())
      fail("policy", "oracle",
           "ranks by the full model's future attention, which only kvbound eval's continuation and retrieval tasks "
           "hand it; it cannot serve here");
    const at::Tensor& received = received_.at(static_cast<std::size_t>(v.layer));
    const at::Tensor positions = v.cache->positions(v.layer);  // [B, Hkv, N]
    const std::int64_t known = received.size(-1);
    at::Tensor by_position = received;  // [B, Hkv, T]
    if (queries_ == OracleQueries::Later) {
      const std::int64_t next_query = v.call->start + v.call->q.size(2);  // the first query after this cut
      by_position = next_query < received.size(2) ? received.select(2, next_query) : at::zeros_like(received.select(2, 0));
    }
    const at::Tensor score = at::gather(by_position, -1, positions.clamp_max(known - 1));
    return at::where(positions >= known, at::full_like(score, std::numeric_limits<double>::infinity()), score);
  }

 private:
  OracleQueries queries_;
  std::vector<at::Tensor> received_;  // per layer: scored [B, Hkv, T]; later [B, Hkv, Tq, T] suffix sums
};

}  // namespace

extern const PolicyRegistration oracle{
    "oracle", PolicyKind::Hindsight, "hindsight reference: the tokens the full model's future queries attend to most (eval only)",
    [](ConfigSchema& s) {
      s.add("oracle.queries", ConfigType::String, "scored",
            "oracle: whose future attention ranks the cache: scored (the task's scored queries) | later (every later query)");
    },
    [](const Config& c, const TrainedModules&) -> PolicyMaker {
      const std::string queries = c.get_string("oracle.queries");
      if (queries != "scored" && queries != "later") fail("config", "oracle.queries", "must be scored or later, got '" + queries + "'");
      const OracleQueries q = queries == "scored" ? OracleQueries::Scored : OracleQueries::Later;
      return [q](std::uint64_t) { return std::make_unique<Oracle>(q); };
    }};

}  // namespace kvbound::policies
