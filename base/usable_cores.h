// How many cores this process may keep busy: what "0 = every core" means for model.threads, --threads, a sweep's
// per-job share and --nproc's per-rank share. std::thread::hardware_concurrency counts the machine's online
// CPUs; a container limited to 2 CPUs on a 64-core host (a CPU affinity mask or a cgroup CPU quota) would then
// start 64 spinning OpenMP threads on 2 cores' worth of time and run many times slower. Torch-free.
#pragma once
#include <optional>
#include <string>

namespace kvbound {

// min(CPUs in this process's affinity mask, the cgroup CPU quota rounded up), at least 1.
int usable_cores();

// The CPU count a cgroup v2 `cpu.max` line allows ("QUOTA PERIOD" → ceil(QUOTA / PERIOD), at least 1;
// "max PERIOD" → no limit). Anything else (empty, malformed, zero period) → no limit.
std::optional<int> cgroup_v2_cpu_limit(const std::string& cpu_max);

// The same for cgroup v1's cpu.cfs_quota_us and cpu.cfs_period_us contents (quota −1: no limit).
std::optional<int> cgroup_v1_cpu_limit(const std::string& quota_us, const std::string& period_us);

}  // namespace kvbound
