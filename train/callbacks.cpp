#include "train/callbacks.h"

#include <ATen/core/grad_mode.h>

#include <iostream>
#include <sstream>

#include "base/atomic_file.h"

namespace kvbound {
namespace {

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

}  // namespace

MetricsLog::MetricsLog(std::string path, std::int64_t every) : path_(std::move(path)), every_(every) {}

void MetricsLog::on_start(const Trainer& trainer) {
  if (trainer.settings().resume) {
    truncate_metrics(path_, trainer.progress().step);
  } else {
    std::ofstream(path_, std::ios::trunc);
  }
  out_.open(path_, std::ios::app);
}

void MetricsLog::on_step(const Trainer& trainer, const StepReport& r) {
  if (every_ <= 0 || (r.step % every_ != 0 && r.step != trainer.end_step())) return;
  nlohmann::json j = {{"type", "train"}, {"step", r.step},     {"loss", r.loss},         {"lr", r.lr},
                      {"grad_norm", r.grad_norm}, {"tokens", r.tokens_seen}, {"tokens_per_s", static_cast<double>(r.tokens) / r.seconds}};
  for (const auto& [k, v] : r.terms) j[k] = v;
  for (const auto& [k, v] : r.stats) j[k] = v;
  j[trainer.method().per_layer_name()] = r.per_layer;
  write(j);
}

void MetricsLog::write(const nlohmann::json& line) { out_ << line.dump() << "\n" << std::flush; }

void ProgressLine::on_start(const Trainer& trainer) {
  bar_ = std::make_unique<ProgressBar>("train " + trainer.method().name(), trainer.end_step() - trainer.progress().step);
}

void ProgressLine::on_step(const Trainer&, const StepReport& r) {
  std::ostringstream status;
  status.precision(4);
  status << "loss " << r.loss;
  for (const auto& [k, v] : r.terms) status << " " << k << " " << v;
  bar_->advance(1, status.str());
}

void ProgressLine::on_end(const Trainer&) { bar_->finish(); }

PeriodicEval::PeriodicEval(const Backbone& model, PeriodicEvalSettings settings, MetricsLog& metrics, RunState& run)
    : model_(model), settings_(std::move(settings)), metrics_(metrics), run_(run) {}

void PeriodicEval::on_start(const Trainer& trainer) {
  first_step_ = trainer.progress().step;
  best_ = run_.best_eval(first_step_);
}

void PeriodicEval::on_step(const Trainer& trainer, const StepReport& r) {
  if (settings_.every > 0 && r.step % settings_.every == 0 && r.step < trainer.settings().steps) evaluate(trainer);
}

void PeriodicEval::on_end(const Trainer& trainer) {
  const std::int64_t step = trainer.progress().step;
  if (step == trainer.settings().steps && step > first_step_) evaluate(trainer);  // not again when resuming a finished run
}

void PeriodicEval::evaluate(const Trainer& trainer) {
  if (settings_.references.empty()) return;
  const std::int64_t step = trainer.progress().step;
  ContinuationTotals totals;
  {
    const at::NoGradGuard no_grad;
    for (const ContinuationReference& ref : settings_.references) {
      auto policy = trainer.method().eval_policy();
      run_continuation(model_, *policy, settings_.budget, settings_.continuation, ref, totals);
    }
  }
  const double n = static_cast<double>(std::max<std::int64_t>(totals.scored, 1));
  const double kl = totals.kl / n, top1 = totals.agree / n, nll = totals.nll / n;
  metrics_.write({{"type", "eval"}, {"step", step}, {"budget", settings_.budget}, {"kl", kl}, {"top1", top1}, {"nll", nll}});
  std::cerr << "[train] step " << step << ": eval M=" << settings_.budget << " KL " << kl << " top-1 " << top1 << " NLL "
            << nll << "\n";
  if (!best_ || kl < best_->kl) {
    best_ = BestEval{step, kl};
    run_.save_best(*best_, settings_.budget, trainer.method());
  }
}

}  // namespace kvbound
