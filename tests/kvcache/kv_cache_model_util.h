// Pieces of the KvCache shadow model (kv_cache_model.h) that stand on their own: the byte
// reader, the operation kinds and counts, the KV hash, stats comparisons, and the checks of the
// per-namespace counts.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/kv_cache.h"

namespace treeserve::testing {

// Unoptimized builds (Debug, the ASan + UBSan build) run the interpreter ~50x slower than
// Release; the property test and the replay driver run this many times more programs when
// optimized, so the suite stays fast everywhere and Release covers more.
#ifdef __OPTIMIZE__
inline constexpr int kProgramScale = 4;
#else
inline constexpr int kProgramScale = 1;
#endif

// Reads bytes as small integers; an exhausted source yields zeros.
class ByteSource {
 public:
  explicit ByteSource(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool empty() const { return pos_ >= bytes_.size(); }
  uint8_t byte() { return empty() ? 0 : bytes_[pos_++]; }
  // In [0, n), n <= 65536.
  uint32_t below(uint32_t n) {
    if (n <= 1) return 0;
    uint32_t v = byte();
    if (n > 256) v = v << 8 | byte();
    return v % n;
  }
  int32_t in(int32_t lo, int32_t hi) { return lo + static_cast<int32_t>(below(hi - lo + 1)); }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

enum KvOp : int {
  kOpCreate,
  kOpAppend,
  kOpFork,
  kOpTruncate,
  kOpPrune,
  kOpEvict,
  kOpMatch,
  kOpTokenTree,
  kOpAccept,
  kOpView,
  kOpBadCall,
  kOpLimit,  // set_namespace_page_limit or reserve_pages
  kOpEvictNamespace,
  kNumKvOps
};

// The namespaces programs use (a large id too, so ids are not slots).
inline constexpr CacheNamespace kModelNamespaces[] = {0, 1, 7, 0xffffffffu};
inline constexpr int kNumModelNamespaces = 4;

struct KvOpCounts {
  int64_t ok[kNumKvOps] = {};
  int64_t exhausted = 0;       // calls refused with RESOURCE_EXHAUSTED
  int64_t rejected = 0;        // calls refused as expected (bad ids / arguments / state)
  int64_t copies = 0;          // PageCopy entries applied
  int64_t moves = 0;           // SlotMove entries applied
  int64_t cached_tokens = 0;   // prompt tokens reused by create_branch
  int64_t limit_refusals = 0;  // RESOURCE_EXHAUSTED explained by a namespace page limit
};

inline uint64_t kv_hash(uint64_t prev, int32_t token) {
  uint64_t x = prev ^ (static_cast<uint64_t>(static_cast<uint32_t>(token)) + 0x9e3779b97f4a7c15ull +
                       (prev << 6) + (prev >> 2));
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x | 1;  // 0 marks a slot never written
}

inline bool same_ns_stats(const NamespaceStats& a, const NamespaceStats& b) {
  return a.pages_locked == b.pages_locked && a.pages_evictable == b.pages_evictable &&
         a.live_branches == b.live_branches && a.page_limit == b.page_limit;
}

inline bool same_stats(const KvCacheStats& a, const KvCacheStats& b) {
  return a.pages_total == b.pages_total && a.pages_free == b.pages_free &&
         a.pages_used == b.pages_used && a.pages_locked == b.pages_locked &&
         a.pages_evictable == b.pages_evictable && a.radix_cached_tokens == b.radix_cached_tokens &&
         a.radix_nodes == b.radix_nodes && a.live_branches == b.live_branches;
}

// The counts of every model namespace, by index into kModelNamespaces.
using NamespaceSnapshot = std::array<NamespaceStats, kNumModelNamespaces>;

inline NamespaceSnapshot namespace_snapshot(const KvCache& cache) {
  NamespaceSnapshot out;
  for (int n = 0; n < kNumModelNamespaces; ++n) out[n] = cache.namespace_stats(kModelNamespaces[n]);
  return out;
}

// Empty, or which namespace other than `ns` changed since `before`.
inline std::string others_unchanged(const KvCache& cache, const NamespaceSnapshot& before, int ns,
                                    const char* op) {
  const NamespaceSnapshot now = namespace_snapshot(cache);
  for (int n = 0; n < kNumModelNamespaces; ++n) {
    if (n != ns && !same_ns_stats(before[n], now[n])) {
      return std::string(op) + " changed namespace " + std::to_string(n);
    }
  }
  return {};
}

// Per-namespace counts against the global stats `s` and the live branches (id, namespace
// index): live branches exact; locked and evictable pages adding up to the global counts;
// every page a namespace's live branch reads counted as locked in that namespace and read by
// no other namespace.
inline std::string check_namespace_counts(const KvCache& cache, const KvCacheStats& s,
                                          std::span<const std::pair<BranchId, int>> live_branches) {
  if (cache.namespace_count() < 1 || cache.namespace_count() > kNumModelNamespaces) {
    return "namespace_count " + std::to_string(cache.namespace_count()) + " out of range";
  }
  int32_t locked = 0, evictable = 0, live = 0;
  std::vector<int32_t> page_ns(cache.pool().num_pages(), -1);
  std::vector<int32_t> table;
  for (int n = 0; n < kNumModelNamespaces; ++n) {
    const NamespaceStats ns = cache.namespace_stats(kModelNamespaces[n]);
    const std::string who = "namespace " + std::to_string(n);
    if (ns.pages_locked < 0 || ns.pages_evictable < 0) return who + ": negative counts";
    locked += ns.pages_locked;
    evictable += ns.pages_evictable;
    live += ns.live_branches;
    int32_t shadow_live = 0, read = 0;
    for (const auto& [id, branch_ns] : live_branches) {
      if (branch_ns != n) continue;
      ++shadow_live;
      if (Status st = cache.branch_page_table(id, &table); !st.ok()) return st.ToString();
      for (int32_t page : table) {
        if (page_ns[page] == n) continue;
        if (page_ns[page] >= 0) return who + " reads page " + std::to_string(page) + " too";
        page_ns[page] = n;
        ++read;
      }
    }
    if (ns.live_branches != shadow_live) return who + ": live_branches differs from the shadow";
    if (ns.pages_locked < read) {
      return who + ": " + std::to_string(ns.pages_locked) + " locked pages, its branches read " +
             std::to_string(read);
    }
  }
  if (locked != s.pages_locked || evictable != s.pages_evictable || live != s.live_branches) {
    return "namespace counts do not add up to the global stats";
  }
  return {};
}

}  // namespace treeserve::testing
