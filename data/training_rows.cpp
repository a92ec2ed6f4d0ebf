#include "data/training_rows.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "base/errors.h"
#include "data/token_dataset.h"

namespace kvbound {

// Either every token in memory (a text file tokenized at start-up) or an open HDF5 dataset.
struct TrainingRows::Source {
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> offsets{0};
  std::unique_ptr<TokenDataset> dataset;
};

TrainingRows::TrainingRows(const std::string& path, const Tokenizer& tokenizer, std::int64_t seq_len, std::uint64_t seed,
                           RowCutting cutting, double recall_share)
    : source_(std::make_unique<Source>()), seq_len_(seq_len), bos_(tokenizer.bos_id()), seed_(seed),
      shift_(cutting.shift) {
  if (recall_share != 0) recall_.emplace(tokenizer, recall_share, seed);
  if (seq_len < 2) fail("config", "train.seq_len", "must be >= 2");
  if (bos_ < 0) fail(path, "tokenizer", "has no BOS token; training rows start with BOS");
  const std::string ext = std::filesystem::path(path).extension().string();
  std::vector<std::int64_t> offsets;
  if (ext == ".h5" || ext == ".hdf5") {
    source_->dataset = std::make_unique<TokenDataset>(TokenDataset::open(path, &tokenizer));
    offsets = source_->dataset->doc_offsets();
  } else {
    check_document_file(path);
    for_each_document(path, DocumentFormat{}, [&](std::string&& text) {
      for (std::int64_t id : tokenizer.encode(text, /*add_bos=*/false)) source_->tokens.push_back(static_cast<std::int32_t>(id));
      source_->offsets.push_back(static_cast<std::int64_t>(source_->tokens.size()));
    });
    offsets = source_->offsets;
  }
  if (cutting.pack) offsets = {0, offsets.back()};  // one stream: rows cut across document boundaries
  doc_offsets_ = std::move(offsets);
  total_tokens_ = doc_offsets_.back();
  unshifted_rows_ = cut(0);
  if (unshifted_rows_.empty()) fail(path, "documents", "no tokens to train on");
}

TrainingRows::~TrainingRows() = default;

std::vector<TrainingRows::Row> TrainingRows::cut(std::int64_t offset) const {
  const std::int64_t span = seq_len_ - 1;
  std::vector<Row> rows;
  for (std::size_t d = 0; d + 1 < doc_offsets_.size(); ++d) {
    const std::int64_t begin = doc_offsets_[d], end = doc_offsets_[d + 1];
    std::int64_t s = begin;
    if (offset > 0 && end - begin > span) {  // a document that fits one row is cut the same at any offset
      rows.push_back({begin, offset, end});
      s += offset;
    }
    for (; s < end; s += span) rows.push_back({s, std::min(span, end - s), end});
  }
  return rows;
}

const std::vector<TrainingRows::Row>& TrainingRows::rows(std::int64_t epoch) const {
  if (!shift_ || epoch == 0) return unshifted_rows_;
  if (epoch != shifted_epoch_) {
    // Its own stream, apart from the order's: the offset depends on (seed, epoch) only.
    std::mt19937_64 rng((seed_ ^ 0xD1B54A32D192ED03ull) * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch));
    shifted_rows_ = cut(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(seq_len_ - 1)));
    shifted_epoch_ = epoch;
  }
  return shifted_rows_;
}

std::vector<std::int32_t> TrainingRows::read(std::int64_t begin, std::int64_t count) const {
  if (source_->dataset) return source_->dataset->tokens(begin, count);
  return {source_->tokens.begin() + begin, source_->tokens.begin() + begin + count};
}

const std::vector<std::int64_t>& TrainingRows::order(std::int64_t epoch) const {
  if (epoch != order_epoch_) {
    cached_order_.resize(rows(epoch).size());
    for (std::size_t i = 0; i < cached_order_.size(); ++i) cached_order_[i] = static_cast<std::int64_t>(i);
    // The permutation depends on (seed, epoch) only; std::shuffle's algorithm is fixed by libstdc++, and
    // the engine's sequence by the standard.
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(epoch) + 1);
    std::shuffle(cached_order_.begin(), cached_order_.end(), rng);
    order_epoch_ = epoch;
  }
  return cached_order_;
}

Batch TrainingRows::next(std::int64_t batch_size, DataPosition& position, const Shard& shard) const {
  TORCH_CHECK(shard.world >= 1 && shard.rank >= 0 && shard.rank < shard.world, "TrainingRows::next: bad shard");
  const std::int64_t T = seq_len_;
  std::vector<std::int64_t> inputs(static_cast<std::size_t>(batch_size * T), bos_), targets(inputs.size(), -1);
  std::vector<float> weights(inputs.size(), 0.f);
  Batch batch;
  for (std::int64_t g = 0; g < shard.world * batch_size; ++g) {
    if (position.cursor >= num_rows(position.epoch)) {
      ++position.epoch;
      position.cursor = 0;
    }
    const std::int64_t drawn = order(position.epoch)[static_cast<std::size_t>(position.cursor++)];
    if (g / batch_size != shard.rank) continue;  // another rank's row
    const std::int64_t b = g % batch_size;
    const Row& r = rows(position.epoch)[static_cast<std::size_t>(drawn)];
    const bool has_next = r.start + r.count < r.doc_end;
    std::vector<std::int32_t> ids = read(r.start, r.count + (has_next ? 1 : 0));
    if (recall_ && r.count == T - 1 && has_next)
      if (auto task = recall_->plant(position.epoch, drawn, ids)) ids = std::move(task->tokens);
    const std::size_t row = static_cast<std::size_t>(b * T);
    for (std::int64_t i = 0; i < r.count; ++i) inputs[row + static_cast<std::size_t>(i) + 1] = ids[static_cast<std::size_t>(i)];
    const std::int64_t scored = r.count + (has_next ? 1 : 0);
    for (std::int64_t i = 0; i < scored; ++i) {
      targets[row + static_cast<std::size_t>(i)] = ids[static_cast<std::size_t>(i)];
      weights[row + static_cast<std::size_t>(i)] = 1.f;
    }
    batch.tokens += scored;
  }
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  batch.inputs = at::from_blob(inputs.data(), {batch_size, T}, i64).clone();
  batch.targets = at::from_blob(targets.data(), {batch_size, T}, i64).clone();
  batch.weights = at::from_blob(weights.data(), {batch_size, T}, at::TensorOptions().dtype(at::kFloat)).clone();
  return batch;
}

Batch Batch::to(const at::Device& device) const {
  Batch out = *this;
  out.inputs = inputs.to(device);
  out.targets = targets.to(device);
  out.weights = weights.to(device);
  return out;
}

}  // namespace kvbound
