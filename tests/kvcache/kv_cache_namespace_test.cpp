// Cache namespaces: isolation (a prefix cached in one namespace is invisible in another), forks,
// commits and prunes staying in their namespace, one LRU over all namespaces, evict_namespace,
// the O(1) per-namespace accounting under every operation, the page limit, and attention
// views over several namespaces. Page size 4 throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "kernels/attention_plan.h"
#include "kvcache/kv_cache.h"
#include "tests/kvcache/kv_cache_test_util.h"

namespace treeserve {
namespace {

using testing::concat;
using testing::make_cache;
using testing::ns_stats_equal;
using testing::page_table_of;
using testing::seq;
using testing::stats_equal;
using testing::tokens_of;
using V = std::vector<int32_t>;

// The per-namespace counts of `namespaces` (every namespace in use) add up to the global
// stats, which KvCache::stats() computes by scanning the pool and the tree.
void expect_counts_add_up(const KvCache& cache, const std::vector<CacheNamespace>& namespaces) {
  NamespaceStats sum;
  for (CacheNamespace ns : namespaces) {
    const NamespaceStats s = cache.namespace_stats(ns);
    sum.pages_locked += s.pages_locked;
    sum.pages_evictable += s.pages_evictable;
    sum.live_branches += s.live_branches;
  }
  const KvCacheStats g = cache.stats();
  EXPECT_EQ(sum.pages_locked, g.pages_locked);
  EXPECT_EQ(sum.pages_evictable, g.pages_evictable);
  EXPECT_EQ(sum.live_branches, g.live_branches);
  const Status st = cache.check_invariants();
  EXPECT_TRUE(st.ok()) << st.ToString();
}

TEST(KvCacheNamespace, PrefixCachedInOneNamespaceIsInvisibleInAnother) {
  auto cache = make_cache(16);
  const V prompt = seq(10);
  StatusOr<NewBranch> a = cache->create_branch(prompt, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->cached_tokens, 0);
  ASSERT_TRUE(cache->finish(a->id).ok());  // ns 1 caches [0, 10) in 3 pages

  EXPECT_EQ(cache->match_prefix_length(prompt, 1), 9);
  EXPECT_EQ(cache->match_prefix_length(prompt, 2), 0);
  EXPECT_EQ(cache->match_prefix_length(prompt), 0);  // the default namespace
  StatusOr<NewBranch> b = cache->create_branch(prompt, 2);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 0);
  EXPECT_TRUE(b->copies.empty());
  EXPECT_EQ(b->slots.size(), 10u);  // all of it computed again

  // The same prompt in ns 1 again reuses what ns 1 cached.
  StatusOr<NewBranch> c = cache->create_branch(prompt, 1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->cached_tokens, 9);
  ASSERT_EQ(c->copies.size(), 1u);  // 9 is mid-page
  EXPECT_EQ(*cache->branch_namespace(b->id), 2u);
  EXPECT_EQ(*cache->branch_namespace(c->id), 1u);

  // No page is shared across the namespaces.
  const V pb = page_table_of(*cache, b->id), pc = page_table_of(*cache, c->id);
  for (int32_t page : pb) EXPECT_EQ(std::count(pc.begin(), pc.end(), page), 0) << page;

