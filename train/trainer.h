// The training loop shared by the learned methods: AdamW, warm-up + cosine, gradient accumulation,
// a gradient-reduce step (data parallelism) and clipping, a hard stop on NaN/inf, and checkpoints with
// bit-identical resume (train/run_state.h). What happens around a step — metrics.jsonl, the progress line,
// the periodic budgeted eval that picks the best weights — are callbacks (train/callbacks.h).
//
//   Trainer trainer(method, rows, settings, run_state);
//   trainer.add_callback(&metrics);            // in the order they should run after every step
//   TrainSummary summary = trainer.run();      // resume (settings.resume), steps, final checkpoint
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "data/training_rows.h"
#include "train/optimizer.h"
#include "train/run_state.h"
#include "train/training_method.h"

namespace kvbound {

struct TrainerSettings {
  std::int64_t steps = 100, batch_size = 8, grad_accum = 1, warmup = 10;
  double lr = 2e-3, min_lr = 0.0, grad_clip = 1.0;
  AdamWSettings adamw;
  std::int64_t checkpoint_every = 50;
  bool resume = false;          // continue from the run folder's latest checkpoint (the caller checks it is the same run)
  std::int64_t stop_after = 0;  // > 0: stop after this many updates in this invocation (checkpointing first)
  Shard shard;                  // this process's share of every global batch (data parallelism); rank 0 writes
};

// What one update did; callbacks log it.
struct StepReport {
  std::int64_t step = 0;         // updates done, this one included
  double loss = 0, lr = 0, grad_norm = 0;
  double seconds = 0;            // wall time of the update
  std::int64_t tokens = 0;       // weighted positions of this update (this process's shard)
  std::int64_t tokens_seen = 0;  // since the run began
  std::map<std::string, double> terms, stats;  // loss terms and the method's extra numbers, averaged over micro-batches
  std::vector<double> per_layer;
};

struct TrainSummary {
  std::int64_t first_step = 0, last_step = 0;
  double seconds = 0, tokens_per_second = 0;  // update steps only: evaluations and checkpoints excluded
  double last_loss = 0;
};

// What a data-parallel run (train/data_parallel.h) adds to the loop: the same starting weights on every
// process, the gradients averaged over the processes between backward and clipping, and each step's report
// averaged (tokens summed) so that rank 0 logs — and every rank checks for NaN — the global step. Without
// one the trainer runs alone (world 1).
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  virtual void synchronize(const std::vector<at::Tensor>& params) = 0;
  virtual void reduce(const std::vector<at::Tensor>& params) = 0;
  virtual void reduce_report(StepReport& report) = 0;
};

class Trainer;

class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  // Before the first update of this invocation (after resume).
  virtual void on_start(const Trainer& trainer) { (void)trainer; }
  // After every update, before the trainer's periodic checkpoint.
  virtual void on_step(const Trainer& trainer, const StepReport& report) { (void)trainer; (void)report; }
  // After the last update of this invocation, before the final checkpoint.
  virtual void on_end(const Trainer& trainer) { (void)trainer; }
};

class Trainer {
 public:
  // kvbound::Error naming the config key for a bad setting.
  Trainer(TrainingMethod& method, const TrainingRows& rows, const TrainerSettings& settings, RunState& run,
          GradientReducer* reducer = nullptr);

  void add_callback(TrainerCallback* callback) { callbacks_.push_back(callback); }

  // Restores the run's latest checkpoint (weights, optimizer moments, data position).
  void resume();
  // One update: grad_accum micro-batches (loss, NaN check, backward), the gradient reduce, clipping, AdamW.
  // Throws kvbound::Error for a NaN/inf loss term or gradient ("RUN_DIR: step N: term: ...; last good
  // checkpoint ..."), leaving the run folder's checkpoints as they were.
  StepReport step();
  // Resumes when asked, runs the updates of this invocation (all of train.steps, or stop_after) with the
  // callbacks and periodic checkpoints, then the final checkpoint.
  TrainSummary run();

  const TrainingMethod& method() const { return method_; }
  const TrainerSettings& settings() const { return settings_; }
  const RunState& run_state() const { return run_; }
  const RunProgress& progress() const { return progress_; }
  // The update this invocation stops after.
  std::int64_t end_step() const;

 private:
  void checkpoint();

  TrainingMethod& method_;
  const TrainingRows& rows_;
  TrainerSettings settings_;
  RunState& run_;
  GradientReducer* reducer_;
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  AdamW optimizer_;
  RunProgress progress_;
  std::vector<TrainerCallback*> callbacks_;
};

}  // namespace kvbound
