// Data-parallel training on LibTorch's c10d: one process per rank, torchrun's environment contract (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), a TCPStore rendezvous at MASTER_ADDR:MASTER_PORT (rank 0
// serves it) and ProcessGroupGloo between the processes on CPUs, ProcessGroupNCCL (from the CUDA module) on CUDA
// devices, one device per process. Every rank draws the same global batch and trains on its shard (data/training_rows.h); the trainer
// calls reduce() between backward and clipping, so every rank applies the same averaged gradient — the update
// of one process with world × B rows when the rows weigh alike (as with gradient accumulation, each shard's
// loss is its own mean). Logs, checkpoints and evaluations are rank 0's.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "train/trainer.h"

namespace kvbound {

struct DistributedEnv {
  std::int64_t rank = 0, world = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::int64_t master_port = 29500;
};

// The environment's group, or nothing when WORLD_SIZE is unset or 1; kvbound::Error naming the variable for a
// malformed or inconsistent value.
std::optional<DistributedEnv> distributed_env();

class DataParallel final : public GradientReducer {
 public:
  // Joins the group (blocks until every rank has connected; kvbound::Error after `timeout_s` without them);
  // the collectives run on `device` (the run's: Gloo for the CPU, NCCL for a CUDA device).
  DataParallel(const DistributedEnv& env, c10::Device device, double timeout_s = 300);
  ~DataParallel() override;

  std::int64_t rank() const { return env_.rank; }
  std::int64_t world() const { return env_.world; }
  // Makes every rank's parameters rank 0's.
  void synchronize(const std::vector<at::Tensor>& params) override;
  // Averages the parameters' gradients over the ranks, in buckets of at most 25 MB (a missing gradient counts
  // as zeros, so every rank sends the same buckets).
  void reduce(const std::vector<at::Tensor>& params) override;
  // Loss, terms, statistics and per-layer numbers averaged over the ranks, tokens summed.
  void reduce_report(StepReport& report) override;

 private:
  struct Group;
  DistributedEnv env_;
  std::unique_ptr<Group> group_;
};

}  // namespace kvbound
