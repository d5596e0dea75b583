// Helpers shared by the KvCache unit tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

#include "kvcache/kv_cache.h"

namespace treeserve::testing {

inline std::unique_ptr<KvCache> make_cache(int32_t num_pages, int32_t page_size = 4) {
  KvCacheConfig config;
  config.page_size = page_size;
  config.num_pages = num_pages;
  StatusOr<std::unique_ptr<KvCache>> cache = KvCache::create(config);
  EXPECT_TRUE(cache.ok()) << cache.status().ToString();
  return std::move(cache).value();
}

// n consecutive token ids from `first`.
inline std::vector<int32_t> seq(int32_t n, int32_t first = 100) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline std::vector<int32_t> tokens_of(const KvCache& cache, BranchId id) {
  std::vector<int32_t> out;
  EXPECT_TRUE(cache.branch_tokens(id, &out).ok());
  return out;
}

inline std::vector<int32_t> page_table_of(const KvCache& cache, BranchId id) {
  std::vector<int32_t> out;
  EXPECT_TRUE(cache.branch_page_table(id, &out).ok());
  return out;
}

inline bool stats_equal(const KvCacheStats& a, const KvCacheStats& b) {
  return a.pages_total == b.pages_total && a.pages_free == b.pages_free &&
         a.pages_used == b.pages_used && a.pages_locked == b.pages_locked &&
         a.pages_evictable == b.pages_evictable && a.radix_cached_tokens == b.radix_cached_tokens &&
         a.radix_nodes == b.radix_nodes && a.live_branches == b.live_branches;
}

inline bool ns_stats_equal(const NamespaceStats& a, const NamespaceStats& b) {
  return a.pages_locked == b.pages_locked && a.pages_evictable == b.pages_evictable &&
         a.live_branches == b.live_branches && a.page_limit == b.page_limit;
}

#define EXPECT_KV_HEALTHY(cache)                                \
  do {                                                          \
    const ::treeserve::Status _st = (cache).check_invariants(); \
    EXPECT_TRUE(_st.ok()) << _st.ToString();                    \
    const ::treeserve::KvCacheStats _s = (cache).stats();       \
    EXPECT_EQ(_s.pages_free + _s.pages_used, _s.pages_total);   \
  } while (0)

}  // namespace treeserve::testing
