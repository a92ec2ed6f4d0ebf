#include "train/callbacks.h"

#include <ATen/core/grad_mode.h>

#include <filesystem>
#include <iostream>
#include <sstream>

#include "base/atomic_file.h"

namespace kvbound {
namespace {

// Keeps the lines of metrics.jsonl up to `step` (a resumed run rewrites what came after its checkpoint),
// dropping a line a crash left half-written; rewritten atomically. Returns the lines kept.
std::vector<nlohmann::json> truncate_metrics(const std::string& path, std::int64_t step) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  if (!in) return lines;
  std::string kept, line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step")) continue;
    if (j["step"].get<std::int64_t>() > step) break;
    kept += line + "\n";
    lines.push_back(std::move(j));
  }
  in.close();
  write_file_atomic(path, kept);
  return lines;
}

Histogram histogram_of(const nlohmann::json& j) {
  Histogram h;
  h.min = j.at("min").get<double>();
  h.max = j.at("max").get<double>();
  h.num = j.at("num").get<double>();
  h.sum = j.at("sum").get<double>();
  h.sum_squares = j.at("sum_squares").get<double>();
  h.bucket_limit = j.at("bucket_limit").get<std::vector<double>>();
  h.bucket = j.at("bucket").get<std::vector<double>>();
  return h;
}

}  // namespace

MetricsLog::MetricsLog(std::string path, std::int64_t every) : path_(std::move(path)), every_(every) {}

void MetricsLog::on_start(const Trainer& trainer) {
  std::vector<nlohmann::json> kept;
  if (trainer.settings().resume) {
    kept = truncate_metrics(path_, trainer.progress().step);
  } else {
    std::ofstream(path_, std::ios::trunc);
  }
  out_.open(path_, std::ios::app);
  for (MetricsSink* sink : sinks_) sink->start(kept);
}

void MetricsLog::on_step(const Trainer& trainer, const StepReport& r) {
  if (every_ <= 0 || (r.step % every_ != 0 && r.step != trainer.end_step())) return;
  nlohmann::json j = {{"type", "train"}, {"step", r.step},     {"loss", r.loss},         {"lr", r.lr},
                      {"grad_norm", r.grad_norm}, {"tokens", r.tokens_seen}, {"tokens_per_s", static_cast<double>(r.tokens) / r.seconds}};
  for (const auto& [k, v] : r.terms) j[k] = v;
  for (const auto& [k, v] : r.stats) j[k] = v;
  if (!r.per_layer.empty()) j[trainer.method().per_layer_name()] = r.per_layer;  // a loss may have no per-layer term
  write(j);
}

void MetricsLog::write(const nlohmann::json& line) {
  out_ << line.dump() << "\n" << std::flush;
  for (MetricsSink* sink : sinks_) sink->write(line);
}

void TensorBoardSink::start(const std::vector<nlohmann::json>& kept) {
  std::filesystem::remove_all(dir_);
  writer_ = std::make_unique<EventWriter>(dir_);
  for (const nlohmann::json& line : kept) write(line);
}

void TensorBoardSink::write(const nlohmann::json& line) {
  const std::string type = line.value("type", "train");
  const std::int64_t step = line.at("step").get<std::int64_t>();
  for (const auto& [name, value] : line.items()) {
    if (name == "type" || name == "step") continue;
    if (value.is_number()) {
      writer_->scalar(type + "/" + name, step, value.get<double>());
    } else if (value.is_array()) {
      for (std::size_t l = 0; l < value.size(); ++l)
        if (value[l].is_number()) writer_->scalar(type + "/" + name + "/layer_" + std::to_string(l), step, value[l].get<double>());
    } else if (name == "hist" && value.is_object()) {
      for (const auto& [hist_name, layers] : value.items())
        for (std::size_t l = 0; l < layers.size(); ++l)
          writer_->histogram(hist_name + "/layer_" + std::to_string(l), step, histogram_of(layers[l]));
    }
  }
}

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
  nlohmann::json line = {{"type", "eval"}, {"step", step}, {"budget", settings_.budget}, {"kl", kl}, {"top1", top1}, {"nll", nll}};
  // What the method's modules compute on the held-out windows (TRIM-KV: log β per layer), as histograms.
  std::vector<at::Tensor> windows;
  for (const ContinuationReference& ref : settings_.references) windows.push_back(ref.tokens);
  for (const auto& [name, per_layer] : trainer.method().distributions(model_, windows)) {
    nlohmann::json layers = nlohmann::json::array();
    for (const at::Tensor& values : per_layer) {
      const at::Tensor flat = values.detach().to(at::kCPU, at::kDouble).contiguous().view(-1);
      const Histogram h = make_histogram(std::vector<double>(flat.data_ptr<double>(), flat.data_ptr<double>() + flat.numel()));
      layers.push_back({{"min", h.min}, {"max", h.max}, {"num", h.num}, {"sum", h.sum}, {"sum_squares", h.sum_squares},
                        {"bucket_limit", h.bucket_limit}, {"bucket", h.bucket}});
    }
    line["hist"][name] = std::move(layers);
  }
  metrics_.write(line);
  std::cerr << "[train] step " << step << ": eval M=" << settings_.budget << " KL " << kl << " top-1 " << top1 << " NLL "
            << nll << "\n";
  if (!best_ || kl < best_->kl) {
    best_ = BestEval{step, kl};
    run_.save_best(*best_, settings_.budget, trainer.method());
  }
}

}  // namespace kvbound