  // ns 1: [0, 9) locked (3 pages) and c's copy page; the split-off [9, 10) lists a page the
  // locked part holds too, so nothing is evictable. ns 2: b's 3 tail pages.
  const NamespaceStats s1 = cache->namespace_stats(1), s2 = cache->namespace_stats(2);
  EXPECT_EQ(s1.pages_locked, 4);
  EXPECT_EQ(s1.pages_evictable, 0);
  EXPECT_EQ(s1.live_branches, 1);
  EXPECT_EQ(s2.pages_locked, 3);
  EXPECT_EQ(s2.pages_evictable, 0);
  EXPECT_EQ(s2.live_branches, 1);
  expect_counts_add_up(*cache, {0, 1, 2});
}

TEST(KvCacheNamespace, CallsWithoutANamespaceUseTheDefault) {
  auto cache = make_cache(16);
  EXPECT_EQ(cache->namespace_count(), 1);
  const BranchId a = cache->create_branch(seq(8))->id;
  EXPECT_EQ(*cache->branch_namespace(a), kDefaultCacheNamespace);
  ASSERT_TRUE(cache->finish(a).ok());
  EXPECT_EQ(cache->match_prefix_length(seq(8), kDefaultCacheNamespace), 7);
  EXPECT_EQ(cache->match_prefix_length(seq(8)), 7);
  StatusOr<NewBranch> b = cache->create_branch(seq(8), kDefaultCacheNamespace);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 7);
  // Asking about a namespace creates no state for it.
  EXPECT_EQ(cache->match_prefix_length(seq(8), 42), 0);
  EXPECT_TRUE(ns_stats_equal(cache->namespace_stats(42), NamespaceStats{}));
  EXPECT_EQ(cache->namespace_count(), 1);
  ASSERT_TRUE(cache->create_branch(seq(3), 42).ok());
  EXPECT_EQ(cache->namespace_count(), 2);
  EXPECT_EQ(cache->branch_namespace(BranchId{0}).status().code(), StatusCode::kNotFound);
}

TEST(KvCacheNamespace, ForksCommitsAndPrunesStayInTheirNamespace) {
  auto cache = make_cache(32);
  const BranchId a = cache->create_branch(seq(6), 3)->id;
  ASSERT_TRUE(cache->commit(a).ok());
  const V next = concat(seq(6), {1});
  EXPECT_EQ(cache->match_prefix_length(next, 3), 6);
  EXPECT_EQ(cache->match_prefix_length(next, 0), 0);

  StatusOr<ForkResult> f = cache->fork(a, 2);
  ASSERT_TRUE(f.ok());
  for (BranchId c : f->branches) EXPECT_EQ(*cache->branch_namespace(c), 3u);
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(f->branches[0], V{7, 8}, &slots).ok());
  StatusOr<PruneResult> r = cache->prune(f->branches[0], /*retain_kv=*/true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 2);
  const V longer = concat(seq(6), {7, 8, 9});
  EXPECT_EQ(cache->match_prefix_length(longer, 3), 8);
  EXPECT_EQ(cache->match_prefix_length(longer, 0), 0);
  EXPECT_EQ(cache->match_prefix_length(longer, 4), 0);

  // A branch of the default namespace with the same tokens computes them all.
  StatusOr<NewBranch> d = cache->create_branch(longer);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->cached_tokens, 0);
  EXPECT_EQ(cache->namespace_stats(3).live_branches, 2);
  EXPECT_EQ(cache->namespace_stats(0).live_branches, 1);
  expect_counts_add_up(*cache, {0, 3});
}

// Eviction is one LRU over all namespaces: the least recently used unlocked leaf goes,
// whichever namespace holds it.
TEST(KvCacheNamespace, EvictionIsOneLruOverAllNamespaces) {
  auto cache = make_cache(7);
  const V a = seq(8, 100), b = seq(8, 200);
  ASSERT_TRUE(cache->finish(cache->create_branch(a, 1)->id).ok());  // 2 pages, older
  ASSERT_TRUE(cache->finish(cache->create_branch(b, 2)->id).ok());  // 2 pages
  // ns 1 uses its prefix again, so ns 2's is now the least recently used.
  ASSERT_TRUE(cache->finish(cache->create_branch(a, 1)->id).ok());
  ASSERT_EQ(cache->stats().pages_free, 3);
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  EXPECT_EQ(cache->namespace_stats(2).pages_evictable, 2);

  StatusOr<NewBranch> c = cache->create_branch(seq(16, 300), 3);  // 4 pages: evicts one leaf
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(cache->namespace_stats(2).pages_evictable, 0);
  EXPECT_EQ(cache->match_prefix_length(b, 2), 0);
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  EXPECT_EQ(cache->match_prefix_length(a, 1), 7);
  EXPECT_EQ(cache->namespace_stats(3).pages_locked, 4);
  expect_counts_add_up(*cache, {1, 2, 3});

  // Then ns 1's prefix is the only evictable one: the next namespace takes it.
  ASSERT_TRUE(cache->create_branch(seq(4, 400), 2).ok());  // the last free page
  ASSERT_TRUE(cache->create_branch(seq(4, 500), 2).ok());
  EXPECT_EQ(cache->match_prefix_length(a, 1), 0);
  expect_counts_add_up(*cache, {1, 2, 3});
}

