#include "cli/model_setup.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "base/errors.h"
#include "base/usable_cores.h"
#include "ops/device.h"

namespace kvbound {
namespace {

constexpr const char* kDefaultModelFile = "SmolLM2-135M-Instruct.Q4_1.gguf";

void apply_threads(std::int64_t threads) {
  at::set_num_threads(threads > 0 ? static_cast<int>(threads) : usable_cores());
}

Backbone::Float32Products parse_products(const std::string& value, const std::string& where) {
  if (value == "float32") return Backbone::Float32Products::kFloat32;
  if (value == "bf16x3") return Backbone::Float32Products::kBf16x3;
  throw Error(where + ": unknown float32 products '" + value + "' (float32, bf16x3)");
}

// Turns the bf16x3 products on where asked; where they cannot run (bfloat16 compute, another device, no AMX)
// the run goes on with the float32 GEMM and says so on stderr, since its config still names bf16x3.
void apply_products(Backbone& model, Backbone::Float32Products products, const std::string& where) {
  if (!model.set_float32_products(products) && products == Backbone::Float32Products::kBf16x3)
    std::cerr << "kvbound: " << where << ": bf16x3 runs only for float32 compute on a CPU with AMX; this run forms "
              << "its products as " << (model.dtype() == at::kFloat ? "float32" : "bfloat16") << " GEMMs on "
              << model.device() << "\n";
}

constexpr const char* kProductsHelp =
    "a float32 model's frozen matrix products on the CPU: float32 | bf16x3 (three bfloat16 tile passes where the "
    "CPU has AMX: 16 of each factor's 24 bits, faster prefill and training, twice the weight memory)";

}  // namespace

at::ScalarType parse_dtype(const std::string& value, const std::string& where) {
  if (value == "float32" || value == "fp32") return at::kFloat;
  if (value == "bfloat16" || value == "bf16") return at::kBFloat16;
  throw Error(where + ": unknown dtype '" + value + "' (float32, bfloat16)");
}

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

void add_model_options(cxxopts::Options& o) {
  o.add_options()("model", "HF folder (config.json + *.safetensors) or .gguf file",
                  cxxopts::value<std::string>()->default_value(default_model_path()))(
      "dtype", "compute dtype: float32 | bfloat16", cxxopts::value<std::string>()->default_value("float32"))(
      "threads", "CPU threads (0 = every core this process may use)", cxxopts::value<int>()->default_value("0"))(
      "fp32-products", kProductsHelp, cxxopts::value<std::string>()->default_value("float32"))(
      "device", "compute device: cpu | cuda | cuda:N", cxxopts::value<std::string>()->default_value("cpu"))(
      "h,help", "show this help");
}

std::unique_ptr<Backbone> load_backbone_from_options(const cxxopts::ParseResult& r) {
  if (r["threads"].as<int>() < 0) fail("--threads", "", "must be >= 0");
  apply_threads(r["threads"].as<int>());
  const c10::Device device = resolve_device(r["device"].as<std::string>(), "--device");
  const auto products = parse_products(r["fp32-products"].as<std::string>(), "--fp32-products");
  auto model = Backbone::load(r["model"].as<std::string>(), parse_dtype(r["dtype"].as<std::string>(), "--dtype"), device);
  apply_products(*model, products, "--fp32-products");
  return model;
}

void add_model_keys(ConfigSchema& s) {
  s.add("model.path", ConfigType::String, yaml_quote(default_model_path()), "HF folder or .gguf file (frozen backbone)")
      .add("model.tokenizer", ConfigType::String, "\"\"", "tokenizer file (empty: the one beside model.path)")
      .add("model.dtype", ConfigType::String, "float32", "compute dtype: float32 | bfloat16")
      .add("model.threads", ConfigType::Int, "0", "CPU threads (0 = every core this process may use)")
      .add("model.fp32_products", ConfigType::String, "float32", kProductsHelp)
      .add("model.device", ConfigType::String, "cpu", "compute device: cpu | cuda | cuda:N");
}

namespace {

struct BackboneChoice {
  at::ScalarType dtype;
  c10::Device device;
  Backbone::Float32Products products;
};

// Applies model.threads and checks model.dtype, model.device and model.fp32_products, before anything is loaded.
BackboneChoice backbone_choice(const Config& config) {
  const std::int64_t threads = config.get_int("model.threads");
  if (threads < 0) fail("config", "model.threads", "must be >= 0");
  apply_threads(threads);
  return {parse_dtype(config.get_string("model.dtype"), "config: model.dtype"),
          resolve_device(config.get_string("model.device"), "config: model.device"),
          parse_products(config.get_string("model.fp32_products"), "config: model.fp32_products")};
}

std::unique_ptr<Backbone> load_chosen_backbone(const std::string& path, const BackboneChoice& choice) {
  auto model = Backbone::load(path, choice.dtype, choice.device);
  apply_products(*model, choice.products, "config: model.fp32_products");
  return model;
}

}  // namespace

std::unique_ptr<Backbone> load_configured_backbone(const Config& config) {
  return load_chosen_backbone(config.get_string("model.path"), backbone_choice(config));
}

ConfiguredModel load_configured_model(const Config& config) {
  const BackboneChoice choice = backbone_choice(config);
  ConfiguredModel m;
  m.model_path = config.get_string("model.path");
  m.tokenizer_path = config.get_string("model.tokenizer").empty() ? find_tokenizer_beside(m.model_path)
                                                                  : config.get_string("model.tokenizer");
  m.tokenizer = load_tokenizer(m.tokenizer_path);
  m.model = load_chosen_backbone(m.model_path, choice);
  return m;
}

}  // namespace kvbound
