// `kvbound info [--model PATH]`: a model's architecture, sizes, stored dtypes, compute dtype and float32 products,
// and parameter count.
#include <cxxopts.hpp>
#include <iostream>

#include "cli/parse_arguments.h"
#include "cli/commands.h"
#include "cli/model_setup.h"
#include "modules/backbone.h"

namespace kvbound {

int cmd_info(int argc, char** argv) {
  cxxopts::Options o("kvbound info", "Print a model's architecture, sizes, stored dtypes and parameter count.");
  add_model_options(o);
  const auto r = parse_arguments(o, argc, argv);
  if (r.count("help")) {
    std::cout << o.help() << "\n";
    return 0;
  }
  const auto model = load_backbone_from_options(r);
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
            << "fp32_products     "
            << (model->dtype() != at::kFloat ? "- (not float32 compute)"
                : model->float32_products() == Backbone::Float32Products::kBf16x3 ? "bf16x3 (AMX tiles)"
                                                                                   : "float32 GEMM")
            << "\n"
            << "parameters        " << model->num_parameters() << " (" << model->parameter_bytes() / (1 << 20)
            << " MiB in compute dtype, all frozen)\n";
  return 0;
}

}  // namespace kvbound
