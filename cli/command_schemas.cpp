#include "cli/command_schemas.h"

#include "base/build_options.h"
#include "base/errors.h"
#include "cli/model_setup.h"
#include "modules/policies/registry.h"
#include "train/method_registry.h"

namespace kvbound {

namespace {

std::string method_list() {
  std::string out;
  for (const MethodRegistration* m : method_registry()) out += (out.empty() ? "" : " | ") + std::string(m->name);
  return out;
}

}  // namespace

ConfigSchema train_schema() {
  ConfigSchema s;
  add_model_keys(s);
  s.add_required("data.train_text", ConfigType::String, "training documents: .txt/.jsonl, or an .h5 from `kvbound prepare`")
      .add("data.pack", ConfigType::Bool, "false",
           "cut rows across document boundaries (short documents fill rows; mark boundaries with prepare --add-eos)")
      .add("data.shift_rows", ConfigType::Bool, "false",
           "cut each epoch after the first at another offset (from train.seed), so repeated epochs see other rows")
      .add("data.recall_share", ConfigType::Float, "0.0",
           "share of full rows rewritten as a synthetic recall task: a numbered fact in the row's text, asked for "
           "at its end (data/recall_tasks.h)")
      .add("data.eval_text", ConfigType::String, "\"\"", "held-out plain text for the periodic budgeted eval (empty: none)")
      .add("data.eval_text_part", ConfigType::FloatList, "[0.0, 1.0]",
           "[from, to): the share of data.eval_text's paragraphs the periodic eval (and so --best) uses")
      .add("train.method", ConfigType::String, "trimkv", "what to train: " + method_list())
      .add("train.init_from", ConfigType::String, "\"\"",
           "weights to start from, a run folder (its best.safetensors, else latest checkpoint) or export: the earlier "
           "stage of joint and memory; trimkv: gates to continue training")
      .add("train.steps", ConfigType::Int, "200", "optimizer updates")
      .add("train.seq_len", ConfigType::Int, "256", "tokens per row T (BOS included); rows never cross documents")
      .add("train.batch_size", ConfigType::Int, "8", "rows per micro-batch")
      .add("train.grad_accum", ConfigType::Int, "1", "micro-batches per update")
      .add("train.lr", ConfigType::Float, "2e-3", "peak learning rate (2e-3 tiny models, 2e-4 billion-scale)")
      .add("train.min_lr", ConfigType::Float, "0.0", "learning rate at the end of the cosine decay")
      .add("train.warmup", ConfigType::Int, "20", "linear warm-up updates")
      .add("train.weight_decay", ConfigType::Float, "0.01", "AdamW weight decay (matrices only)")
      .add("train.grad_clip", ConfigType::Float, "1.0", "max global gradient norm (<= 0: off)")
      .add("train.seed", ConfigType::Int, "0", "seed for initialisation and data order")
      .add("train.loss_block_rows", ConfigType::Int, "128", "positions whose vocabulary logits exist at once")
      .add("train.log_every", ConfigType::Int, "1", "updates between metrics.jsonl lines")
      .add("train.checkpoint_every", ConfigType::Int, "50", "updates between checkpoints (0: only at the end)")
      .add("train.keep_checkpoints", ConfigType::Int, "3", "checkpoint files kept")
      .add("train.eval_every", ConfigType::Int, "50", "updates between budgeted evals (0: only at the end)")
      .add("train.eval_budget", ConfigType::Int, "128", "deployment budget M of the periodic eval")
      .add("train.eval_budget_scope", ConfigType::String, "policy", "what the periodic eval's M bounds (as eval.budget_scope)")
      .add("train.eval_windows", ConfigType::Int, "4", "held-out windows per eval")
      .add("train.eval_context_len", ConfigType::Int, "256", "eval window length (BOS included)")
      .add("train.eval_prefill_len", ConfigType::Int, "128", "eval prefill (then teacher-forced decode, scored)")
      .add("train.eval_chunk_size", ConfigType::Int, "32", "eval prefill chunk size")
      .add("run.out_dir", ConfigType::String, "runs/trimkv", "run folder")
      .add("run.tensorboard", ConfigType::Bool, KVBOUND_WITH_TENSORBOARD ? "true" : "false", "also log every metrics.jsonl line as TensorBoard events (run folder/tensorboard)");
  declare_method_train_keys(s);
  declare_policy_keys(s);  // the policy that evaluates the method, and the one a memory is trained under
  return s;
}

ConfigSchema eval_schema() {
  ConfigSchema s;
  add_model_keys(s);
  s.add_required("eval.text", ConfigType::String, "held-out plain text file (windows and retrieval filler)")
      .add("eval.text_part", ConfigType::FloatList, "[0.0, 1.0]",
           "[from, to): the share of eval.text's paragraphs used (e.g. [0.25, 1.0] when [0, 0.25) selects checkpoints)")
      .add("eval.policies", ConfigType::StringList,
           "[full, random, streaming_llm, h2o, snapkv, tova, knorm, keydiff]",
           "eviction policies to compare (any registered policy, or POLICY+mem)")
      .add("eval.budgets", ConfigType::IntList, "[64, 128, 256]", "KV budgets M (entries per layer and KV head)")
      .add("eval.tasks", ConfigType::StringList, "[continuation, retrieval]", "continuation and/or retrieval")
      .add("eval.context_len", ConfigType::Int, "512", "continuation window length in tokens (BOS included)")
      .add("eval.prefill_len", ConfigType::Int, "384", "tokens prefilled in chunks before teacher-forced decode")
      .add("eval.score_from", ConfigType::Int, "384", "first scored position (>= prefill_len)")
      .add("eval.chunk_size", ConfigType::Int, "64", "prefill chunk size C (peak KV = M + buffer + C)")
      .add("eval.buffer", ConfigType::Int, "0", "extra entries tolerated before the cache is cut back to M")
      .add("eval.budgeted_layers", ConfigType::IntList, "[]",
           "layers held to the budget ([]: every layer); the others keep every entry: what evicting there alone costs")
      .add("eval.layer_budget_shares", ConfigType::FloatList, "[]",
           "one share per layer: budget M gives layer l its share of the L*M entries ([]: M in every layer; "
           "`kvbound inspect --layer-shares` derives shares from trained gates)")
      .add("eval.budget_scope", ConfigType::String, "policy",
           "what M bounds for every policy: head (every layer and KV head holds M), layer (a layer's KV heads share "
           "Hkv*M: Ada-KV) or model (every head of every layer shares L*Hkv*M: the official DynamicBudgetTrimKVCache); "
           "policy: each policy's own (trimkv.budget_scope; head for the others). The pooled two compare scores across "
           "heads, take no +mem policy, and keep the peak KV of head")
      .add("eval.num_windows", ConfigType::Int, "8", "continuation windows (random paragraph starts)")
      .add("eval.seed", ConfigType::Int, "0", "seed for windows, retrieval cases and random policies")
      .add("eval.out_dir", ConfigType::String, "runs/eval", "output folder")
      .add("eval.retrieval.context_len", ConfigType::Int, "512", "passkey prompt length in tokens")
      .add("eval.retrieval.depths", ConfigType::FloatList, "[0.1, 0.5, 0.9]", "needle depths (fraction of filler)")
      .add("eval.retrieval.samples", ConfigType::Int, "4", "passkey cases per depth");
  declare_policy_keys(s);
  declare_method_eval_keys(s);  // the files that hold the learned policies' weights
  return s;
}

TextPart text_part(const Config& config, const std::string& key) {
  const std::vector<double> bounds = config.get_float_list(key);
  if (bounds.size() != 2) fail("config", key, "needs two fractions [from, to), got " + std::to_string(bounds.size()));
  return {bounds[0], bounds[1]};
}

}  // namespace kvbound
