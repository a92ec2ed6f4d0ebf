#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include "base/errors.h"

namespace kvbound {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> names_of(const TrainingMethod& method) {
  std::vector<std::string> names;
  for (const auto& [name, p] : method.named_parameters()) names.push_back(name);
  return names;
}

std::vector<at::Tensor> params_of(const TrainingMethod& method) {
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : method.named_parameters()) params.push_back(p);
  return params;
}

std::vector<double> lr_scales_of(const TrainingMethod& method) {
  std::vector<double> scales;
  for (const auto& [name, p] : method.named_parameters()) scales.push_back(method.lr_scale(name));
  return scales;
}

void check_finite(const RunState& run, std::int64_t step, const std::string& what, double value) {
  if (std::isfinite(value)) return;
  const std::string shown = std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf";  // a NaN's sign means nothing
  fail(run.run_dir(), "step " + std::to_string(step) + ": " + what,
       "is " + shown + "; training stopped (last good checkpoint: " +
           (run.last_good().empty() ? "none" : run.last_good()) + ")");
}

}  // namespace

Trainer::Trainer(TrainingMethod& method, const TrainingRows& rows, const TrainerSettings& settings, RunState& run,
                 GradientReducer* reducer)
    : method_(method), rows_(rows), settings_(settings), run_(run), reducer_(reducer), names_(names_of(method)),
      params_(params_of(method)), optimizer_(params_, settings.adamw, lr_scales_of(method)) {
  if (settings.steps < 1) fail("config", "train.steps", "must be >= 1");
  if (settings.batch_size < 1) fail("config", "train.batch_size", "must be >= 1");
  if (settings.grad_accum < 1) fail("config", "train.grad_accum", "must be >= 1");
}

std::int64_t Trainer::end_step() const {
  return settings_.stop_after > 0 ? std::min(settings_.steps, progress_.step + settings_.stop_after) : settings_.steps;
}

void Trainer::resume() { progress_ = run_.resume(method_, names_, params_, optimizer_); }

void Trainer::checkpoint() {
  if (settings_.shard.rank == 0) run_.save_checkpoint(progress_, method_, names_, params_, optimizer_);
}

StepReport Trainer::step() {
  const TrainerSettings& s = settings_;
  const auto t0 = Clock::now();
  StepReport report;
  report.lr = scheduled_lr(progress_.step, s.steps, s.warmup, s.lr, s.min_lr);
  const std::int64_t next = progress_.step + 1;
  const auto accum = static_cast<double>(s.grad_accum);  // each micro-batch counts 1/accum of the update
  optimizer_.zero_grad();
  for (std::int64_t micro = 0; micro < s.grad_accum; ++micro) {
    const Batch batch = rows_.next(s.batch_size, progress_.position, s.shard).to(params_.front().device());
    const StepLoss loss = method_.loss(batch);
    for (const auto& [term, value] : loss.terms) report.terms[term] += value.item<double>() / accum;
    report.loss += loss.total.item<double>() / accum;
    (loss.total / accum).backward();
    for (const auto& [k, v] : loss.stats) report.stats[k] += v / accum;
    if (report.per_layer.empty()) report.per_layer.assign(loss.per_layer.size(), 0.0);
    for (std::size_t l = 0; l < loss.per_layer.size(); ++l) report.per_layer[l] += loss.per_layer[l] / accum;
    report.tokens += batch.tokens;
  }
  // With other processes, the global step's numbers: a NaN on any rank stops every rank at the same check.
  if (reducer_) reducer_->reduce_report(report);
  for (const auto& [term, value] : report.terms) check_finite(run_, next, "loss term " + term, value);
  check_finite(run_, next, "loss", report.loss);
  if (reducer_) reducer_->reduce(params_);
  report.grad_norm = clip_grad_norm(params_, s.grad_clip);
  if (!std::isfinite(report.grad_norm)) {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].grad().defined())
        check_finite(run_, next, "gradient of " + names_[i], params_[i].grad().sum().item<double>());
    check_finite(run_, next, "gradient norm", report.grad_norm);
  }
  optimizer_.step(report.lr);
  progress_.step = next;
  progress_.tokens_seen += report.tokens;
  report.step = progress_.step;
  report.tokens_seen = progress_.tokens_seen;
  report.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return report;
}

TrainSummary Trainer::run() {
  if (settings_.resume) resume();
  if (reducer_) reducer_->synchronize(params_);  // every rank starts from rank 0's weights
  TrainSummary summary;
  summary.first_step = progress_.step;
  for (TrainerCallback* c : callbacks_) c->on_start(*this);
  const std::int64_t end = end_step();
  std::int64_t tokens_this_run = 0;
  while (progress_.step < end) {
    const StepReport report = step();
    summary.seconds += report.seconds;  // update steps only: evaluations and checkpoints are not throughput
    tokens_this_run += report.tokens;
    summary.last_loss = report.loss;
    for (TrainerCallback* c : callbacks_) c->on_step(*this, report);
    if (settings_.checkpoint_every > 0 && progress_.step % settings_.checkpoint_every == 0 && progress_.step < end)
      checkpoint();
  }
  for (TrainerCallback* c : callbacks_) c->on_end(*this);
  checkpoint();
  summary.last_step = progress_.step;
  summary.tokens_per_second = summary.seconds > 0 ? static_cast<double>(tokens_this_run) / summary.seconds : 0;
  return summary;
}

}  // namespace kvbound
