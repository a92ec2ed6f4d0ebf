// base/usable_cores.h: what "0 threads" resolves to — the cgroup quota parsers on every form the kernel writes
// (and malformed ones), and that the live count respects this process's CPU affinity mask.
#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

#include "base/usable_cores.h"

namespace kvbound {
namespace {

TEST(UsableCores, CgroupV2CpuMax) {
  EXPECT_EQ(cgroup_v2_cpu_limit("200000 100000\n"), 2);
  EXPECT_EQ(cgroup_v2_cpu_limit("150000 100000"), 2);  // 1.5 CPUs of time: two threads can use it
  EXPECT_EQ(cgroup_v2_cpu_limit("50000 100000"), 1);   // under one CPU still runs one thread
  EXPECT_EQ(cgroup_v2_cpu_limit("max 100000\n"), std::nullopt);
  for (const char* bad : {"", "\n", "200000", "200000 0", "0 100000", "-1 100000", "2e5 100000", "200000 100000 7"})
    EXPECT_EQ(cgroup_v2_cpu_limit(bad), std::nullopt) << "'" << bad << "'";
}

TEST(UsableCores, CgroupV1Quota) {
  EXPECT_EQ(cgroup_v1_cpu_limit("400000\n", "100000\n"), 4);
  EXPECT_EQ(cgroup_v1_cpu_limit("-1\n", "100000\n"), std::nullopt);  // no quota
  EXPECT_EQ(cgroup_v1_cpu_limit("", ""), std::nullopt);              // no cgroup v1 cpu controller
  EXPECT_EQ(cgroup_v1_cpu_limit("100000", "abc"), std::nullopt);
}

TEST(UsableCores, FollowsTheAffinityMask) {
  cpu_set_t original;
  ASSERT_EQ(sched_getaffinity(0, sizeof(original), &original), 0);
  const int before = usable_cores();
  EXPECT_GE(before, 1);
  EXPECT_LE(before, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_LE(before, CPU_COUNT(&original));
  // Pinned to one CPU (as `taskset -c N` would), the process may use one core whatever the machine has.
  int first = 0;
  while (!CPU_ISSET(first, &original)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  const int pinned = usable_cores();
  ASSERT_EQ(sched_setaffinity(0, sizeof(original), &original), 0);
  EXPECT_EQ(pinned, 1);
  EXPECT_EQ(usable_cores(), before);
}

}  // namespace
}  // namespace kvbound
