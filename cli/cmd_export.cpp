// `kvbound export RUN_DIR --out PATH [--best] [--format F]`: the trained tensors of a run (its latest
// checkpoint, or the best periodic eval with --best) without optimizer state, for serving stacks: by default
// one safetensors file whose metadata header says what they are (method, backbone identity, budget, step,
// config hash; --dtype bfloat16 halves it); other formats come from the method's registration (trimkv: the
// official release's folder).
// TRIM-KV tensors keep the official release's names (model.layers.{i}.self_attn.retention_gate.*).
#include <algorithm>
#include <cxxopts.hpp>
#include <iostream>

#include "cli/parse_arguments.h"
#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "cli/commands.h"
#include "cli/model_setup.h"
#include "train/method_registry.h"
#include "train/run_checkpoint.h"

namespace kvbound {

int cmd_export(int argc, char** argv) {
  cxxopts::Options o("kvbound export",
                     "Write a run's trained weights (TRIM-KV gates, IndexMem indexer or latent memory) as one "
                     "safetensors file.");
  o.add_options()("run_dir", "run folder of `kvbound train`", cxxopts::value<std::string>())(
      "o,out", "output .safetensors file (a folder for --format trimkv)", cxxopts::value<std::string>())(
      "best", "export the weights of the best periodic eval (best.safetensors) instead of the latest checkpoint")(
      "format", "safetensors (one file, any method) or a method's own format (trimkv: the official release's folder)",
      cxxopts::value<std::string>()->default_value("safetensors"))(
      "dtype", "store floating-point tensors as float32 or bfloat16 (half the size; loaders compute in float32)",
      cxxopts::value<std::string>()->default_value("float32"))(
      "h,help", "show help");
  o.parse_positional({"run_dir"});
  o.positional_help("RUN_DIR");
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  if (!r.count("run_dir")) fail("kvbound export", "RUN_DIR", "missing (see --help)");
  if (!r.count("out")) fail("kvbound export", "--out", "missing output file");
  const std::string run_dir = r["run_dir"].as<std::string>(), out = r["out"].as<std::string>();
  const std::string source = run_weights_path(run_dir, r.count("best") > 0, r.count("best") ? "--best" : "RUN_DIR");
  const at::ScalarType dtype = parse_dtype(r["dtype"].as<std::string>(), "--dtype");
  const SafetensorsFile file = read_safetensors(source);
  std::map<std::string, at::Tensor> tensors;
  for (auto& [name, t] : file.tensors)
    if (name.rfind("optimizer.", 0) != 0) tensors[name] = t.is_floating_point() ? t.to(dtype) : t;
  if (tensors.empty()) fail(source, "tensors", "no trained tensors in this checkpoint");
  // The method must be registered (its loader reads the export back); the run's bookkeeping (data position,
  // the checkpoint format) stays behind, everything the method recorded passes through.
  const auto method = file.metadata.find("method");
  if (method == file.metadata.end()) fail(source, "__metadata__.method", "missing (not a kvbound run?)");
  const MethodRegistration& registration = find_method(method->second, source + ": __metadata__.method");
  std::map<std::string, std::string> meta;
  for (const auto& [key, value] : file.metadata)
    if (!is_run_bookkeeping(key)) meta[key] = value;
  const std::string format = r["format"].as<std::string>();
  if (format != "safetensors") {
    if (dtype != at::kFloat) fail("--dtype", r["dtype"].as<std::string>(), "only the safetensors format stores bfloat16");
    std::string known = "safetensors";
    for (const ExportFormat& f : registration.export_formats) {
      if (format != f.name) {
        known += std::string(", ") + f.name;
        continue;
      }
      f.write(tensors, meta, source, out);
      std::cout << "[export] " << tensors.size() << " tensors (" << meta["method"] << ", step " << meta["step"] << ") -> "
                << out << " (" << f.name << ": " << f.summary << ")\n";
      return 0;
    }
    fail("--format", format, "not a format of method " + method->second + " (" + known + ")");
  }
  meta["format"] = "kvbound-export";
  meta["format_version"] = "1";
  meta["source"] = source;
  write_safetensors(out, tensors, meta);
  std::cout << "[export] " << tensors.size() << " tensors (" << meta["method"] << ", step " << meta["step"] << ") -> "
            << out << "\n";
  return 0;
}

}  // namespace kvbound
