// Randomized property test: thousands of random create / fork / append / truncate / prune /
// evict / match / token-tree / accept / view / page-limit / namespace-eviction operations over
// a few cache namespaces from fixed seeds, each followed by the full shadow check of
// kv_cache_model.h (invariants, global and per-namespace accounting, every live branch's
// tokens, page table and KV read back), then a drain to an idle, empty cache.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tests/kvcache/kv_cache_model.h"

namespace treeserve {
namespace {

using testing::KvOpCounts;
using testing::run_kv_cache_program;

std::vector<uint8_t> random_bytes(uint64_t seed, size_t n) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// Many short programs: every page size, pool sizes from 1 page up.
TEST(KvCacheProperty, ShortRandomPrograms) {
  KvOpCounts counts;
  for (uint64_t seed = 1; seed <= 40 * testing::kProgramScale; ++seed) {
    const std::vector<uint8_t> bytes = random_bytes(seed, 2000);
    const std::string err = run_kv_cache_program(bytes, 250, &counts);
    ASSERT_TRUE(err.empty()) << "seed " << seed << ": " << err;
  }
  // The programs must actually exercise every operation and the interesting outcomes.
  for (int op = 0; op < testing::kNumKvOps; ++op) EXPECT_GT(counts.ok[op], 0) << "op " << op;
  EXPECT_GT(counts.exhausted, 0);
  EXPECT_GT(counts.rejected, 0);
  EXPECT_GT(counts.copies, 0);
  EXPECT_GT(counts.moves, 0);
  EXPECT_GT(counts.cached_tokens, 0);
  EXPECT_GT(counts.limit_refusals, 0);
}

// A few long programs on one cache each, so trees grow deep and eviction runs often
// (one on a 264-page pool, where reserve evicts in batches of 4).
TEST(KvCacheProperty, LongRandomPrograms) {
  KvOpCounts counts;
  for (uint64_t seed = 1000; seed < 1002 + (testing::kProgramScale > 1); ++seed) {
    std::vector<uint8_t> bytes = random_bytes(seed, 40000);
    bytes[1] = seed == 1001 ? 255 : 95;  // 96 pages, or 64 + bytes[2]
    bytes[2] = 200;
    const std::string err = run_kv_cache_program(bytes, 2000, &counts);
    ASSERT_TRUE(err.empty()) << "seed " << seed << ": " << err;
  }
  int64_t total = 0;
  for (int op = 0; op < testing::kNumKvOps; ++op) total += counts.ok[op];
  EXPECT_GT(total, 2000);
}

}  // namespace
}  // namespace treeserve