TEST(KvCacheNamespace, EvictNamespaceDropsOnlyThatNamespace) {
  auto cache = make_cache(16);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8), 1)->id).ok());  // ns 1: 2 cached
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8), 2)->id).ok());  // ns 2: 2 cached
  const BranchId live = cache->create_branch(seq(5, 50), 1)->id;         // ns 1: 2 locked
  EXPECT_EQ(cache->namespace_count(), 3);

  EXPECT_EQ(cache->evict_namespace(1), 2);
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 0);
  EXPECT_EQ(cache->namespace_stats(1).pages_locked, 2);
  EXPECT_EQ(cache->match_prefix_length(seq(8), 1), 0);
  EXPECT_EQ(cache->match_prefix_length(seq(8), 2), 7);
  EXPECT_EQ(cache->namespace_stats(2).pages_evictable, 2);
  EXPECT_EQ(cache->namespace_count(), 3);  // a live branch keeps the namespace
  EXPECT_EQ(tokens_of(*cache, live), seq(5, 50));

  // Once it holds nothing, the namespace is forgotten.
  ASSERT_TRUE(cache->prune(live, /*retain_kv=*/true).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  EXPECT_EQ(cache->evict_namespace(1), 2);
  EXPECT_EQ(cache->namespace_count(), 2);
  EXPECT_TRUE(ns_stats_equal(cache->namespace_stats(1), NamespaceStats{}));
  EXPECT_EQ(cache->stats().pages_used, 2);  // ns 2's prefix
  EXPECT_EQ(cache->evict_namespace(9), 0);  // never used: nothing to do
  // A page limit keeps a namespace, and the default namespace is never forgotten.
  ASSERT_TRUE(cache->set_namespace_page_limit(2, 8).ok());
  EXPECT_EQ(cache->evict_namespace(2), 2);
  EXPECT_EQ(cache->namespace_stats(2).page_limit, 8);
  EXPECT_EQ(cache->evict_namespace(0), 0);
  EXPECT_EQ(cache->namespace_count(), 2);
  // A forgotten namespace starts afresh, in a recycled slot.
  ASSERT_TRUE(cache->create_branch(seq(8), 1).ok());
  EXPECT_EQ(cache->namespace_count(), 3);
  EXPECT_EQ(cache->namespace_stats(1).pages_locked, 2);
  expect_counts_add_up(*cache, {0, 1, 2});
}

