// `kvbound generate [--model PATH] [--prompt TEXT]`: continues a prompt with the frozen backbone under a
// full KV cache; the continuation alone goes to stdout, diagnostics to stderr.
// `kvbound generate --prompts FILE --samples N --out FILE.jsonl`: N sampled continuations of every prompt of FILE
// (one per line), decoded together as one batch per prompt, written as JSON lines {"prompt", "text"} (text =
// prompt + continuation), e.g. distillation text for `kvbound prepare`.
#include <ATen/ops/tensor.h>
#include <c10/core/InferenceMode.h>

#include <cxxopts.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/parse_arguments.h"
#include "base/atomic_file.h"
#include "base/errors.h"
#include "cli/commands.h"
#include "cli/model_setup.h"
#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "modules/sampler.h"

namespace kvbound {

namespace {

std::vector<std::int64_t> prompt_ids(const Tokenizer& tokenizer, const std::string& prompt, const std::string& tok_path) {
  std::vector<std::int64_t> ids = tokenizer.encode(prompt, /*add_bos=*/prompt.empty() || tokenizer.adds_bos());
  if (ids.empty()) {
    if (tokenizer.bos_id() < 0) fail(tok_path, "bos", "an empty prompt needs a BOS token and this tokenizer has none");
    ids.push_back(tokenizer.bos_id());
  }
  return ids;
}

std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(path, "--prompts", "cannot read the file");
  std::vector<std::string> prompts;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") != std::string::npos) prompts.push_back(line);
  }
  if (prompts.empty()) fail(path, "--prompts", "holds no prompt (one per line)");
  return prompts;
}

