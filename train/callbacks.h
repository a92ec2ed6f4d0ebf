// What runs around the trainer's steps (train/trainer.h): metrics.jsonl, the progress line, and the
// periodic budgeted evaluation that picks the best weights (the engine's KL to the full cache: the soft
// training loss flattens long before budgeted quality does). In a data-parallel run only rank 0 has them.
#pragma once
#include <cstdint>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/progress.h"
#include "eval/continuation.h"
#include "modules/backbone.h"
#include "train/tensorboard/event_writer.h"
#include "train/trainer.h"

namespace kvbound {

// Where the logged lines also go (TensorBoard): each sink sees every line metrics.jsonl gets, and at the start
// of a run the lines a resumed run kept, so it can rebuild what it holds.
class MetricsSink {
 public:
  virtual ~MetricsSink() = default;
  // Called once, before any write(), with the lines kept from before (none for a fresh run).
  virtual void start(const std::vector<nlohmann::json>& kept) = 0;
  virtual void write(const nlohmann::json& line) = 0;
};

// metrics.jsonl: one line per logged update ("type": "train": loss and its terms, lr, grad norm, tokens,
// tokens/s, the method's stats and per-layer numbers) and whatever other callbacks write ("type": "eval").
// A fresh run starts the file empty; a resumed one keeps the lines up to its checkpoint's step (dropping a
// line a crash left half-written; rewritten atomically). Every line also goes to the sinks.
class MetricsLog final : public TrainerCallback {
 public:
  MetricsLog(std::string path, std::int64_t every);
  void add_sink(MetricsSink* sink) { sinks_.push_back(sink); }
  void on_start(const Trainer& trainer) override;
  void on_step(const Trainer& trainer, const StepReport& report) override;
  void write(const nlohmann::json& line);

 private:
  std::string path_;
  std::int64_t every_;
  std::ofstream out_;
  std::vector<MetricsSink*> sinks_;
};

// TensorBoard event files in RUN_DIR/tensorboard (train/tensorboard/event_writer.h): every number of every
// line as a scalar tagged "<type>/<name>" at the line's step, per-layer lists as "<type>/<name>/layer_<i>",
// and the eval line's histograms ("hist": {name: [per-layer histogram objects]}) as "<name>/layer_<i>". A
// resumed run rewrites the folder from the lines metrics.jsonl kept, so both tell the same history.
class TensorBoardSink final : public MetricsSink {
 public:
  explicit TensorBoardSink(std::string dir) : dir_(std::move(dir)) {}
  void start(const std::vector<nlohmann::json>& kept) override;
  void write(const nlohmann::json& line) override;

 private:
  std::string dir_;
  std::unique_ptr<EventWriter> writer_;
};

// The progress line: "train trimkv [####...] 12/200 ... loss 3.21 kl 0.5 ...".
class ProgressLine final : public TrainerCallback {
 public:
  void on_start(const Trainer& trainer) override;
  void on_step(const Trainer& trainer, const StepReport& report) override;
  void on_end(const Trainer& trainer) override;

 private:
  std::unique_ptr<ProgressBar> bar_;
};

struct PeriodicEvalSettings {
  std::vector<ContinuationReference> references;  // held-out windows with their full-cache log-probs
  ContinuationSettings continuation;
  std::int64_t budget = 128;  // the deployment budget M
  std::int64_t every = 0;     // updates between evaluations (0: only at the end)
};

// Every `every` updates and at the end of the run: the method's eval policy at `budget` on the held-out
// windows (KL to the full cache, top-1 agreement, NLL), one "eval" line in metrics.jsonl, and the weights in
// best.safetensors whenever the KL is the lowest so far.
class PeriodicEval final : public TrainerCallback {
 public:
  PeriodicEval(const Backbone& model, PeriodicEvalSettings settings, MetricsLog& metrics, RunState& run);
  void on_start(const Trainer& trainer) override;
  void on_step(const Trainer& trainer, const StepReport& report) override;
  void on_end(const Trainer& trainer) override;
  const std::optional<BestEval>& best() const { return best_; }
  std::int64_t budget() const { return settings_.budget; }

 private:
  void evaluate(const Trainer& trainer);

  const Backbone& model_;
  PeriodicEvalSettings settings_;
  MetricsLog& metrics_;
  RunState& run_;
  std::int64_t first_step_ = 0;
  std::optional<BestEval> best_;
};

}  // namespace kvbound
