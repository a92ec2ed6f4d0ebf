// The training loop shared by the learned methods: AdamW, warm-up + cosine, gradient accumulation and
// clipping, metrics.jsonl, a progress bar, periodic budgeted evaluation (the engine's KL to the full cache,
// which is what picks checkpoints: the soft training loss flattens long before budgeted quality does),
// atomic checkpoints with bit-identical resume, and a hard stop on NaN/inf.
//
// Run folder (settings.run_dir):
//   config.yaml        the resolved config (written by the command)
//   metrics.jsonl      one JSON object per logged step ("type": "train") and per evaluation ("type": "eval")
//   checkpoints/       step_*.safetensors + LATEST (checkpoints/run_checkpoint.h)
//   best.safetensors   the trainable tensors at the best periodic eval (lowest KL), with its step and KL
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "eval/continuation.h"
#include "modules/backbone.h"
#include "train/optimizer.h"
#include "train/train_data.h"
#include "train/training_method.h"

namespace kvbound {

struct PeriodicEval {
  std::vector<ContinuationReference> references;  // held-out windows with their full-cache log-probs
  ContinuationSettings settings;
  std::int64_t budget = 128;  // the deployment budget M
  std::int64_t every = 0;     // steps between evaluations (0: only at the end)
};

struct TrainerSettings {
  std::string run_dir;
  std::string config_hash;
  std::int64_t steps = 100, batch_size = 8, grad_accum = 1, warmup = 10;
  double lr = 2e-3, min_lr = 0.0, grad_clip = 1.0;
  AdamWSettings adamw;
  std::int64_t log_every = 1, checkpoint_every = 50, keep_checkpoints = 3;
  bool resume = false;         // continue from run_dir's latest checkpoint (the caller checks it is the same run)
  std::int64_t stop_after = 0; // > 0: stop after this many updates in this invocation (checkpointing first)
};

struct TrainSummary {
  std::int64_t first_step = 0, last_step = 0;
  double seconds = 0, tokens_per_second = 0;
  double last_loss = 0;
  double best_eval_kl = -1;  // -1: no evaluation ran
  std::int64_t best_step = -1;
};

// Throws kvbound::Error for a NaN/inf loss term or gradient ("RUN_DIR: step N: term: ...; last good
// checkpoint ..."), leaving the run folder's checkpoints as they were.
TrainSummary train(const Backbone& model, TrainingMethod& method, const TrainingRows& rows,
                   const TrainerSettings& settings, const PeriodicEval* eval);

}  // namespace kvbound