// Every prompt's `samples` continuations, decoded as one batch (row r samples with seed + its global index, so
// the output does not depend on how rows are batched); a row ends at EOS or BOS.
std::string sample_prompts(const Backbone& model, const Tokenizer& tokenizer, const std::string& tok_path,
                           const std::vector<std::string>& prompts, std::int64_t samples, int max_new,
                           const SamplingOptions& options) {
  std::ostringstream out;
  std::int64_t written = 0, new_tokens = 0;
  for (std::size_t p = 0; p < prompts.size(); ++p) {
    const std::vector<std::int64_t> ids = prompt_ids(tokenizer, prompts[p], tok_path);
    std::vector<Sampler> samplers;
    for (std::int64_t r = 0; r < samples; ++r) {
      SamplingOptions row = options;
      row.seed = options.seed + static_cast<std::uint64_t>(p * samples + r);
      samplers.emplace_back(row);
    }
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(samples), ids);
    std::vector<bool> ended(static_cast<std::size_t>(samples), false);
    KVCache cache = model.make_cache();
    at::Tensor step_input =
        at::tensor(ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).expand({samples, -1}).contiguous();
    for (int i = 0; i < max_new; ++i) {
      const at::Tensor last = model.forward(step_input, cache).select(1, -1).cpu();  // [samples, vocab]
      std::vector<std::int64_t> next(static_cast<std::size_t>(samples), tokenizer.eos_id() >= 0 ? tokenizer.eos_id() : 0);
      bool any = false;
      for (std::int64_t r = 0; r < samples; ++r) {
        const auto ru = static_cast<std::size_t>(r);
        if (ended[ru]) continue;
        const std::int64_t token = samplers[ru].next(last[r]);
        if (token == tokenizer.eos_id() || token == tokenizer.bos_id()) {
          ended[ru] = true;
          continue;
        }
        rows[ru].push_back(token);
        next[ru] = token;
        any = true;
      }
      if (!any) break;
      step_input = at::tensor(next, at::TensorOptions().dtype(at::kLong)).unsqueeze(1);
    }
    for (const auto& row : rows) {
      // Sampled byte-fallback pieces can end a row inside a character or string bytes that are no UTF-8; JSON
      // holds only UTF-8, so such bytes become U+FFFD (what `prepare` reads is then what the line shows).
      out << nlohmann::json{{"prompt", prompts[p]}, {"text", tokenizer.decode(row)}}.dump(
                 -1, ' ', false, nlohmann::json::error_handler_t::replace)
          << "\n";
      new_tokens += static_cast<std::int64_t>(row.size() - ids.size());
      ++written;
    }
    std::cerr << "[generate] prompt " << p + 1 << "/" << prompts.size() << ": " << samples << " samples\n";
  }
  std::cerr << "[generate] " << written << " samples, " << new_tokens << " new tokens\n";
  return out.str();
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  cxxopts::Options o("kvbound generate",
                     "Continue a prompt with the backbone (full KV cache). The continuation alone goes to stdout.");
  add_model_options(o);
  o.add_options()("tokenizer", "tokenizer file (default: the one beside --model)", cxxopts::value<std::string>())(
      "prompt", "prompt text (empty: start from BOS)", cxxopts::value<std::string>()->default_value(""))(
      "max-new-tokens", "tokens to generate", cxxopts::value<int>()->default_value("64"))(
      "temperature", "0 = greedy", cxxopts::value<double>()->default_value("0"))(
      "top-p", "nucleus sampling mass", cxxopts::value<double>()->default_value("1"))(
      "seed", "sampling seed", cxxopts::value<std::uint64_t>()->default_value("0"))(
      "prompts", "a file of prompts, one per line: sample each --samples times into --out (JSON lines)",
      cxxopts::value<std::string>())("samples", "continuations per prompt, decoded as one batch",
                                     cxxopts::value<std::int64_t>()->default_value("1"))(
      "out", "with --prompts: the .jsonl file to write ({\"prompt\", \"text\"} per sample)", cxxopts::value<std::string>());
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  const c10::InferenceMode no_autograd;  // generation never needs gradients: skip autograd bookkeeping
  const std::string model_path = r["model"].as<std::string>();
  const int max_new = r["max-new-tokens"].as<int>();
  if (max_new < 0) fail("--max-new-tokens", "", "must be >= 0");
  const SamplingOptions sampling{r["temperature"].as<double>(), r["top-p"].as<double>(), r["seed"].as<std::uint64_t>()};
  Sampler sampler(sampling);
  const std::int64_t samples = r["samples"].as<std::int64_t>();
  if (samples < 1) fail("--samples", "", "must be >= 1");
  if (r.count("prompts") != r.count("out")) fail(r.count("prompts") ? "--out" : "--prompts", "", "--prompts and --out go together");
  if (r.count("prompts") && r.count("prompt")) fail("--prompt", "", "give --prompt or --prompts, not both");
  if (!r.count("prompts") && samples != 1) fail("--samples", "", "needs --prompts and --out");
  const std::string tok_path = r.count("tokenizer") ? r["tokenizer"].as<std::string>() : find_tokenizer_beside(model_path);
  const auto tokenizer = load_tokenizer(tok_path);
  const auto model = load_backbone_from_options(r);
  if (tokenizer->vocab_size() > model->config().vocab_size)
    fail(tok_path, "vocab_size", std::to_string(tokenizer->vocab_size()) + " tokens but the model has " +
                                     std::to_string(model->config().vocab_size));

  if (r.count("prompts")) {
    const std::vector<std::string> prompts = read_prompts(r["prompts"].as<std::string>());
    const std::string jsonl = sample_prompts(*model, *tokenizer, tok_path, prompts, samples, max_new, sampling);
    write_file_atomic(r["out"].as<std::string>(), jsonl);  // all or nothing
    std::cerr << "[generate] wrote " << r["out"].as<std::string>() << "\n";
    return 0;
  }
  const std::string prompt = r["prompt"].as<std::string>();
  std::vector<std::int64_t> ids = prompt_ids(*tokenizer, prompt, tok_path);
  std::cerr << "[generate] " << model->config().architecture << " " << model->config().num_layers << " layers, prompt "
            << ids.size() << " tokens\n";
  KVCache cache = model->make_cache();
  const std::size_t prompt_len = ids.size();
  std::size_t printed = tokenizer->decode(ids).size();
  at::Tensor step_input = at::tensor(ids, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  for (int i = 0; i < max_new; ++i) {
    const at::Tensor logits = model->forward(step_input, cache);
    const std::int64_t next = sampler.next(logits[0][-1]);
    if (next == tokenizer->eos_id() || next == tokenizer->bos_id()) break;  // end of document
    ids.push_back(next);
    // Print what the new token adds to the decoded text (byte-exact, whatever the tokenizer's merging).
    const std::string text = tokenizer->decode(ids);
    if (text.size() > printed) {
      std::cout << text.substr(printed) << std::flush;
      printed = text.size();
    }
    step_input = at::tensor(std::vector<std::int64_t>{next}, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
  }
  std::cout << "\n";
  std::cerr << "[generate] " << ids.size() - prompt_len << " new tokens\n";
  return 0;
}

}  // namespace kvbound
