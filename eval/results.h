// Results of a budgeted evaluation (`kvbound eval`): one row per (policy, budget) with its metrics, saved
// as JSON and rendered as Markdown tables. Torch-free, so the report tools compile and test quickly.
//
// JSON schema (version 1), one flat list of rows in the order the engine produced them:
//   {
//     "format": "kvbound-eval-results",
//     "version": 1,
//     "meta": { ... },                       // free-form object: model, config hash, settings, timestamps
//     "rows": [
//       {"policy": "h2o", "budget": 64, "metrics": {"kl_to_full": 0.030, "top1_agree": 0.946, ...}},
//       {"policy": "full", "budget": 0, "metrics": {"nll": 1.3046, ...}},
//       ...
//     ]
//   }
// budget is the KV budget M in tokens per layer and KV head; 0 means unbounded (the full-cache reference).
// A row carries only the metrics its tasks produced. A metric that came out non-finite (NaN, inf) is
// stored as null, since JSON has no NaN, and reads back as NaN; the table shows it as "n/a".
// Each (policy, budget) pair appears at most once.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kvbound {

// Metric names the evaluation engine writes.
namespace metric {
inline constexpr const char* kNll = "nll";                  // next-token NLL of the budgeted model, nats/token
inline constexpr const char* kKlToFull = "kl_to_full";      // KL(p_full || p_budgeted), nats/token
inline constexpr const char* kTop1Agree = "top1_agree";     // fraction of positions whose argmax matches full
inline constexpr const char* kRetrievalAcc = "retrieval_acc";  // key-value / passkey retrieval accuracy
inline constexpr const char* kPrefillTokS = "prefill_tok_s";   // prefill throughput, tokens/s
inline constexpr const char* kDecodeTokS = "decode_tok_s";     // decode throughput, tokens/s
inline constexpr const char* kPeakKvBytes = "peak_kv_bytes";   // peak bytes held by the KV cache (+mem: plus the memory state)
}  // namespace metric

struct ResultRow {
  std::string policy;
  std::int64_t budget = 0;  // KV budget M; 0 = unbounded (full cache)
  std::map<std::string, double> metrics;
};

struct EvalResults {
  nlohmann::json meta = nlohmann::json::object();  // model, config hash, settings, timestamps
  std::vector<ResultRow> rows;
};

// Writes the schema above to `path` atomically, creating its directory if needed.
// Throws kvbound::Error on an I/O failure or an invalid row (empty policy, negative budget, duplicate).
void write_results_json(const EvalResults& results, const std::string& path);

// Reads and validates a file written by write_results_json. Throws kvbound::Error
// "path: field: what is wrong" (e.g. "out/results.json: rows[3].budget: expected a non-negative integer").
EvalResults read_results_json(const std::string& path);

// Markdown report: a title with the meta entries, a quality table (KL to full, top-1 agreement, NLL,
// retrieval accuracy; one row per policy, one column group per budget, best value per column in bold),
// a cost table (prefill/decode tokens/s, peak KV MiB) laid out the same way, and a table of any other
// metrics the rows carry. A policy evaluated only unbounded (budget 0, e.g. `full`) is the reference: its
// values appear in italics under every budget and never compete for bold.
std::string results_markdown(const EvalResults& results);

}  // namespace kvbound
