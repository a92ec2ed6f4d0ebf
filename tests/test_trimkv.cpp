// TRIM-KV end to end: the loss terms and gate gradients equal a PyTorch implementation of DESIGN.md's
// formulas (tests/golden/make_trimkv_golden.py), the hindsight ranking loss equals its formula by loops,
// bias 18 or sinks everywhere make the student the teacher, the gates file
// round-trips, the data rows and the schedule behave as documented, and the real CLI trains, resumes
// bit-identically, exports, evaluates, and stops on NaN or a bad key.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/log_sigmoid.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/softmax.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <nlohmann/json.hpp>

#include "base/errors.h"
#include "checkpoints/safetensors_io.h"
#include "data/tokenizer.h"
#include "losses/capacity.h"
#include "losses/future_attention.h"
#include "modules/backbone.h"
#include "modules/budgeted_cache.h"
#include "modules/policies/registry.h"
#include "modules/retention_gate.h"
#include "ops/retention_sum.h"
#include "golden_reader.h"
#include "test_env.h"
#include "tiny_cli_runs.h"
#include "train/optimizer.h"
#include "data/training_rows.h"
#include "train/trimkv_method.h"

namespace kvbound {
namespace {

namespace fs = std::filesystem;

TEST(TrimKVLoss, TermsAndGateGradientsEqualThePythonFormulas) {
  const std::string dir = test::test_data("trimkv");
  KVBOUND_REQUIRE_FILE(dir + "/golden.safetensors");
  const auto model = Backbone::load(dir, at::kFloat);
  const SafetensorsFile golden = read_safetensors(dir + "/golden.safetensors");
  TrimKVSettings s;
  s.gate.hidden = std::stoll(golden.metadata.at("gate_hidden"));
  s.budget = std::stoll(golden.metadata.at("budget"));
  s.loss_block_rows = 7;  // several blocks, the last one partial
  TrimKVMethod method(*model, s, 0);
  const SafetensorsFile gates = read_safetensors(dir + "/gates.safetensors");
  {
    const at::NoGradGuard no_grad;
    for (auto& [name, p] : method.named_parameters()) p.copy_(gates.tensors.at(name));
  }
  const StepLoss loss = method.loss(test::golden_batch(golden));
  for (const auto& [name, value] : loss.terms)
    EXPECT_NEAR(value.item<double>(), std::stod(golden.metadata.at(name)), 1e-5) << name;
  EXPECT_NEAR(loss.total.item<double>(), std::stod(golden.metadata.at("total")), 1e-5);
  loss.total.backward();
  for (auto& [name, p] : method.named_parameters()) {
    const at::Tensor want = golden.tensors.at("grad." + name);
    const double scale = std::max(want.abs().max().item<double>(), 1e-3);
    EXPECT_LT((p.grad() - want).abs().max().item<double>() / scale, 1e-4) << name;
  }
}

TEST(TrimKVLoss, Bias18MakesTheStudentTheTeacher) {
  for (const std::string& path : {test::test_data("trimkv"), test::asset("stories260K")}) {
    if (!fs::exists(path + "/model.safetensors")) continue;
    const auto model = Backbone::load(path, at::kFloat);
    TrimKVSettings s;
    s.gate.bias_init = 18.0;
    TrimKVMethod method(*model, s, 3);
    Batch b;
    b.inputs = at::randint(3, model->config().vocab_size, {2, 64}, at::TensorOptions().dtype(at::kLong));
    b.targets = b.inputs.roll(-1, 1);
    b.weights = at::ones({2, 64});
    const StepLoss loss = method.loss(b);
    EXPECT_LT(std::abs(loss.terms[0].second.item<double>()), 1e-6) << path << ": " << loss.terms[0].first;
  }
}

TEST(TrimKVLoss, SinkPositionsKeepBetaOneAndNoGradient) {
  // bias 0 makes every β ≈ 0.5: without sinks the student is far from the teacher.
  const std::string dir = test::test_data("trimkv");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  const auto model = Backbone::load(dir, at::kFloat);
  RetentionGateSettings settings;
  settings.bias_init = 0.0;
  const RetentionGates gates = RetentionGates::init(model->config(), settings, 4);
  at::manual_seed(4);
  const std::int64_t T = 24, sinks = 5;
  const at::Tensor tokens = at::randint(3, model->config().vocab_size, {2, T}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor teacher = model->teacher_hidden(tokens);
  const auto student = [&](std::int64_t s) {
    GatedAttentionHook hook(gates, s);
    KVCache cache = model->make_cache();
    const at::Tensor hidden = model->forward_hidden(tokens, cache, &hook);
    return std::make_pair(hidden, hook.log_betas());
  };
  // Every position a sink: β = 1 everywhere, plain causal attention, the teacher to rounding, no gate gradient.
  const auto [all_sinks, all_log_betas] = student(T);
  EXPECT_LT((all_sinks - teacher).abs().max().item<double>(), 1e-5);
  all_sinks.sum().backward();
  for (const auto& [name, p] : gates.named_tensors())
    EXPECT_TRUE(!p.grad().defined() || p.grad().abs().max().item<double>() == 0.0) << name;
  // Some sinks: exactly 0 there, the gates' value after them, and the student is not the teacher.
  const auto [hidden, log_betas] = student(sinks);
  for (const at::Tensor& lb : log_betas) {
    EXPECT_EQ(lb.narrow(2, 0, sinks).abs().max().item<double>(), 0.0);
    EXPECT_LT(lb.narrow(2, sinks, T - sinks).max().item<double>(), -0.1);
  }
  EXPECT_GT((hidden - teacher).abs().max().item<double>(), 1e-2);
}

// The tiny TRIM-KV model with gates whose β spread out (so a cut depends on them) and a random row of T tokens:
// the row through the student (GatedAttentionHook) or through the budgeted engine in chunks of C under the trimkv
// policy with the same gates.
struct SpreadGatesRow {
  SpreadGatesRow(std::unique_ptr<Backbone> backbone, std::uint64_t seed, std::int64_t length, std::int64_t chunk)
      : model(std::move(backbone)), T(length), C(chunk) {
    RetentionGateSettings settings;
    settings.bias_init = 2.0;
    settings.init_std = 0.5;
    gates = std::make_shared<RetentionGates>(RetentionGates::init(model->config(), settings, seed));
    modules.add<RetentionGates>(gates);
    at::manual_seed(seed);
    tokens = at::randint(3, model->config().vocab_size, {2, T}, at::TensorOptions().dtype(at::kLong));
  }
  at::Tensor student(GatedAttentionHook& hook) const {
    KVCache cache = model->make_cache();
    return model->forward_hidden(tokens, cache, &hook);
  }
  // Without autograd; `evictions`, when given, receives the engine's count.
  at::Tensor budgeted(std::int64_t budget, const std::vector<std::string>& policy_keys, std::int64_t* evictions = nullptr) const {
    const at::NoGradGuard no_grad;
    auto policy = make_policy("trimkv", policy_config(policy_keys), modules);
    BudgetedCache engine(*policy, budget);
    KVCache cache = model->make_cache();
    std::vector<at::Tensor> chunks;
    for (std::int64_t s = 0; s < T; s += C) chunks.push_back(model->forward_hidden(tokens.narrow(1, s, C), cache, &engine));
    if (evictions) *evictions = engine.evictions();
    return at::cat(chunks, 1);
  }

  std::unique_ptr<Backbone> model;
  std::int64_t T, C;
  std::shared_ptr<RetentionGates> gates;
  TrainedModules modules;
  at::Tensor tokens;
};

// The cut student's forward is the deployment's: the budgeted engine under the trimkv policy with the same gates,
// budget, chunk and sinks gives the same hidden states; the gates still get a gradient (the gated attention's),
// and with a budget that never binds the cut student is the teacher.
TEST(TrimKVLoss, CutStudentForwardIsTheBudgetedEnginesAndTrainsTheGates) {
  const std::string dir = test::test_data("trimkv");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  const SpreadGatesRow row(Backbone::load(dir, at::kFloat), 5, 40, 8);
  const std::int64_t M = 6;
  for (const std::int64_t sinks : {0, 2}) {
    GatedAttentionHook hook(*row.gates, sinks, M, row.C);
    const at::Tensor student = row.student(hook);
    std::int64_t evictions = 0;
    const at::Tensor deployed = row.budgeted(M, {"trimkv.sinks=" + std::to_string(sinks)}, &evictions);
    EXPECT_GT(evictions, 0);
    EXPECT_LT((student.detach() - deployed).abs().max().item<double>(), 1e-4) << "sinks " << sinks;
    student.pow(2).sum().backward();
    for (const auto& [name, p] : row.gates->named_tensors()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_GT(p.grad().abs().max().item<double>(), 0.0) << name;
      p.mutable_grad().reset();
    }
  }
  GatedAttentionHook never_binds(*row.gates, 0, row.T, row.C);
  EXPECT_LT((row.student(never_binds) - row.model->teacher_hidden(row.tokens)).abs().max().item<double>(), 1e-5);
}

// trimkv.gated_read reads the kept entries as the soft student attends: under a budget that never binds, the
// chunked budgeted forward equals the student's gated attention over the whole row (sinks included); under one
// that binds it is neither that nor the plain read.
TEST(TrimKVPolicy, GatedReadIsTheSoftStudentsAttention) {
  const std::string dir = test::test_data("trimkv");
  KVBOUND_REQUIRE_FILE(dir + "/model.safetensors");
  const SpreadGatesRow row(Backbone::load(dir, at::kFloat), 6, 40, 8);
  const at::NoGradGuard no_grad;
  const auto budgeted = [&](std::int64_t budget, std::int64_t sinks, bool gated) {
    return row.budgeted(budget, {"trimkv.sinks=" + std::to_string(sinks), std::string("trimkv.gated_read=") + (gated ? "true" : "false")});
  };
  for (const std::int64_t sinks : {0, 3}) {
    GatedAttentionHook hook(*row.gates, sinks);
    const at::Tensor student = row.student(hook);
    EXPECT_LT((budgeted(row.T, sinks, true) - student).abs().max().item<double>(), 1e-4) << "sinks " << sinks;
    EXPECT_GT((budgeted(row.T, sinks, false) - student).abs().max().item<double>(), 1e-2) << "sinks " << sinks;
  }
  const at::Tensor cut_gated = budgeted(6, 0, true), cut_plain = budgeted(6, 0, false);
  EXPECT_GT((cut_gated - cut_plain).abs().max().item<double>(), 1e-2);
  EXPECT_GT((cut_gated - budgeted(row.T, 0, true)).abs().max().item<double>(), 1e-2);
}

TEST(FutureAttentionLoss, EqualsTheFormulaByLoopsAndSkipsPaddedCuts) {
  EXPECT_EQ(losses::future_cuts(10, 4), (std::vector<std::int64_t>{3, 7}));
  EXPECT_EQ(losses::future_cuts(8, 4), (std::vector<std::int64_t>{3}));  // t = 7 has no later query
  EXPECT_TRUE(losses::future_cuts(4, 8).empty());
  at::manual_seed(6);
  const std::int64_t B = 2, H = 2, T = 12, L = 3;
  const std::vector<std::int64_t> cuts = losses::future_cuts(T, 3);  // 2, 5, 8
  at::Tensor w = at::ones({B, T});
  // Row 1 pads from 6 on: its cut at 8 is not counted, nor its cut at 5, whose later queries all weigh 0.
  w[1].narrow(0, 6, T - 6).zero_();
  std::vector<at::Tensor> attention, mass, log_betas;
  for (std::int64_t l = 0; l < L; ++l) {
    const at::Tensor causal = at::ones({T, T}).tril().to(at::kBool);
    attention.push_back(at::softmax(at::randn({B, H, T, T}).masked_fill(causal.logical_not(), -1e9), -1));
    mass.push_back(losses::future_attention_mass(attention.back(), cuts, w));
    log_betas.push_back(at::log_sigmoid(at::randn({B, H, T}) + 2.0).requires_grad_(true));
  }
  const at::Tensor loss = losses::future_attention_loss(log_betas, mass, cuts, w);
  double want = 0, pairs = 0;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::size_t c = 0; c < cuts.size(); ++c) {
          const std::int64_t t = cuts[c];
          std::vector<double> f(t + 1, 0.0), z(t + 1);
          double f_sum = 0, z_max = -1e30, z_sum = 0;
          for (std::int64_t i = 0; i <= t; ++i) {
            for (std::int64_t q = t + 1; q < T; ++q) f[i] += w[b][q].item<double>() * attention[l][b][h][q][i].item<double>();
            EXPECT_NEAR(mass[l][b][h][static_cast<std::int64_t>(c)][i].item<double>(), f[i], 1e-6);
            f_sum += f[i];
            z[i] = static_cast<double>(t - i) * log_betas[l][b][h][i].item<double>();
            z_max = std::max(z_max, z[i]);
          }
          for (std::int64_t i = t + 1; i < T; ++i) EXPECT_EQ(mass[l][b][h][static_cast<std::int64_t>(c)][i].item<double>(), 0.0);
          if (w[b][t].item<double>() == 0 || f_sum == 0) continue;
          for (std::int64_t i = 0; i <= t; ++i) z_sum += std::exp(z[i] - z_max);
          for (std::int64_t i = 0; i <= t; ++i) {
            const double p = f[i] / f_sum, log_q = z[i] - z_max - std::log(z_sum);
            if (p > 0) want += p * (std::log(p) - log_q);
          }
          pairs += 1;
        }
  EXPECT_EQ(pairs, static_cast<double>(L * H * (2 * cuts.size() - 2)));
  EXPECT_NEAR(loss.item<double>(), want / pairs, 1e-6);
  loss.backward();
  for (const at::Tensor& lb : log_betas) {
    EXPECT_TRUE(at::isfinite(lb.grad()).all().item<bool>());
    EXPECT_GT(lb.grad().abs().max().item<double>(), 0.0);
    // Keys after the last counted cut of row 1 get no gradient from it: only its cut at 2 counts.
    EXPECT_EQ(lb.grad()[1].narrow(1, 3, T - 3).abs().max().item<double>(), 0.0);
  }
}

TEST(CapacityLoss, GlobalModeEqualsTheFormula) {
  at::manual_seed(5);
  std::vector<at::Tensor> lbs;
  for (int l = 0; l < 3; ++l) lbs.push_back(at::log_sigmoid(at::randn({2, 2, 20}) + 2.0));
  at::Tensor w = at::ones({2, 20});
  w.narrow(1, 15, 5).zero_();
  const std::int64_t M = 4;
  const at::Tensor S = ops::retention_sum_reference(at::stack(lbs, 1));  // [B, L, H, T]
  const at::Tensor t = at::arange(20, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor excess = at::relu(S.sum({1, 2}) - M * 3 * 2) / (at::clamp_min(t + 1 - M, 1) * 6);
  const double want = ((excess * w).sum() / w.sum()).item<double>();
  EXPECT_NEAR(losses::capacity_loss(lbs, M, losses::CapacityMode::Global, w).item<double>(), want, 1e-6);
  EXPECT_THROW(losses::parse_capacity_mode("per_layer", "trimkv.capacity"), Error);
}

TEST(RetentionGates, ExportRoundTripGivesIdenticalScores) {
  ModelConfig c;
  c.num_layers = 3;
  c.hidden_size = 24;
  c.num_kv_heads = 2;
  c.hidden_act = "silu";
  const RetentionGates gates = RetentionGates::init(c, {16, 8.0, 0.5}, 11);
  test::TempDir dir("gates");
  write_safetensors(dir / "gates.safetensors", gates.named_tensors(), {{"method", "trimkv"}});
  const RetentionGates back = RetentionGates::from_tensors(read_safetensors(dir / "gates.safetensors").tensors, c, "x");
  const at::Tensor x = at::randn({2, 9, 24});
  for (std::int64_t l = 0; l < 3; ++l) EXPECT_TRUE(at::equal(gates.log_beta(l, x), back.log_beta(l, x)));
  EXPECT_EQ(gates.named_tensors().count("model.layers.2.self_attn.retention_gate.linear2.weight"), 1u);
  c.num_kv_heads = 3;  // another model: the error names the file and the tensor
  try {
    RetentionGates::from_tensors(read_safetensors(dir / "gates.safetensors").tensors, c, "g.safetensors");
    FAIL() << "shape mismatch accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("g.safetensors: model.layers.0.self_attn.retention_gate.linear2.weight"),
              std::string::npos) << e.what();
  }
}

TEST(Schedule, WarmupThenCosine) {
  EXPECT_DOUBLE_EQ(scheduled_lr(0, 100, 10, 1.0, 0.0), 0.1);
  EXPECT_DOUBLE_EQ(scheduled_lr(9, 100, 10, 1.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(10, 100, 10, 1.0, 0.0), 1.0);
  EXPECT_NEAR(scheduled_lr(55, 100, 10, 1.0, 0.1), 0.55, 1e-12);
  EXPECT_NEAR(scheduled_lr(100, 100, 10, 1.0, 0.1), 0.1, 1e-12);
}

TEST(AdamWUpdate, FirstStepMovesEachWeightByTheLearningRate) {
  // After one step Adam's bias-corrected update is lr·g/(|g| + eps) = ±lr; decay applies to matrices only.
  at::Tensor w = at::full({2, 2}, 1.0).set_requires_grad(true), b = at::full({2}, 1.0).set_requires_grad(true);
  AdamW opt({w, b}, AdamWSettings{0.9, 0.999, 1e-12, 0.5});
  w.mutable_grad() = at::full({2, 2}, 3.0);
  b.mutable_grad() = at::full({2}, -2.0);
  opt.step(0.1);
  EXPECT_NEAR(w[0][0].item<double>(), 1.0 * (1 - 0.1 * 0.5) - 0.1, 1e-6);
  EXPECT_NEAR(b[0].item<double>(), 1.1, 1e-6);
  EXPECT_EQ(opt.steps(), 1);
}

TEST(AdamWUpdate, EachParameterMovesByItsOwnLearningRateScale) {
  // The joint IndexMem stage: the indexer at a fraction of the memory's rate, both in the same step.
  at::Tensor fast = at::full({3}, 1.0).set_requires_grad(true), slow = at::full({3}, 1.0).set_requires_grad(true);
  AdamW opt({fast, slow}, AdamWSettings{0.9, 0.999, 1e-12, 0.0}, {1.0, 0.2});
  fast.mutable_grad() = at::full({3}, 3.0);
  slow.mutable_grad() = at::full({3}, 3.0);
  opt.step(0.1);
  EXPECT_NEAR(fast[0].item<double>(), 0.9, 1e-6);
  EXPECT_NEAR(slow[0].item<double>(), 0.98, 1e-6);
}

TEST(TrainingRows, RowsStartWithBosStayInOneDocumentAndShiftTargets) {
  const std::string tok = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok);
  const auto tokenizer = load_tokenizer(tok);
  test::TempDir dir("rows");
  std::ofstream(dir / "docs.txt") << "Once upon a time there was a cat.\n<|endoftext|>\nThe dog ran far away from home "
                                     "and never came back to the old red house.\n";
  const TrainingRows rows(dir / "docs.txt", *tokenizer, 8, 42);
  const auto d0 = tokenizer->encode("Once upon a time there was a cat.", false);
  const auto d1 = tokenizer->encode("The dog ran far away from home and never came back to the old red house.", false);
  const auto ceil_div = [](std::size_t n, std::size_t k) { return static_cast<std::int64_t>((n + k - 1) / k); };
  EXPECT_EQ(rows.num_rows(), ceil_div(d0.size(), 7) + ceil_div(d1.size(), 7));
  DataPosition pos;
  const Batch all = rows.next(rows.num_rows(), pos);
  EXPECT_EQ(pos.epoch, 0);
  // Every token is a target once, plus once more from BOS when it opens a row that continues a document.
  EXPECT_EQ(all.tokens, static_cast<std::int64_t>(d0.size() + d1.size()) + rows.num_rows() - 2);
  for (std::int64_t r = 0; r < rows.num_rows(); ++r) {
    EXPECT_EQ(all.inputs[r][0].item<std::int64_t>(), tokenizer->bos_id());
    const std::int64_t n = static_cast<std::int64_t>(all.weights[r].sum().item<double>());
    for (std::int64_t t = 0; t + 1 < n; ++t)
      EXPECT_EQ(all.targets[r][t].item<std::int64_t>(), all.inputs[r][t + 1].item<std::int64_t>());
    for (std::int64_t t = n; t < 8; ++t) EXPECT_EQ(all.targets[r][t].item<std::int64_t>(), -1);
  }
  DataPosition again;
  EXPECT_TRUE(at::equal(rows.next(rows.num_rows(), again).inputs, all.inputs));  // order is a function of (seed, epoch)
  rows.next(1, pos);
  EXPECT_EQ(pos.epoch, 1);
  EXPECT_EQ(pos.cursor, 1);
}

// Packed rows read the documents as one stream: every row but the last holds T−1 tokens, rows cross the
// document boundary, and the concatenated rows (in stream order) give back both documents in file order.
TEST(TrainingRows, PackedRowsCrossDocumentBoundariesAndFillRows) {
  const std::string tok = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok);
  const auto tokenizer = load_tokenizer(tok);
  test::TempDir dir("packed_rows");
  std::ofstream(dir / "docs.txt") << "Once upon a time there was a cat.\n<|endoftext|>\nThe dog ran far away from home "
                                     "and never came back to the old red house.\n";
  auto stream = tokenizer->encode("Once upon a time there was a cat.", false);
  for (std::int64_t id : tokenizer->encode("The dog ran far away from home and never came back to the old red house.", false))
    stream.push_back(id);
  const std::int64_t T = 8, n = static_cast<std::int64_t>(stream.size());
  const TrainingRows rows(dir / "docs.txt", *tokenizer, T, 42, RowCutting{/*pack=*/true});
  ASSERT_EQ(rows.num_rows(), (n + T - 2) / (T - 1));
  DataPosition pos;
  const Batch all = rows.next(rows.num_rows(), pos);
  // The shuffled rows, put back in stream order by their first token's offset, spell the stream; each row's
  // targets continue into the next row's first token (one stream, so only the very last row is cut short).
  std::vector<std::int64_t> rebuilt(static_cast<std::size_t>(n), -1);
  std::int64_t full_rows = 0;
  for (std::int64_t r = 0; r < rows.num_rows(); ++r) {
    const std::int64_t scored = static_cast<std::int64_t>(all.weights[r].sum().item<double>());
    full_rows += scored == T;
    std::int64_t start = -1;  // the stream offset whose next T−1 tokens are this row's inputs after BOS
    for (std::int64_t s = 0; s < n && start < 0; s += T - 1) {
      bool same = true;
      for (std::int64_t t = 0; t < std::min(T - 1, n - s); ++t)
        same = same && all.inputs[r][t + 1].item<std::int64_t>() == stream[static_cast<std::size_t>(s + t)];
      if (same) start = s;
    }
    ASSERT_GE(start, 0) << "row " << r;
    for (std::int64_t t = 0; t < scored; ++t) rebuilt[static_cast<std::size_t>(start + t)] = all.targets[r][t].item<std::int64_t>();
  }
  EXPECT_EQ(rebuilt, stream);
  EXPECT_EQ(full_rows, rows.num_rows() - 1);  // every row but the stream's last scores T targets
}

// Shifted rows: epoch 0 is the unshifted cut; a later epoch still holds every token once as an input (the
// multiset of input tokens is the documents'), but cut elsewhere (its set of rows differs from epoch 0's for
// some epoch, with at most one extra, short row for the long document), leaves the document that fits one
// row whole, and is a function of (seed, epoch): a fresh reader at the same position gives the same batch.
TEST(TrainingRows, ShiftedRowsCutEachLaterEpochElsewhereAndKeepEveryTokenOnce) {
  const std::string tok = test::asset("stories260K/tok512.bin");
  KVBOUND_REQUIRE_FILE(tok);
  const auto tokenizer = load_tokenizer(tok);
  test::TempDir dir("shifted_rows");
  const std::string long_doc = "The dog ran far away from home and never came back to the old red house, where the cat "
                               "sat by the window every morning and waited for him to come home again.";
  const std::string short_doc = "A cat.";
  std::ofstream(dir / "docs.txt") << long_doc << "\n<|endoftext|>\n" << short_doc << "\n";
  const std::int64_t T = 8;
  const TrainingRows plain(dir / "docs.txt", *tokenizer, T, 42);
  const TrainingRows shifted(dir / "docs.txt", *tokenizer, T, 42, RowCutting{/*pack=*/false, /*shift=*/true});
  const auto long_ids = tokenizer->encode(long_doc, false), short_ids = tokenizer->encode(short_doc, false);
  ASSERT_GT(static_cast<std::int64_t>(long_ids.size()), 3 * (T - 1));
  ASSERT_LE(static_cast<std::int64_t>(short_ids.size()), T - 1);
  std::multiset<std::int64_t> all_tokens(long_ids.begin(), long_ids.end());
  all_tokens.insert(short_ids.begin(), short_ids.end());
  const std::vector<std::int64_t> short_row = [&] {
    std::vector<std::int64_t> row{tokenizer->bos_id()};
    row.insert(row.end(), short_ids.begin(), short_ids.end());
    return row;
  }();
  // Each row of an epoch as its real inputs (BOS + the row's tokens), the epoch read whole from its start.
  const auto epoch_rows = [&](const TrainingRows& rows, std::int64_t epoch) {
    DataPosition pos{epoch, 0};
    const Batch b = rows.next(rows.num_rows(epoch), pos);
    std::set<std::vector<std::int64_t>> out;
    std::multiset<std::int64_t> inputs;
    for (std::int64_t r = 0; r < b.inputs.size(0); ++r) {
      std::vector<std::int64_t> row{b.inputs[r][0].item<std::int64_t>()};  // BOS; padding is BOS too, text never is
      for (std::int64_t t = 1; t < T && b.inputs[r][t].item<std::int64_t>() != tokenizer->bos_id(); ++t)
        row.push_back(b.inputs[r][t].item<std::int64_t>());
      inputs.insert(row.begin() + 1, row.end());
      out.insert(row);
    }
    EXPECT_EQ(inputs, all_tokens) << "epoch " << epoch;
    return out;
  };
  const auto epoch0 = epoch_rows(shifted, 0);
  EXPECT_EQ(epoch0, epoch_rows(plain, 0));
  bool cut_elsewhere = false;
  for (std::int64_t epoch = 1; epoch <= 4; ++epoch) {
    const auto rows = epoch_rows(shifted, epoch);
    cut_elsewhere = cut_elsewhere || rows != epoch0;
    EXPECT_TRUE(rows.count(short_row)) << "epoch " << epoch;
    EXPECT_LE(shifted.num_rows(epoch), plain.num_rows() + 1);
  }
  EXPECT_TRUE(cut_elsewhere);
  const TrainingRows fresh(dir / "docs.txt", *tokenizer, T, 42, RowCutting{false, true});
  DataPosition a{3, 2}, b{3, 2};
  EXPECT_TRUE(at::equal(shifted.next(3, a).inputs, fresh.next(3, b).inputs));
  EXPECT_EQ(a.epoch, b.epoch);
  EXPECT_EQ(a.cursor, b.cursor);
}

// Data parallelism: rank r of `world` gets rows [r·B, (r+1)·B) of the global batch a single process with batch
// world·B would get, across an epoch boundary too, and every rank's position moves past the whole global batch.
TEST(TrainingRows, ShardsSplitTheGlobalBatchInRankOrder) {
  const auto tokenizer = load_tokenizer(test::asset("stories260K/tok512.bin"));
  const TrainingRows rows(test::asset("text/tinystories_valid_first794KB_hf.txt"), *tokenizer, 16, 7);
  DataPosition alone{0, rows.num_rows() - 3};  // the global batch of 6 crosses into epoch 1
  const Batch global = rows.next(6, alone);
  for (std::int64_t rank = 0; rank < 2; ++rank) {
    DataPosition pos{0, rows.num_rows() - 3};
    const Batch shard = rows.next(3, pos, Shard{rank, 2});
    EXPECT_TRUE(at::equal(shard.inputs, global.inputs.narrow(0, 3 * rank, 3))) << "rank " << rank;
    EXPECT_TRUE(at::equal(shard.weights, global.weights.narrow(0, 3 * rank, 3))) << "rank " << rank;
    EXPECT_EQ(pos.epoch, alone.epoch);
    EXPECT_EQ(pos.cursor, alone.cursor);
  }
}

// The real CLI on stories260K: tiny runs (2 rows of 32 tokens per step, one thread).
class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto cli = test::stories260k_cli();
    cli_ = cli;
    std::ofstream(dir_ / "train.yaml") << test::tiny_train_yaml(cli_, "  steps: 4\n  checkpoint_every: 2\n",
                                                                "trimkv:\n  budget: 8\n  gate_hidden: 16\n");
  }
  std::string train(const std::string& args, int expect = 0) {
    std::string out, err;
    EXPECT_EQ(test::run_kvbound("train " + (dir_ / "train.yaml") + " " + args, &out, &err), expect) << err;
    return err;
  }
  test::TinyCli cli_;
  test::TempDir dir_{"train"};
};