// Locked pages are counted once however many branches of the namespace hold them, and the
// counts stay exact through create, append, fork (aligned and mid-page), commit, truncate into
// the shared path, token trees, accept, prune with and without retain_kv, and eviction. The
// default namespace holds a cached prefix throughout, so ns 5's counts must be exactly its own.
TEST(KvCacheNamespace, AccountingFollowsEveryOperation) {
  auto cache = make_cache(32);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(6, 900))->id).ok());  // ns 0: 2 cached
  const std::vector<CacheNamespace> all{0, 5};
  auto expect5 = [&](int32_t locked, int32_t evictable, int32_t live) {
    const NamespaceStats s = cache->namespace_stats(5);
    EXPECT_EQ(s.pages_locked, locked);
    EXPECT_EQ(s.pages_evictable, evictable);
    EXPECT_EQ(s.live_branches, live);
    EXPECT_EQ(cache->namespace_stats(0).pages_evictable, 2);
    expect_counts_add_up(*cache, all);
  };
  std::vector<KvSlot> slots;
  const BranchId a = cache->create_branch(seq(6), 5)->id;
  expect5(2, 0, 1);
  ASSERT_TRUE(cache->append(a, V{1, 2, 3}, &slots).ok());  // length 9: a third page
  expect5(3, 0, 1);
  // Mid-page fork: [0, 9) enters the tree; its last page is listed by the node and a's tail
  // (counted once); each child gets one fresh page.
  const ForkResult f = cache->fork(a, 2).value();
  expect5(5, 0, 3);
  // Aligned fork inside the shared path: shares every page.
  const BranchId g = cache->fork(a, 1, 8)->branches[0];
  expect5(5, 0, 4);
  // Rewind into the shared path: the child's copy page is released, a new one taken.
  ASSERT_TRUE(cache->truncate(f.branches[0], 5).ok());
  expect5(5, 0, 4);
  ASSERT_TRUE(cache->append(f.branches[1], V{7}, &slots).ok());  // fills its copy page
  ASSERT_TRUE(cache->commit(f.branches[1]).ok());
  expect5(5, 0, 4);
  // A token tree past a's page: one more page, released again by an empty accept.
  ASSERT_TRUE(cache->append_token_tree(a, V{1, 2, 3, 4}, V{-1, 0, 1, 2}, &slots).ok());
  expect5(6, 0, 4);
  std::vector<SlotMove> moves;
  ASSERT_TRUE(cache->accept(a, V{}, &moves).ok());
  expect5(5, 0, 4);
  // retain_kv: the child's page stays, now only as cache.
  ASSERT_TRUE(cache->prune(f.branches[1], /*retain_kv=*/true).ok());
  expect5(4, 1, 3);
  ASSERT_TRUE(cache->prune(a, /*retain_kv=*/false).ok());
  expect5(3, 2, 2);
  ASSERT_TRUE(cache->prune(g, /*retain_kv=*/false).ok());
  ASSERT_TRUE(cache->prune(f.branches[0], /*retain_kv=*/false).ok());
  expect5(0, 4, 0);
  EXPECT_EQ(cache->evict_namespace(5), 4);
  EXPECT_TRUE(ns_stats_equal(cache->namespace_stats(5), NamespaceStats{}));
  EXPECT_EQ(cache->stats().pages_used, 2);
  expect_counts_add_up(*cache, all);
}

// Regression for the locked count: a commit that reuses another writer's node leaves the
// tail's partly filled page listed by an earlier node of the path, not by the new base.
TEST(KvCacheNamespace, LockedPagesWhenACommitReusesAnotherWritersNode) {
  auto cache = make_cache(16);
  std::vector<KvSlot> slots;
  const BranchId x = cache->create_branch(seq(5), 6)->id;
  ASSERT_TRUE(cache->commit(x).ok());  // node [0, 5): pages P0, P1; x's tail keeps P1
  const BranchId y = cache->fork(x, 1)->branches[0];  // y copies P1 into Q
  ASSERT_TRUE(cache->append(y, V{1, 2}, &slots).ok());
  ASSERT_TRUE(cache->commit(y).ok());  // node [5, 7): Q
  ASSERT_TRUE(cache->append(x, V{1, 2}, &slots).ok());
  ASSERT_TRUE(cache->commit(x).ok());  // reuses [5, 7); x's tail still writes P1
  ASSERT_TRUE(cache->prune(y, /*retain_kv=*/false).ok());
  // Locked: P0, P1 (node [0, 5) and x's tail), Q (node [5, 7)).
  EXPECT_EQ(cache->namespace_stats(6).pages_locked, 3);
  EXPECT_EQ(cache->stats().pages_locked, 3);
  std::vector<KvSlot> more;
  ASSERT_TRUE(cache->append(x, V{3, 4}, &more).ok());  // a new page at position 8
  EXPECT_EQ(cache->namespace_stats(6).pages_locked, 4);
  expect_counts_add_up(*cache, {0, 6});
  ASSERT_TRUE(cache->prune(x, /*retain_kv=*/true).ok());
  EXPECT_EQ(cache->namespace_stats(6).pages_locked, 0);
  expect_counts_add_up(*cache, {0, 6});
}

