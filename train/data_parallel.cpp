#include "train/data_parallel.h"

// Compiled without the shared precompiled header (a file-level define, see CMakeLists.txt): ATen in full.
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#ifdef KVBOUND_GLOO  // defined when the gloo headers were found (KVBOUND_WITH_GLOO, CMakeLists.txt)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "base/errors.h"
#include "ops/cuda_module.h"

namespace kvbound {
namespace {

std::optional<std::int64_t> env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  if (*end != '\0') fail("environment", name, "'" + std::string(value) + "' is not an integer");
  return v;
}

constexpr std::int64_t kBucketBytes = 25 << 20;

}  // namespace

struct DataParallel::Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;  // ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA)
  c10::Device device = c10::kCPU;             // where the collectives' tensors live
};

std::optional<DistributedEnv> distributed_env() {
  const std::optional<std::int64_t> world = env_int("WORLD_SIZE");
  if (!world || *world == 1) return std::nullopt;
  DistributedEnv e;
  e.world = *world;
  if (e.world < 1) fail("environment", "WORLD_SIZE", "must be >= 1");
  const std::optional<std::int64_t> rank = env_int("RANK");
  if (!rank) fail("environment", "RANK", "missing (WORLD_SIZE is " + std::to_string(e.world) + ")");
  e.rank = *rank;
  if (e.rank < 0 || e.rank >= e.world) fail("environment", "RANK", "must be in [0, WORLD_SIZE)");
  e.local_rank = env_int("LOCAL_RANK").value_or(e.rank);
  if (const char* addr = std::getenv("MASTER_ADDR")) e.master_addr = addr;
  e.master_port = env_int("MASTER_PORT").value_or(29500);
  if (e.master_port < 1 || e.master_port > 65535) fail("environment", "MASTER_PORT", "must be a TCP port");
  return e;
}

DataParallel::DataParallel(const DistributedEnv& env, c10::Device device, double timeout_s)
    : env_(env), group_(std::make_unique<Group>()) {
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = env.rank == 0;
  options.numWorkers = static_cast<std::size_t>(env.world);
  options.waitWorkers = true;
  options.timeout = timeout;
  try {
    group_->store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    if (device.is_cuda()) {
      using Factory = void* (*)(const void*, int, int, long);
      const auto make_nccl = reinterpret_cast<Factory>(cuda_module_symbol("kvbound_make_nccl_backend"));
      if (make_nccl == nullptr) fail("data parallel", "model.device", "CUDA without the CUDA module's ProcessGroupNCCL");
      group_->backend = c10::intrusive_ptr<c10d::Backend>::reclaim(static_cast<c10d::Backend*>(
          make_nccl(&group_->store, static_cast<int>(env.rank), static_cast<int>(env.world), static_cast<long>(timeout.count()))));
      group_->device = device;
    } else {
#ifdef KVBOUND_GLOO
      auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
      gloo_options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(env.master_addr == "localhost" ? "127.0.0.1" : env.master_addr));
      group_->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(group_->store, static_cast<int>(env.rank),
                                                                    static_cast<int>(env.world), gloo_options);
#else
      fail("data parallel", "model.device", "CPU processes need ProcessGroupGloo, and this kvbound was built without "
           "the gloo headers (KVBOUND_WITH_GLOO=OFF): use CUDA devices or rebuild with libgloo-dev");
#endif
    }
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    fail("data parallel", env.master_addr + ":" + std::to_string(env.master_port),
         "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world) + " could not join: " +
             what.substr(0, what.find('\n')));
  }
}

DataParallel::~DataParallel() = default;

void DataParallel::reduce(const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  std::size_t begin = 0;
  while (begin < params.size()) {
    // One bucket: consecutive parameters up to kBucketBytes, flattened into one float32 CPU buffer.
    std::size_t end = begin;
    std::int64_t bytes = 0;
    std::vector<at::Tensor> parts;
    while (end < params.size() && (end == begin || bytes + params[end].numel() * 4 <= kBucketBytes)) {
      const at::Tensor& p = params[end];
      parts.push_back(p.grad().defined() ? p.grad().to(group_->device, at::kFloat).flatten()
                                         : at::zeros({p.numel()}, at::TensorOptions().dtype(at::kFloat).device(group_->device)));
      bytes += p.numel() * 4;
      ++end;
    }
    std::vector<at::Tensor> bucket{at::cat(parts)};
    group_->backend->allreduce(bucket)->wait();
    const at::Tensor mean = bucket[0] / static_cast<double>(env_.world);
    std::int64_t offset = 0;
    for (std::size_t i = begin; i < end; ++i) {
      const at::Tensor& p = params[i];
      const at::Tensor slice = mean.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(slice);
      else p.mutable_grad() = slice.to(p.device(), p.scalar_type()).clone();
      offset += p.numel();
    }
    begin = end;
  }
}

void DataParallel::synchronize(const std::vector<at::Tensor>& params) {
  const at::NoGradGuard no_grad;
  for (const at::Tensor& p : params) {
    std::vector<at::Tensor> t{p.detach().to(group_->device).contiguous().clone()};
    group_->backend->broadcast(t)->wait();
    p.copy_(t[0]);
  }
}

void DataParallel::reduce_report(StepReport& report) {
  // One allreduce of every number, in a fixed order (the maps are sorted and hold the same keys on every rank).
  std::vector<double> values{report.loss, static_cast<double>(report.tokens)};
  for (const auto& [k, v] : report.terms) values.push_back(v);
  for (const auto& [k, v] : report.stats) values.push_back(v);
  values.insert(values.end(), report.per_layer.begin(), report.per_layer.end());
  std::vector<at::Tensor> t{at::tensor(values, at::TensorOptions().dtype(at::kDouble)).to(group_->device)};
  group_->backend->allreduce(t)->wait();
  const at::Tensor sum = t[0].to(at::kCPU);
  const double* s = sum.data_ptr<double>();
  const auto world = static_cast<double>(env_.world);
  std::size_t i = 0;
  report.loss = s[i++] / world;
  report.tokens = static_cast<std::int64_t>(std::llround(s[i++]));
  for (auto& [k, v] : report.terms) v = s[i++] / world;
  for (auto& [k, v] : report.stats) v = s[i++] / world;
  for (double& v : report.per_layer) v = s[i++] / world;
}

}  // namespace kvbound