std::vector<nlohmann::json> train_lines(const std::string& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] != "train") continue;
    j.erase("tokens_per_s");  // timing
    out.push_back(j);
  }
  return out;
}

TEST_F(TrainCli, ResumeIsBitIdentical) {
  train("--set run.out_dir=" + (dir_ / "straight"));
  train("--set run.out_dir=" + (dir_ / "resumed") + " --stop-after 2");
  train("--set run.out_dir=" + (dir_ / "resumed") + " --stop-after 1 --resume");
  train("--set run.out_dir=" + (dir_ / "resumed") + " --resume");
  const auto a = read_safetensors(dir_ / "straight/checkpoints/step_0000004.safetensors");
  const auto b = read_safetensors(dir_ / "resumed/checkpoints/step_0000004.safetensors");
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) EXPECT_TRUE(at::equal(t, b.tensors.at(name))) << name;
  EXPECT_EQ(a.metadata.at("cursor"), b.metadata.at("cursor"));
  EXPECT_EQ(train_lines(dir_ / "straight/metrics.jsonl"), train_lines(dir_ / "resumed/metrics.jsonl"));
  EXPECT_EQ(train_lines(dir_ / "straight/metrics.jsonl").size(), 4u);
}

TEST_F(TrainCli, ExportsOfficialNamesAndEvaluatesAgainstHeuristics) {
  train("--set run.out_dir=" + (dir_ / "run") + " --set data.eval_text=" + cli_.valid +
        " --set train.eval_budget=16 --set train.eval_windows=1 --set train.eval_context_len=64 --set train.eval_prefill_len=32");
  std::string out, err;
  ASSERT_EQ(test::run_kvbound("export " + (dir_ / "run") + " --out " + (dir_ / "gates.safetensors"), &out, &err), 0) << err;
  const auto gates = read_safetensors(dir_ / "gates.safetensors");
  EXPECT_EQ(gates.tensors.size(), 5u * 4u);  // 5 layers x (linear1.weight, linear1.bias, linear2.weight, bias)
  EXPECT_EQ(gates.tensors.count("model.layers.4.self_attn.retention_gate.bias"), 1u);
  EXPECT_EQ(gates.metadata.at("method"), "trimkv");
  EXPECT_EQ(gates.metadata.at("budget"), "8");
  EXPECT_EQ(gates.metadata.at("step"), "4");
  ASSERT_EQ(test::run_kvbound("export " + (dir_ / "run") + " --best --out " + (dir_ / "best.safetensors"), &out, &err), 0) << err;
  // The exported gates are the checkpoint's, bit for bit.
  const auto ck = read_safetensors(dir_ / "run/checkpoints/step_0000004.safetensors");
  for (const auto& [name, t] : gates.tensors) EXPECT_TRUE(at::equal(t, ck.tensors.at(name))) << name;

  std::set<std::string> policies;
  ASSERT_EQ(test::tiny_eval(cli_, dir_ / "eval", "--set eval.policies=[trimkv,h2o] --set trimkv.gates=" + (dir_ / "gates.safetensors"),
                            &policies, &err), 0) << err;
  EXPECT_EQ(policies, (std::set<std::string>{"trimkv", "h2o"}));
}

