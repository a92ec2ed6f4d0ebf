// KVCache: appends keep order and positions, retain() keeps a different subset per KV head, growth
// keeps earlier entries intact.
#include <ATen/ops/arange.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tensor.h>
#include <gtest/gtest.h>

#include "modules/kv_cache.h"

using namespace kvbound;

TEST(KVCache, AppendsGrowAndKeepEarlierEntries) {
  KVCache cache(2);
  const at::Tensor k1 = at::randn({1, 2, 50, 4}), v1 = at::randn({1, 2, 50, 4});
  const at::Tensor k2 = at::randn({1, 2, 30, 4}), v2 = at::randn({1, 2, 30, 4});
  cache.append(1, k1, v1, at::arange(0, 50, at::kLong));
  cache.append(1, k2, v2, at::arange(50, 80, at::kLong));  // forces a reallocation past 64
  EXPECT_EQ(cache.size(1), 80);
  EXPECT_EQ(cache.size(0), 0);
  EXPECT_TRUE(at::equal(cache.keys(1).narrow(2, 0, 50), k1));
  EXPECT_TRUE(at::equal(cache.values(1).narrow(2, 50, 30), v2));
  EXPECT_TRUE(at::equal(cache.positions(1)[0][1], at::arange(0, 80, at::kLong)));
  EXPECT_EQ(cache.live_bytes(), 2 * 80 * 2 * 4 * 4);
}

TEST(KVCache, RetainKeepsADifferentSubsetPerHead) {
  KVCache cache(1);
  const at::Tensor k = at::randn({1, 2, 6, 3}), v = at::randn({1, 2, 6, 3});
  cache.append(0, k, v, at::arange(10, 16, at::kLong));
  const at::Tensor keep = at::tensor(std::vector<std::int64_t>{0, 3, 5, 1, 2, 4}, at::kLong).view({1, 2, 3});
  cache.retain(0, keep);
  ASSERT_EQ(cache.size(0), 3);
  EXPECT_TRUE(at::equal(cache.positions(0)[0][0], at::tensor(std::vector<std::int64_t>{10, 13, 15})));
  EXPECT_TRUE(at::equal(cache.positions(0)[0][1], at::tensor(std::vector<std::int64_t>{11, 12, 14})));
  EXPECT_TRUE(at::equal(cache.keys(0)[0][1][2], k[0][1][4]));
  EXPECT_TRUE(at::equal(cache.values(0)[0][0][1], v[0][0][3]));
  // Appending after an eviction continues behind the kept entries.
  cache.append(0, at::randn({1, 2, 1, 3}), at::randn({1, 2, 1, 3}), at::arange(16, 17, at::kLong));
  EXPECT_EQ(cache.positions(0)[0][0][3].item<std::int64_t>(), 16);
}
