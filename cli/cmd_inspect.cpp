// `kvbound inspect RUN_OR_EXPORT --text FILE [--out DIR] [--budget M] [--tokens N] [--model PATH]`: what a
// trained method's eviction policy does on one text. For TRIM-KV, a heatmap of every token's retention β per
// layer x KV head (retention.png); for any method, which positions each layer's cache holds after every decoded
// token at budget M (cache_layer<l>.png, a panel per KV head); and summary.md, printed too: per layer and head
// the share of steps the first token (the attention sink) is held, how much of the cache the M most recent
// tokens fill (1 = a sliding window) and the mean β; how long tokens of each kind stay (punctuation, newlines,
// capitalised words such as names, the rest); and the longest-lived tokens.
// With --layer-shares (TRIM-KV weights): instead, per-layer budget shares for `eval.layer_budget_shares` from the
// gates' scores on --windows windows of --text-part (eval/cache_inspection.h, gate_layer_shares), printed and
// written as layer_shares.yaml; no plots.
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cctype>
#include <cxxopts.hpp>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>

#include "cli/parse_arguments.h"
#include "base/build_options.h"
#include "base/atomic_file.h"
#include "base/errors.h"
#include "cli/command_schemas.h"
#include "cli/commands.h"
#include "cli/model_setup.h"
#include "data/text_windows.h"
#include "eval/cache_inspection.h"
#include "eval/heatmaps.h"
#include "modules/policies/registry.h"
#include "train/method_registry.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

std::string kind_of(const std::string& piece) {
  if (piece.find('\n') != std::string::npos) return "newline";
  std::string word;
  for (char c : piece)
    if (!std::isspace(static_cast<unsigned char>(c))) word += c;
  if (word.empty()) return "other";
  if (std::none_of(word.begin(), word.end(), [](unsigned char c) { return std::isalnum(c) || c >= 0x80; })) return "punctuation";
  if (std::isupper(static_cast<unsigned char>(word[0]))) return "capitalised";
  return "other";
}

std::string shown(std::string piece) {
  std::string out;
  for (char c : piece) out += c == '\n' ? std::string("\\n") : c == '|' ? std::string("\\|") : std::string(1, c);
  return "`" + out + "`";
}

std::string fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

}  // namespace

