#include "train/trainer.h"

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "checkpoints/atomic_file.h"
#include "checkpoints/errors.h"
#include "checkpoints/safetensors_io.h"
#include "eval/progress.h"
#include "checkpoints/run_checkpoint.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct EvalScore {
  double kl = 0, top1 = 0, nll = 0;
};

EvalScore evaluate(const Backbone& model, const TrainingMethod& method, const PeriodicEval& e) {
  const at::NoGradGuard no_grad;
  ContinuationTotals totals;
  for (const ContinuationReference& ref : e.references) {
    auto policy = method.eval_policy();
    run_continuation(model, *policy, e.budget, e.settings, ref, totals);
  }
  const double n = static_cast<double>(std::max<std::int64_t>(totals.scored, 1));
  return {totals.kl / n, totals.agree / n, totals.nll / n};
}

// Keeps the lines of metrics.jsonl up to `step` (a resumed run rewrites what came after its checkpoint),
// dropping a line a crash left half-written; rewritten atomically.
void truncate_metrics(const std::string& path, std::int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step")) continue;
    if (j["step"].get<std::int64_t>() > step) break;
    kept += line + "\n";
  }
  in.close();
  write_file_atomic(path, kept);
}

void check_finite(const std::string& run_dir, std::int64_t step, const std::string& what, double value,
                  const std::string& last_good) {
  if (std::isfinite(value)) return;
  std::ostringstream v;
  v << value;
  fail(run_dir, "step " + std::to_string(step) + ": " + what,
       "is " + v.str() + "; training stopped (last good checkpoint: " + (last_good.empty() ? "none" : last_good) + ")");
}

}  // namespace

