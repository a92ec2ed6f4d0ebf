// kvbound command line: one binary, one subcommand per job. Errors print one line and exit non-zero.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <cxxopts.hpp>
#include <filesystem>
#include <functional>
#include <iostream>
#include <thread>
#include <unistd.h>

#include "checkpoints/errors.h"
#include "train/commands.h"
#include "data/tokenizer.h"
#include "modules/backbone.h"
#include "modules/sampler.h"
#include "ops/cuda_module.h"

namespace kvbound {
namespace {

constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

}  // namespace

// $KVBOUND_MODEL_DIR, else models/ beside the build folder that holds this binary, else ./models.
std::string default_model_path() {
  namespace fs = std::filesystem;
  if (const char* dir = std::getenv("KVBOUND_MODEL_DIR")) return (fs::path(dir) / kDefaultModelFile).string();
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path candidate = exe.parent_path().parent_path() / "models" / kDefaultModelFile;
    if (fs::exists(candidate)) return candidate.string();
  }
  return (fs::path("models") / kDefaultModelFile).string();
}

namespace {

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32") return at::kFloat;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  fail("--dtype", "", "unknown dtype '" + s + "' (float32, bfloat16)");
}

void add_model_options(cxxopts::Options& o) {
  o.add_options()("model", "HF folder (config.json + *.safetensors) or .gguf file",
                  cxxopts::value<std::string>()->default_value(default_model_path()))(
      "dtype", "compute dtype: float32 | bfloat16", cxxopts::value<std::string>()->default_value("float32"))(
      "threads", "CPU threads (0 = all cores)", cxxopts::value<int>()->default_value("0"))("h,help", "show this help");
}

void apply_threads(int threads) {
  at::set_num_threads(threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
}

int cmd_info(int argc, char** argv) {
  cxxopts::Options o("kvbound info", "Print a model's architecture, sizes, stored dtypes and parameter count.");
  add_model_options(o);
  const auto r = o.parse(argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  apply_threads(r["threads"].as<int>());
  const auto model = Backbone::load(r["model"].as<std::string>(), parse_dtype(r["dtype"].as<std::string>()));
  const ModelConfig& c = model->config();
  std::cout << "source            " << model->source() << " (" << model->format() << ")\n"
            << "architecture      " << c.architecture << "\n"
            << "layers            " << c.num_layers << "\n"
            << "hidden_size       " << c.hidden_size << "\n"
            << "intermediate_size " << c.intermediate_size << "\n"
            << "heads             " << c.num_heads << " query, " << c.num_kv_heads << " key/value (head_dim "
            << c.head_dim << ")\n"
            << "vocab_size        " << c.vocab_size << "\n"
            << "rope              theta " << c.rope_theta << ", scaling " << c.rope_scaling.type << "\n"
            << "max_positions     " << c.max_position_embeddings << "\n"
            << "tied_embeddings   " << (c.tie_word_embeddings ? "yes" : "no") << "\n"
            << "qkv_bias          " << (c.attention_bias ? "yes" : "no") << "\n"
            << "qk_norm           " << (c.qk_norm ? "yes" : "no") << "\n"
            << "activation        " << c.hidden_act << "\n"
            << "stored_types     ";
  for (const auto& [type, n] : model->stored_types()) std::cout << " " << type << " x" << n;
  std::cout << "\n"
            << "compute_dtype     " << c10::toString(model->dtype()) << "\n"
            << "parameters        " << model->num_parameters() << " (" << model->parameter_bytes() / (1 << 20)
            << " MiB in compute dtype, all frozen)\n";
  return 0;
}

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
  apply_threads(r["threads"].as<int>());
  const c10::InferenceMode no_autograd;  // generation never needs gradients: skip autograd bookkeeping
  const std::string model_path = r["model"].as<std::string>();
  const int max_new = r["max-new-tokens"].as<int>();
  if (max_new < 0) fail("--max-new-tokens", "", "must be >= 0");
  Sampler sampler({r["temperature"].as<double>(), r["top-p"].as<double>(), r["seed"].as<std::uint64_t>()});
  const std::string tok_path = r.count("tokenizer") ? r["tokenizer"].as<std::string>() : find_tokenizer_beside(model_path);
  const auto tokenizer = load_tokenizer(tok_path);
  const auto model = Backbone::load(model_path, parse_dtype(r["dtype"].as<std::string>()));
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

struct Subcommand {
  const char* name;
  const char* summary;
  std::function<int(int, char**)> run;
};

const std::vector<Subcommand>& subcommands() {
  static const std::vector<Subcommand> all = {
      {"info", "print a model's architecture, sizes, dtypes and parameter count", cmd_info},
      {"generate", "continue a prompt with the frozen backbone", cmd_generate},
      {"prepare", "tokenize text/jsonl files into an HDF5 token dataset", cmd_prepare},
      {"train", "train TRIM-KV gates, an IndexMem indexer or a latent memory on the frozen backbone (YAML)", cmd_train},
      {"export", "write a run's trained weights (gates, indexer, memory) as one safetensors file", cmd_export},
      {"eval", "compare KV eviction policies under budgets (YAML config)", cmd_eval},
  };
  return all;
}

void print_usage(std::ostream& out) {
  out << "kvbound: memory-bounded KV caches for frozen Llama-family models\n\nusage: kvbound <command> [options]\n\n"
         "commands:\n";
  for (const auto& s : subcommands()) out << "  " << s.name << std::string(12 - std::strlen(s.name), ' ') << s.summary << "\n";
  out << "\n`kvbound <command> --help` shows a command's options.\n";
}

}  // namespace
}  // namespace kvbound

int main(int argc, char** argv) {
  using namespace kvbound;
  load_cuda_kernels();  // a no-op without an NVIDIA driver: CPU runs never load libtorch_cuda
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_usage(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  const std::string name = argv[1];
  for (const auto& s : subcommands()) {
    if (name != s.name) continue;
    try {
      return s.run(argc - 1, argv + 1);
    } catch (const kvbound::Error& e) {
      std::cerr << "kvbound " << name << ": error: " << e.what() << "\n";
    } catch (const cxxopts::exceptions::exception& e) {
      std::cerr << "kvbound " << name << ": error: " << e.what() << " (see `kvbound " << name << " --help`)\n";
    } catch (const c10::Error& e) {
      // ATen messages can span lines (context, hints); the CLI promises one line.
      const std::string what = e.what_without_backtrace();
      std::cerr << "kvbound " << name << ": error: " << what.substr(0, what.find('\n')) << "\n";
    } catch (const std::exception& e) {
      std::cerr << "kvbound " << name << ": error: " << e.what() << "\n";
    }
    return 1;
  }
  std::cerr << "kvbound: unknown command '" << name << "'\n";
  print_usage(std::cerr);
  return 2;
}
