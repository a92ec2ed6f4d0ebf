#include "base/usable_cores.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

namespace kvbound {
namespace {

std::optional<int> cores_for(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return std::nullopt;
  return std::max(1, static_cast<int>(std::ceil(quota / period)));
}

std::string read_small_file(const char* path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return in ? text.str() : std::string();
}

// Whole-number parse of the entire trimmed text; nothing else counts.
std::optional<double> parse_number(const std::string& text) {
  std::istringstream in(text);
  long long value = 0;
  if (!(in >> value)) return std::nullopt;
  in >> std::ws;
  if (!in.eof()) return std::nullopt;
  return static_cast<double>(value);
}

}  // namespace

std::optional<int> cgroup_v2_cpu_limit(const std::string& cpu_max) {
  std::istringstream in(cpu_max);
  std::string quota, period, extra;
  if (!(in >> quota >> period) || (in >> extra) || quota == "max") return std::nullopt;
  const std::optional<double> q = parse_number(quota), p = parse_number(period);
  return q && p ? cores_for(*q, *p) : std::nullopt;
}

std::optional<int> cgroup_v1_cpu_limit(const std::string& quota_us, const std::string& period_us) {
  const std::optional<double> q = parse_number(quota_us), p = parse_number(period_us);
  return q && p ? cores_for(*q, *p) : std::nullopt;
}

int usable_cores() {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cores = std::min(cores, std::max(1, CPU_COUNT(&mask)));
  // The process's own cgroup is mounted at /sys/fs/cgroup inside a container (cgroup namespaces), which is where
  // a quota that matters is; on a host without one these files say "max" or are absent.
  std::optional<int> limit = cgroup_v2_cpu_limit(read_small_file("/sys/fs/cgroup/cpu.max"));
  if (!limit)
    limit = cgroup_v1_cpu_limit(read_small_file("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                                read_small_file("/sys/fs/cgroup/cpu/cpu.cfs_period_us"));
  return limit ? std::min(cores, *limit) : cores;
}

}  // namespace kvbound