TrainSummary train(const Backbone& model, TrainingMethod& method, const TrainingRows& rows, const TrainerSettings& s,
                   const PeriodicEval* eval) {
  if (s.steps < 1) fail("config", "train.steps", "must be >= 1");
  if (s.batch_size < 1) fail("config", "train.batch_size", "must be >= 1");
  if (s.grad_accum < 1) fail("config", "train.grad_accum", "must be >= 1");
  const std::map<std::string, at::Tensor> named = method.named_parameters();
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::vector<double> lr_scales;
  for (const auto& [name, p] : named) {
    names.push_back(name);
    params.push_back(p);
    lr_scales.push_back(method.lr_scale(name));
  }
  AdamW optimizer(params, s.adamw, lr_scales);
  DataPosition position;
  std::int64_t step = 0, tokens_seen = 0;
  TrainSummary summary;
  const std::string metrics_path = (fs::path(s.run_dir) / "metrics.jsonl").string();
  const std::string best_path = (fs::path(s.run_dir) / "best.safetensors").string();
  std::string last_good;

  if (s.resume) {
    const RunCheckpoint ck = load_latest_checkpoint(s.run_dir);
    last_good = latest_checkpoint_path(s.run_dir);
    if (ck.method != method.name()) fail(last_good, "__metadata__.method", "'" + ck.method + "' but this run trains " + method.name());
    // Weights the run started from (train.init_from) are part of its identity: a stage-1 run that moved on
    // since (a newer best.safetensors) would change the policy the rest of the run replays.
    for (const auto& [key, value] : method.metadata()) {
      if (key.rfind("init_from", 0) != 0) continue;
      const auto saved = ck.extra.find(key);
      const std::string was = saved == ck.extra.end() ? "(none)" : saved->second;
      if (was != value)
        fail(last_good, "train.init_from", key + " is now '" + value + "' but the run started from '" + was +
                                               "'; resume needs the same stage-1 weights");
    }
    {
      const at::NoGradGuard no_grad;
      for (std::size_t i = 0; i < names.size(); ++i) {
        const auto it = ck.tensors.find(names[i]);
        if (it == ck.tensors.end()) fail(last_good, names[i], "missing tensor");
        if (it->second.sizes() != params[i].sizes()) fail(last_good, names[i], "shape differs from this run's");
        params[i].copy_(it->second);
      }
    }
    optimizer.load_state(ck.tensors, names, ck.step, last_good);
    step = ck.step;
    position = {ck.epoch, ck.cursor};
    tokens_seen = ck.tokens_seen;
    truncate_metrics(metrics_path, step);
    if (fs::exists(best_path)) {
      const auto meta = read_safetensors(best_path).metadata;
      if (meta.count("eval_kl") && meta.count("step") && std::stoll(meta.at("step")) <= step) {
        summary.best_eval_kl = std::stod(meta.at("eval_kl"));
        summary.best_step = std::stoll(meta.at("step"));
      }
    }
    std::cerr << "[train] resumed " << s.run_dir << " at step " << step << " (epoch " << position.epoch << ", row "
              << position.cursor << ")\n";
  } else {
    std::ofstream(metrics_path, std::ios::trunc);
  }
  summary.first_step = step;
  std::ofstream metrics(metrics_path, std::ios::app);

  auto checkpoint = [&]() {
    RunCheckpoint ck;
    ck.step = step;
    ck.epoch = position.epoch;
    ck.cursor = position.cursor;
    ck.tokens_seen = tokens_seen;
    ck.method = method.name();
    ck.config_hash = s.config_hash;
    ck.extra = method.metadata();
    const at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < names.size(); ++i) ck.tensors[names[i]] = params[i].detach();
    for (auto& [k, v] : optimizer.state(names)) ck.tensors[k] = v;
    last_good = save_run_checkpoint(s.run_dir, ck, s.keep_checkpoints);
  };
  auto run_eval = [&]() {
    if (!eval || eval->references.empty()) return;
    const EvalScore e = evaluate(model, method, *eval);
    nlohmann::json j = {{"type", "eval"}, {"step", step}, {"budget", eval->budget}, {"kl", e.kl}, {"top1", e.top1}, {"nll", e.nll}};
    metrics << j.dump() << "\n" << std::flush;
    std::cerr << "[train] step " << step << ": eval M=" << eval->budget << " KL " << e.kl << " top-1 " << e.top1
              << " NLL " << e.nll << "\n";
    if (summary.best_eval_kl < 0 || e.kl < summary.best_eval_kl) {
      summary.best_eval_kl = e.kl;
      summary.best_step = step;
      std::map<std::string, std::string> meta = method.metadata();
      meta["step"] = std::to_string(step);
      meta["eval_kl"] = std::to_string(e.kl);
      meta["eval_budget"] = std::to_string(eval->budget);
      meta["config_hash"] = s.config_hash;
      std::map<std::string, at::Tensor> tensors;
      for (std::size_t i = 0; i < names.size(); ++i) tensors[names[i]] = params[i].detach();
      write_safetensors(best_path, tensors, meta);
    }
  };

  const std::int64_t end = s.stop_after > 0 ? std::min(s.steps, step + s.stop_after) : s.steps;
  ProgressBar bar("train " + method.name(), end - step);
  double train_seconds = 0;  // update steps only: evaluations and checkpoints are not training throughput
  std::int64_t tokens_this_run = 0;
  while (step < end) {
    const auto t0 = Clock::now();
    const double lr = scheduled_lr(step, s.steps, s.warmup, s.lr, s.min_lr);
    optimizer.zero_grad();
    std::map<std::string, double> term_sums, stat_sums;
    std::vector<double> per_layer;
    double loss_sum = 0;
    std::int64_t step_tokens = 0;
    for (std::int64_t micro = 0; micro < s.grad_accum; ++micro) {
      const Batch batch = rows.next(s.batch_size, position);
      const StepLoss loss = method.loss(batch);
      for (const auto& [term, value] : loss.terms) {
        const double v = value.item<double>();
        check_finite(s.run_dir, step + 1, "loss term " + term, v, last_good);
        term_sums[term] += v / static_cast<double>(s.grad_accum);
      }
      const double total = loss.total.item<double>();
      check_finite(s.run_dir, step + 1, "loss", total, last_good);
      loss_sum += total / static_cast<double>(s.grad_accum);
      (loss.total / static_cast<double>(s.grad_accum)).backward();
      for (const auto& [k, v] : loss.stats) stat_sums[k] += v / static_cast<double>(s.grad_accum);
      if (per_layer.empty()) per_layer.assign(loss.per_layer.size(), 0.0);
      for (std::size_t l = 0; l < loss.per_layer.size(); ++l) per_layer[l] += loss.per_layer[l] / static_cast<double>(s.grad_accum);
      step_tokens += batch.tokens;
    }
    const double grad_norm = clip_grad_norm(params, s.grad_clip);
    if (!std::isfinite(grad_norm)) {
      for (std::size_t i = 0; i < params.size(); ++i)
        if (params[i].grad().defined() && !std::isfinite(params[i].grad().sum().item<double>()))
          check_finite(s.run_dir, step + 1, "gradient of " + names[i], params[i].grad().sum().item<double>(), last_good);
      check_finite(s.run_dir, step + 1, "gradient norm", grad_norm, last_good);
    }
    optimizer.step(lr);
    ++step;
    tokens_seen += step_tokens;
    tokens_this_run += step_tokens;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    train_seconds += dt;
    summary.last_loss = loss_sum;
    if (s.log_every > 0 && (step % s.log_every == 0 || step == end)) {
      nlohmann::json j = {{"type", "train"}, {"step", step}, {"loss", loss_sum}, {"lr", lr}, {"grad_norm", grad_norm},
                          {"tokens", tokens_seen}, {"tokens_per_s", static_cast<double>(step_tokens) / dt}};
      for (const auto& [k, v] : term_sums) j[k] = v;
      for (const auto& [k, v] : stat_sums) j[k] = v;
      j[method.per_layer_name()] = per_layer;
      metrics << j.dump() << "\n" << std::flush;
    }
    std::ostringstream status;
    status.precision(4);
    status << "loss " << loss_sum;
    for (const auto& [k, v] : term_sums) status << " " << k << " " << v;
    bar.advance(1, status.str());
    if (eval && eval->every > 0 && step % eval->every == 0 && step < s.steps) run_eval();
    if (s.checkpoint_every > 0 && step % s.checkpoint_every == 0 && step < end) checkpoint();
  }
  bar.finish();
  if (step == s.steps && step > summary.first_step) run_eval();  // not again when resuming a finished run
  checkpoint();
  summary.last_step = step;
  summary.seconds = train_seconds;
  summary.tokens_per_second = summary.seconds > 0 ? static_cast<double>(tokens_this_run) / summary.seconds : 0;
  return summary;
}

}  // namespace kvbound