int cmd_inspect(int argc, char** argv) {
  cxxopts::Options o("kvbound inspect", "Show what a trained method's eviction policy keeps on a text: retention "
                                        "heatmaps (TRIM-KV), the cache over time, and the patterns it follows.");
  o.add_options()("weights", "a run folder of `kvbound train` (its best weights, else the latest) or an export",
                  cxxopts::value<std::string>())("text", "plain text to inspect", cxxopts::value<std::string>())(
      "o,out", "output folder", cxxopts::value<std::string>()->default_value("runs/inspect"))(
      "budget", "KV budget M (entries per layer and KV head)", cxxopts::value<std::int64_t>()->default_value("32"))(
      "tokens", "tokens of the text to decode (BOS included)", cxxopts::value<std::int64_t>()->default_value("192"))(
      "seed", "which paragraph of the text the window starts at", cxxopts::value<std::uint64_t>()->default_value("0"))(
      "model", "the backbone (default: the path the weights were trained on, checked by its content hash)",
      cxxopts::value<std::string>())("threads", "CPU threads (0 = every core this process may use)", cxxopts::value<int>()->default_value("0"))(
      "layer-shares", "derive eval.layer_budget_shares at --budget from the gates (TRIM-KV) instead of plotting")(
      "windows", "windows of --tokens tokens that --layer-shares reads", cxxopts::value<std::int64_t>()->default_value("16"))(
      "text-part", "FROM,TO: the share of the text's paragraphs the windows come from (keep the test part out)",
      cxxopts::value<std::vector<double>>()->default_value("0,1"))(
      "h,help", "show help");
  o.parse_positional({"weights"});
  o.positional_help("RUN_OR_EXPORT");
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  const bool layer_shares = r.count("layer-shares") > 0;
  if (!KVBOUND_WITH_PLOTS && !layer_shares)
    fail("kvbound inspect", "", "its heatmaps need cairo, and this kvbound was built without it (KVBOUND_WITH_PLOTS=OFF)");
  if (!r.count("weights")) fail("kvbound inspect", "RUN_OR_EXPORT", "missing (see --help)");
  if (!r.count("text")) fail("kvbound inspect", "--text", "missing");
  const std::int64_t budget = r["budget"].as<std::int64_t>(), length = r["tokens"].as<std::int64_t>();
  if (budget < 1) fail("--budget", "", "must be >= 1");
  if (length <= budget) fail("--tokens", "", "must exceed --budget, or nothing is ever evicted");
  const std::string weights = resolve_weights_path(r["weights"].as<std::string>(), "RUN_OR_EXPORT");
  const SafetensorsFile file = read_safetensors(weights);
  const auto meta = [&](const std::string& k) { return file.metadata.count(k) ? file.metadata.at(k) : std::string(); };
  const MethodRegistration& method = find_method(meta("method"), weights + ": __metadata__.method");

  // The backbone the weights were trained on: the recorded path unless --model names another copy; its
  // content must be the one the weights recorded.
  const std::string model_path = r.count("model") ? r["model"].as<std::string>() : meta("backbone_source");
  if (model_path.empty()) fail(weights, "__metadata__.backbone_source", "missing: pass --model");
  std::vector<std::string> sets{"model.path=" + yaml_quote(model_path),
                                "model.threads=" + std::to_string(r["threads"].as<int>())};
  ConfigSchema model_schema;
  add_model_keys(model_schema);
  const ConfiguredModel loaded = load_configured_model(Config::load(model_schema, "", sets));
  const Backbone& model = *loaded.model;
  if (!meta("backbone_hash").empty() && meta("backbone_hash") != model.content_hash())
    fail(model_path, "content", "is " + model.content_hash() + " but the weights were trained on " + meta("backbone") + " (" +
                                    meta("backbone_hash") + ")");

  const c10::InferenceMode no_grad;
  TrainedModules modules;
  method.load(file, weights, model, modules);
  const fs::path out = r["out"].as<std::string>();
  if (layer_shares) {
    const auto gates = modules.find<RetentionGates>();
    if (!gates) fail(weights, "__metadata__.method", "is " + meta("method") + ": --layer-shares needs TRIM-KV gates");
    const std::vector<double> part = r["text-part"].as<std::vector<double>>();
    if (part.size() != 2) fail("--text-part", "", "needs FROM,TO");
    const std::int64_t count = r["windows"].as<std::int64_t>();
    if (count < 1) fail("--windows", "", "must be >= 1");
    std::vector<at::Tensor> log_betas;
    for (const auto& w : TextWindows(r["text"].as<std::string>(), {part[0], part[1]}, "--text-part")
                             .sample(*loaded.tokenizer, count, length, r["seed"].as<std::uint64_t>()))
      log_betas.push_back(token_log_beta(model, *gates, at::tensor(w, at::TensorOptions().dtype(at::kLong))));
    std::ostringstream yaml, list;
    const std::vector<double> shares = gate_layer_shares(log_betas, budget);
    for (std::size_t l = 0; l < shares.size(); ++l) list << (l ? ", " : "") << fixed(shares[l], 3);
    yaml << "# kvbound inspect " << weights << " --layer-shares --budget " << budget << " --tokens " << length << " --windows "
         << count << " --text " << r["text"].as<std::string>() << " --text-part " << part[0] << "," << part[1] << " --seed "
         << r["seed"].as<std::uint64_t>() << "\neval:\n  layer_budget_shares: [" << list.str() << "]\n";
    fs::create_directories(out);
    write_file_atomic((out / "layer_shares.yaml").string(), yaml.str());
    std::cout << yaml.str();
    std::cerr << "[inspect] wrote " << (out / "layer_shares.yaml").string() << "\n";
    return 0;
  }
  const Config defaults = Config::load(train_schema(), "", {"data.train_text=unused"});
  const std::string policy_name = method.eval_policy(defaults);
  auto policy = make_policy(policy_name, defaults, modules);
  const std::vector<std::int64_t> window =
      TextWindows(r["text"].as<std::string>()).sample(*loaded.tokenizer, 1, length, r["seed"].as<std::uint64_t>()).front();
  const at::Tensor tokens = at::tensor(window, at::TensorOptions().dtype(at::kLong));
  fs::create_directories(out);
  std::vector<std::string> written;

  at::Tensor log_beta;
  if (const auto gates = modules.find<RetentionGates>()) {
    log_beta = token_log_beta(model, *gates, tokens);  // [L, Hkv, T]
    // β on the colour scale from its smallest to its largest value here (trained gates keep β in a narrow band).
    const double lo = log_beta.exp().min().item<double>(), hi = log_beta.exp().max().item<double>();
    std::vector<HeatmapRow> rows;
    for (std::int64_t l = 0; l < log_beta.size(0); ++l)
      for (std::int64_t h = 0; h < log_beta.size(1); ++h) {
        const at::Tensor beta = ((log_beta[l][h].exp() - lo) / std::max(hi - lo, 1e-12)).to(at::kDouble).contiguous();
        rows.push_back({"layer " + std::to_string(l) + " head " + std::to_string(h),
                        std::vector<double>(beta.data_ptr<double>(), beta.data_ptr<double>() + beta.numel())});
      }
    const std::string path = (out / "retention.png").string();
    write_heatmap(path, "Retention β of every token (" + model.name() + ", " + meta("method") + " step " + meta("step") + ")",
                  "token position", "β " + fixed(lo, 4), fixed(hi, 4), rows, 4, 12);
    written.push_back(path);
  }

  const CacheTimeline timeline = record_cache_timeline(model, *policy, budget, tokens);
  for (std::int64_t l = 0; l < timeline.layers; ++l) {
    std::vector<OccupancyPanel> panels;
    for (std::int64_t h = 0; h < timeline.heads; ++h)
      panels.push_back({"KV head " + std::to_string(h), timeline.held[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)]});
    const std::string path = (out / ("cache_layer" + std::to_string(l) + ".png")).string();
    write_occupancy(path, policy_name + " at M = " + std::to_string(budget) + ", layer " + std::to_string(l), panels, 2);
    written.push_back(path);
  }

  // The summary: head patterns, token kinds, the longest-lived tokens.
  std::ostringstream md;
  md << "# " << policy_name << " on " << tokens.size(0) << " tokens of " << r["text"].as<std::string>() << " at M = " << budget
     << "\n\nweights: " << weights << " (" << meta("method") << ", step " << meta("step") << "), backbone " << model.name()
     << "\n\n| layer | KV head | sink held | recent share | mean β |\n|---:|---:|---:|---:|---:|\n";
  const std::vector<HeadPattern> patterns = head_patterns(timeline, budget, log_beta);
  std::int64_t windows = 0, sinks = 0;
  for (const HeadPattern& p : patterns) {
    md << "| " << p.layer << " | " << p.head << " | " << fixed(p.sink_held, 2) << " | " << fixed(p.recent_share, 2) << " | "
       << (std::isfinite(p.mean_beta) ? fixed(p.mean_beta, 4) : "") << " |\n";
    windows += p.recent_share >= 0.9;
    sinks += p.sink_held >= 0.9;
  }
  md << "\n" << sinks << " of " << patterns.size() << " heads hold the first token (the attention sink) at >= 90% of the steps; "
     << windows << " act as sliding windows (the " << budget << " most recent tokens fill >= 90% of their cache).\n";
  const std::vector<double> life = token_lifetimes(timeline);
  std::map<std::string, std::pair<double, std::int64_t>> kinds;  // kind -> (lifetime share sum, count)
  std::vector<std::pair<double, std::size_t>> ranked;
  for (std::size_t i = 1; i + static_cast<std::size_t>(budget) < life.size(); ++i) {  // tokens that could outlive the budget
    const double remaining = static_cast<double>(life.size() - i);
    auto& k = kinds[kind_of(loaded.tokenizer->decode({window[i]}))];
    k.first += life[i] / remaining;
    ++k.second;
    ranked.emplace_back(life[i], i);
  }
  md << "\n| token kind | tokens | mean share of its remaining steps held |\n|:---|---:|---:|\n";
  for (const auto& [kind, v] : kinds) md << "| " << kind << " | " << v.second << " | " << fixed(v.first / v.second, 3) << " |\n";
  std::sort(ranked.rbegin(), ranked.rend());
  md << "\nLongest-lived tokens (steps held, mean over layers and heads):";
  for (std::size_t i = 0; i < std::min<std::size_t>(12, ranked.size()); ++i)
    md << " " << shown(loaded.tokenizer->decode({window[ranked[i].second]})) << "@" << ranked[i].second << " ("
       << fixed(ranked[i].first, 1) << ")";
  md << "\n";
  write_file_atomic((out / "summary.md").string(), md.str());
  std::cout << md.str();
  std::cerr << "[inspect] wrote " << (out / "summary.md").string();
  for (const std::string& w : written) std::cerr << ", " << fs::path(w).filename().string();
  std::cerr << "\n";
  return 0;
}

}  // namespace kvbound
