// `kvbound generate [--model PATH] [--prompt TEXT]`: continues a prompt with the frozen backbone under a
// full KV cache; the continuation alone goes to stdout, diagnostics to stderr.
#include <ATen/ops/tensor.h>
#include <c10/core/InferenceMode.h>

#include <cxxopts.hpp>
#include <iostream>

#include "base/errors.h"
#include "cli/commands.h"
#include "cli/model_setup.h"
#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "modules/sampler.h"

namespace kvbound {

int cmd_generate(int argc, char** argv) {
  cxxopts::Options o("kvbound generate",
                     "Continue a prompt with the backbone (full KV cache). The continuation alone goes to stdout.");
  add_model_options(o);
  o.add_options()("tokenizer", "tokenizer file (default: the one beside --model)", cxxopts::value<std::string>())(
      "prompt", "prompt text (empty: start from BOS)", cxxopts::value<std::string>()->default_value(""))(
      "max-new-tokens", "tokens to generate", cxxopts::value<int>()->default_value("64"))(
      "temperature", "0 = greedy", cxxopts::value<double>()->default_value("0"))(
      "top-p", "nucleus sampling mass", cxxopts::value<double>()->default_value("1"))(
      "seed", "sampling seed", cxxopts::value<std::uint64_t>()->default_value("0"));
  const auto r = o.parse(argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  const c10::InferenceMode no_autograd;  // generation never needs gradients: skip autograd bookkeeping
  const std::string model_path = r["model"].as<std::string>();
  const int max_new = r["max-new-tokens"].as<int>();
  if (max_new < 0) fail("--max-new-tokens", "", "must be >= 0");
  Sampler sampler({r["temperature"].as<double>(), r["top-p"].as<double>(), r["seed"].as<std::uint64_t>()});
  const std::string tok_path = r.count("tokenizer") ? r["tokenizer"].as<std::string>() : find_tokenizer_beside(model_path);
  const auto tokenizer = load_tokenizer(tok_path);
  const auto model = load_backbone_from_options(r);
  if (tokenizer->vocab_size() > model->config().vocab_size)
    fail(tok_path, "vocab_size", std::to_string(tokenizer->vocab_size()) + " tokens but the model has " +
                                     std::to_string(model->config().vocab_size));

  const std::string prompt = r["prompt"].as<std::string>();
  std::vector<std::int64_t> ids = tokenizer->encode(prompt, /*add_bos=*/prompt.empty() || tokenizer->adds_bos());
  if (ids.empty()) {
    if (tokenizer->bos_id() < 0) fail(tok_path, "bos", "an empty prompt needs a BOS token and this tokenizer has none");
    ids.push_back(tokenizer->bos_id());
  }
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