TEST(KvCacheNamespace, PageLimitEvictsTheNamespacesOwnCacheFirst) {
  auto cache = make_cache(32);
  ASSERT_TRUE(cache->set_namespace_page_limit(1, 4).ok());
  EXPECT_EQ(cache->namespace_stats(1).page_limit, 4);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8), 1)->id).ok());  // ns 1: 2 cached
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8), 2)->id).ok());  // ns 2: 2 cached
  // 3 new pages fit under the limit only once ns 1's own cache goes; the pool has 28 free
  // pages, and ns 2's cache is not touched.
  const BranchId b = cache->create_branch(seq(12, 900), 1)->id;
  NamespaceStats s1 = cache->namespace_stats(1);
  EXPECT_EQ(s1.pages_locked, 3);
  EXPECT_EQ(s1.pages_evictable, 0);
  EXPECT_EQ(cache->namespace_stats(2).pages_evictable, 2);
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(b, V{1, 2, 3, 4}, &slots).ok());  // the 4th page
  EXPECT_EQ(cache->namespace_stats(1).pages_locked, 4);

  // A 5th locked page is refused, naming the namespace, its usage and the limit.
  const KvCacheStats before = cache->stats();
  const NamespaceStats ns_before = cache->namespace_stats(1);
  Status st = cache->append(b, V{5}, &slots);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("append"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("cache namespace 1"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("limit 4"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("4 pages locked"), std::string::npos) << st.message();
  EXPECT_TRUE(stats_equal(before, cache->stats()));
  EXPECT_TRUE(ns_stats_equal(ns_before, cache->namespace_stats(1)));
  EXPECT_EQ(cache->fork(b, 1, 13).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->create_branch(seq(1, 7), 1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->namespace_count(), 3);
  // Other namespaces are not limited by it.
  ASSERT_TRUE(cache->create_branch(seq(40, 700), 2).ok());

  // Cached pages count against the limit too: after the branch ends, its 4 pages are cache,
  // and a new 1-page branch makes room by evicting ns 1's own (least recently used) leaf.
  ASSERT_TRUE(cache->finish(b).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 4);
  ASSERT_TRUE(cache->create_branch(seq(3, 500), 1).ok());
  s1 = cache->namespace_stats(1);
  EXPECT_EQ(s1.pages_locked, 1);
  EXPECT_EQ(s1.pages_evictable, 0);
  // A refusal evicts nothing: 1 locked + 5 new pages > 4, with 0 cached to take.
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 600), 1)->id).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  EXPECT_EQ(cache->create_branch(seq(20, 800), 1).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  expect_counts_add_up(*cache, {0, 1, 2});

  // reserve_pages is the same check, on its own.
  EXPECT_TRUE(cache->reserve_pages(1, 3).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 0);  // made room under the limit
  EXPECT_EQ(cache->reserve_pages(1, 4).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(cache->reserve_pages(2, 4).ok());
  EXPECT_EQ(cache->reserve_pages(1, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->reserve_pages(1, 1000).code(), StatusCode::kResourceExhausted);

  // Lowering the limit evicts the namespace's cache down to it; 0 removes the limit.
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 610), 1)->id).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  ASSERT_TRUE(cache->set_namespace_page_limit(1, 2).ok());
  s1 = cache->namespace_stats(1);
  EXPECT_EQ(s1.pages_locked, 1);
  EXPECT_EQ(s1.pages_evictable, 0);
  ASSERT_TRUE(cache->set_namespace_page_limit(1, 0).ok());
  EXPECT_TRUE(cache->create_branch(seq(20, 800), 1).ok());
  Status bad = cache->set_namespace_page_limit(1, -1);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("pages"), std::string::npos);
  EXPECT_EQ(cache->namespace_stats(1).page_limit, 0);
  expect_counts_add_up(*cache, {0, 1, 2});
}