TEST_F(TrainCli, RejectsBadKeysExistingRunsAndMissingGates) {
  std::string err = train("--set trimkv.budgt=3", 1);
  EXPECT_NE(err.find("trimkv.budget"), std::string::npos) << err;
  train("--set run.out_dir=" + (dir_ / "run") + " --set train.steps=1");
  err = train("--set run.out_dir=" + (dir_ / "run") + " --set train.steps=1", 1);
  EXPECT_NE(err.find("--resume"), std::string::npos) << err;
  err = train("--set run.out_dir=" + (dir_ / "run") + " --set train.steps=2 --resume", 1);  // another config
  EXPECT_NE(err.find("differs from the run's (run: 'steps: 1', now: 'steps: 2')"), std::string::npos) << err;
  std::string out;
  EXPECT_EQ(test::run_kvbound("eval --set eval.text=" + cli_.valid + " --set model.path=" + cli_.model +
                                  " --set eval.policies=[trimkv] --set eval.out_dir=" + (dir_ / "e"), &out, &err), 1);
  EXPECT_NE(err.find("trimkv.gates"), std::string::npos) << err;
}

TEST_F(TrainCli, HindsightRankingLossAndContinuingFromEarlierGates) {
  // The ranking loss is logged as its own term; rows of 32 tokens, stride 8: cuts at 7, 15, 23.
  train("--set run.out_dir=" + (dir_ / "base") + " --set trimkv.w_future=1 --set trimkv.future_stride=8");
  const auto lines = train_lines(dir_ / "base/metrics.jsonl");
  ASSERT_EQ(lines.size(), 4u);
  for (const auto& line : lines) EXPECT_GT(line["future"].get<double>(), 0.0) << line.dump();
  // Continuing from the run: one update at a negligible learning rate leaves its gates where they were.
  train("--set run.out_dir=" + (dir_ / "continued") + " --set train.init_from=" + (dir_ / "base") +
        " --set train.steps=1 --set train.lr=1e-12");
  const auto base = read_safetensors(dir_ / "base/checkpoints/step_0000004.safetensors");
  const auto continued = read_safetensors(dir_ / "continued/checkpoints/step_0000001.safetensors");
  for (const auto& [name, t] : base.tensors) {
    if (name.rfind("model.", 0) != 0) continue;  // the gates; not the optimizer state
    EXPECT_LT((continued.tensors.at(name) - t).abs().max().item<double>(), 1e-9) << name;
  }
  std::string err = train("--set run.out_dir=" + (dir_ / "wide") + " --set train.init_from=" + (dir_ / "base") +
                          " --set trimkv.gate_hidden=8", 1);
  EXPECT_NE(err.find("trimkv.gate_hidden: 8 but the gates of train.init_from are 16 wide"), std::string::npos) << err;
  err = train("--set run.out_dir=" + (dir_ / "bad") + " --set trimkv.future_stride=0", 1);
  EXPECT_NE(err.find("trimkv.future_stride"), std::string::npos) << err;
}

TEST_F(TrainCli, NanStopsTheRunNamingTheStepAndTerm) {
  // A copy of the model with one NaN weight: the teacher's logits, hence the KL, become NaN at step 1.
  const fs::path bad = dir_.path() / "nan_model";
  fs::create_directories(bad);
  fs::copy_file(cli_.model + "/config.json", bad / "config.json");
  fs::copy_file(cli_.model + "/tok512.bin", bad / "tok512.bin");
  SafetensorsFile m = read_safetensors(cli_.model + "/model.safetensors");
  m.tensors.at("model.layers.2.mlp.down_proj.weight")[0][0] = std::nan("");
  write_safetensors((bad / "model.safetensors").string(), m.tensors, m.metadata);
  const std::string err = train("--set model.path=" + bad.string() + " --set run.out_dir=" + (dir_ / "run"), 1);
  EXPECT_NE(err.find("step 1: loss term"), std::string::npos) << err;
  EXPECT_NE(err.find("is nan"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(dir_.path() / "run/checkpoints/LATEST"));
}

}  // namespace
}  // namespace kvbound
