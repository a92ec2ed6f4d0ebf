// kvbound command line: one binary, one subcommand per job. Errors print one line and exit non-zero.
#include <c10/util/Exception.h>

#include <cstring>
#include <cxxopts.hpp>
#include <functional>
#include <iostream>

#include "base/errors.h"
#include "base/process_heap.h"
#include "cli/commands.h"
#include "ops/cuda_module.h"

namespace kvbound {
namespace {

struct Subcommand {
  const char* name;
  const char* summary;
  std::function<int(int, char**)> run;
};

const std::vector<Subcommand>& subcommands() {
  static const std::vector<Subcommand> all = {
      {"info", "print a model's architecture, sizes, dtypes and parameter count", cmd_info},
      {"generate", "continue a prompt with the frozen backbone (or sample many prompts into JSON lines)", cmd_generate},
      {"prepare", "tokenize text/jsonl files into an HDF5 token dataset", cmd_prepare},
      {"train", "train a learned method (TRIM-KV gates, IndexMem indexer, latent memory, joint) on the frozen backbone", cmd_train},
      {"export", "write a run's trained weights (gates, indexer, memory) as one safetensors file", cmd_export},
      {"eval", "compare KV eviction policies under budgets (YAML config)", cmd_eval},
      {"sweep", "train, export and evaluate a grid of configs, then summarise (YAML)", cmd_sweep},
      {"inspect", "show what a trained method's policy keeps on a text (heatmaps, cache over time, patterns)", cmd_inspect},
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
  keep_freed_memory_in_process();  // base/process_heap.h: no page faults for every large tensor
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