// All or nothing, as for the pool: when the pool cannot supply the pages, the namespace's own
// cache is not evicted to make room under its limit either.
TEST(KvCacheNamespace, PageLimitRefusalEvictsNothingWhenThePoolIsShort) {
  auto cache = make_cache(6);
  ASSERT_TRUE(cache->set_namespace_page_limit(1, 4).ok());
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8), 1)->id).ok());  // ns 1: 2 cached
  ASSERT_TRUE(cache->create_branch(seq(16, 300), 2).ok());               // ns 2: 4 locked
  ASSERT_EQ(cache->stats().pages_free, 0);
  const KvCacheStats before = cache->stats();
  Status st = cache->create_branch(seq(12, 900), 1).status();  // 3 pages: only 2 evictable
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(stats_equal(before, cache->stats()));
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 2);
  EXPECT_EQ(cache->match_prefix_length(seq(8), 1), 7);
  // 2 pages fit under the limit; the pool takes them from ns 1's cache, the only evictable.
  ASSERT_TRUE(cache->create_branch(seq(8, 900), 1).ok());
  EXPECT_EQ(cache->namespace_stats(1).pages_locked, 2);
  EXPECT_EQ(cache->namespace_stats(1).pages_evictable, 0);
  expect_counts_add_up(*cache, {1, 2});
}

// One step's queries from several namespaces: each namespace's shared prefix is its own root
// run (same tokens, different pages), listed once for that namespace's branches.
TEST(KvCacheNamespace, AttentionViewOverSeveralNamespaces) {
  auto cache = make_cache(48);
  std::vector<ViewQuery> queries;
  std::vector<CacheNamespace> query_ns;
  std::vector<KvSlot> slots;
  for (CacheNamespace ns : {0u, 1u, 2u}) {
    const BranchId p = cache->create_branch(seq(6), ns)->id;
    ASSERT_TRUE(cache->commit(p).ok());
    const ForkResult f = cache->fork(p, 2).value();
    for (BranchId c : f.branches) {
      ASSERT_TRUE(cache->append(c, V{static_cast<int32_t>(ns), 9}, &slots).ok());
      queries.push_back({c, 1});
      query_ns.push_back(ns);
    }
  }
  const BranchId lone = cache->create_branch(seq(5, 70), 3)->id;  // a tail at its root
  queries.push_back({lone, 2});
  query_ns.push_back(3);

  AttentionView view;
  ASSERT_TRUE(cache->build_attention_view(queries, &view).ok());
  const Status valid = validate_attention_view(view, cache->pool().num_pages());
  ASSERT_TRUE(valid.ok()) << valid.ToString();
  // 3 prefix runs + 6 tails + the lone tail; 4 top-level runs.
  EXPECT_EQ(view.nodes.size(), 10u);
  EXPECT_EQ(std::count_if(view.nodes.begin(), view.nodes.end(),
                          [](const KvNodeRun& n) { return n.parent < 0; }),
            4);
  ASSERT_EQ(view.queries.size(), 8u);
  std::set<int32_t> prefix_runs;
  std::vector<std::set<int32_t>> pages_by_ns(4);
  for (const AttentionQuery& q : view.queries) {
    const int32_t row = q.row;
    const int32_t qi = row < 6 ? row : 6;  // rows in query order: one per child, then 2 lone
    int32_t top = q.leaf;
    for (int32_t n = q.leaf; n >= 0; n = view.nodes[n].parent) {
      const KvNodeRun& run = view.nodes[n];
      for (int32_t i = 0; i < run.page_count; ++i) {
        pages_by_ns[query_ns[qi]].insert(view.pages[run.page_begin + i]);
      }
      if (n != q.leaf) prefix_runs.insert(n);
      top = n;
    }
    // The row's first KV page is its own branch's (its namespace's prefix, not another's).
    const KvNodeRun& first = view.nodes[top];
    EXPECT_EQ(first.depth_tokens, 0);
    EXPECT_EQ(view.pages[first.page_begin], page_table_of(*cache, queries[qi].branch)[0])
        << "row " << row;
  }
  EXPECT_EQ(prefix_runs.size(), 3u);  // one shared prefix run per namespace, not one in all
  for (int32_t x = 0; x < 4; ++x) {
    for (int32_t y = x + 1; y < 4; ++y) {
      for (int32_t page : pages_by_ns[x]) EXPECT_EQ(pages_by_ns[y].count(page), 0u) << page;
    }
  }
}

}  // namespace
}  // namespace treeserve
