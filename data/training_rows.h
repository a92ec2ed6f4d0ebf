// Training windows for the learned methods: documents (from a text/jsonl file, tokenized at start-up, or an
// HDF5 token dataset from `kvbound prepare`, read lazily) are cut into rows of at most T tokens that never
// cross a document boundary. Row j of a document covers its tokens [j·(T−1), (j+1)·(T−1)) after a BOS:
//
//   inputs  = BOS, d[s], …, d[s+n−1]         (n ≤ T−1, s = j·(T−1))
//   targets = d[s], …, d[s+n−1], d[s+n]      (the last one is padding, weight 0, when the document ends)
//
// so every row starts like a fresh sequence (its attention sink in place, positions from 0) and no token
// attends across documents: the document mask is structural, nothing to mask inside a row. Short rows
// are padded to T with weight-0 positions; padding comes after every real token, so causal attention
// never lets it change a real position.
//
// Packed (`pack`): the documents are read as one stream in file order and cut into rows of T−1 tokens
// across their boundaries, so short documents (stories of ~200 tokens) fill whole rows and the model sees
// the deployment's context length; a boundary is then visible only as the EOS a dataset prepared with
// `kvbound prepare --add-eos` carries. Attention crosses documents there, for the frozen teacher and the
// student alike, as it does in the continuous text a deployment reads.
//
// Shifted (`shift`): epoch 0 cuts rows as above; each later epoch cuts every document (or the packed stream)
// longer than one row at another offset o in [0, T−1) drawn from (seed, epoch): a short first row of its o
// first tokens, then full rows from there. Every token is still an input once per epoch, but a small text
// repeated for many epochs shows each token at other positions after other contexts, instead of the same
// rows again.
//
// Recall tasks (`recall_share` > 0): a drawn share of the full rows is rewritten as a synthetic recall task of
// the same length (data/recall_tasks.h), a function of (seed, epoch, row) like everything above.
//
// Order: rows are shuffled per epoch by a permutation drawn from (seed, epoch) alone, so the data position
// (epoch, cursor) is all a checkpoint needs to resume the exact same batches. Data-parallel training shards
// each global batch: with `world` processes an update draws world × B rows, and rank r takes rows
// [r·B, (r+1)·B) of them, so every rank's position stays the same (epoch, cursor).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/recall_tasks.h"
#include "data/tokenizer.h"

namespace kvbound {

struct Batch {
  at::Tensor inputs;   // [B, T] int64 (padding: BOS id, never a target)
  at::Tensor targets;  // [B, T] int64 (-1 at padding)
  at::Tensor weights;  // [B, T] float32: 1 where a target exists
  std::int64_t tokens = 0;  // weighted positions

  // The same batch on `device` (tensors are made on the CPU; a no-op there).
  Batch to(const at::Device& device) const;
};

// This process's share of every global batch: rank in [0, world).
struct Shard {
  std::int64_t rank = 0, world = 1;
};

struct DataPosition {
  std::int64_t epoch = 0, cursor = 0;  // cursor: rows of this epoch already consumed
};

// How documents become rows (above).
struct RowCutting {
  bool pack = false;   // rows cross document boundaries
  bool shift = false;  // every epoch after the first cuts at another offset
};

class TrainingRows {
 public:
  // `path`: .txt/.jsonl (documents split as `kvbound prepare` does) or .h5 (checked against `tokenizer`).
  // Throws kvbound::Error naming the path when it yields no row. With recall_share > 0, `tokenizer` must
  // outlive the rows (the tasks are tokenized as they are drawn).
  TrainingRows(const std::string& path, const Tokenizer& tokenizer, std::int64_t seq_len, std::uint64_t seed,
               RowCutting cutting = {}, double recall_share = 0);
  ~TrainingRows();

  // Rows of an epoch (with `shift`, a later epoch may hold one more per document: its short first row).
  std::int64_t num_rows(std::int64_t epoch = 0) const { return static_cast<std::int64_t>(rows(epoch).size()); }
  std::int64_t num_tokens() const { return total_tokens_; }
  std::int64_t seq_len() const { return seq_len_; }

  // The next `batch_size` rows of `shard` from `position`, which advances past the whole global batch
  // (shard.world × batch_size rows; a new epoch reshuffles).
  Batch next(std::int64_t batch_size, DataPosition& position, const Shard& shard = {}) const;

 private:
  struct Row {
    std::int64_t start, count, doc_end;  // absolute token offsets: d[start, start+count); its document ends at doc_end
  };
  std::vector<std::int32_t> read(std::int64_t begin, std::int64_t count) const;
  std::vector<Row> cut(std::int64_t offset) const;
  const std::vector<Row>& rows(std::int64_t epoch) const;
  const std::vector<std::int64_t>& order(std::int64_t epoch) const;

  struct Source;
  std::unique_ptr<Source> source_;
  std::int64_t seq_len_, bos_;
  std::uint64_t seed_;
  bool shift_;
  std::optional<RecallTasks> recall_;
  std::int64_t total_tokens_ = 0;
  std::vector<std::int64_t> doc_offsets_;  // after packing: {0, total}
  std::vector<Row> unshifted_rows_;
  mutable std::int64_t shifted_epoch_ = -1, order_epoch_ = -1;
  mutable std::vector<Row> shifted_rows_;
  mutable std::vector<std::int64_t> cached_order_;
};

}  // namespace kvbound
