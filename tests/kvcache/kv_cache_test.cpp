// KvCache branch lifecycle: create, append, fork (page boundary vs mid-page), truncate,
// prune / finish, prefix reuse, eviction order, exhaustion and error codes. Page size 4
// throughout so the page arithmetic in the expectations stays readable.
#include "kvcache/kv_cache.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/kvcache/kv_cache_test_util.h"

namespace treeserve {
namespace {

using testing::concat;
using testing::make_cache;
using testing::page_table_of;
using testing::seq;
using testing::stats_equal;
using testing::tokens_of;
using V = std::vector<int32_t>;

TEST(KvCacheConfig, CreateValidatesTheConfig) {
  EXPECT_EQ(KvCache::create({.page_size = 0, .num_pages = 4}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCache::create({.page_size = 257, .num_pages = 4}).status().code(),
            StatusCode::kInvalidArgument);
  Status st = KvCache::create({.page_size = 16, .num_pages = 0}).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("num_pages"), std::string::npos);
  EXPECT_TRUE(KvCache::create({.page_size = 256, .num_pages = 1}).ok());
  EXPECT_TRUE(KvCache::create({.page_size = 1, .num_pages = 1}).ok());
}

TEST(KvCacheConfig, FromBudget) {
  KvLayout model{.num_layers = 4, .num_kv_heads = 2, .head_dim = 64, .page_size = 8};
  model.dtype_bytes = 2;
  // 4 * 2 * 2 * 64 * 2 = 2048 bytes per token, 16 KiB per page.
  StatusOr<KvCacheConfig> config = KvCacheConfig::from_budget(model, 16384 * 100 + 5);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->page_size, 8);
  EXPECT_EQ(config->num_pages, 100);
  EXPECT_TRUE(KvCache::create(*config).ok());
  EXPECT_EQ(KvCacheConfig::from_budget(model, 100).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvCacheConfig::from_budget(model, -1).status().code(), StatusCode::kInvalidArgument);
  model.head_dim = 0;
  EXPECT_EQ(KvCacheConfig::from_budget(model, 1 << 30).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(KvCache, CreateBranchOnAnEmptyCache) {
  auto cache = make_cache(8);
  StatusOr<NewBranch> b = cache->create_branch(seq(6));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 0);
  EXPECT_TRUE(b->copies.empty());
  ASSERT_EQ(b->slots.size(), 6u);
  for (int32_t p = 0; p < 6; ++p) EXPECT_EQ(b->slots[p], (KvSlot{p / 4, p % 4})) << p;
  EXPECT_EQ(tokens_of(*cache, b->id), seq(6));
  EXPECT_EQ(*cache->branch_length(b->id), 6);
  EXPECT_EQ(page_table_of(*cache, b->id), (std::vector<int32_t>{0, 1}));
  const KvCacheStats s = cache->stats();
  EXPECT_EQ(s.pages_used, 2);
  EXPECT_EQ(s.pages_locked, 2);
  EXPECT_EQ(s.pages_evictable, 0);
  EXPECT_EQ(s.live_branches, 1);
  EXPECT_EQ(s.radix_nodes, 0);  // tails enter the tree only when shared or cached
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, AppendAllocatesAtPageBoundaries) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(3))->id;
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(b, V{7}, &slots).ok());
  EXPECT_EQ(slots, (std::vector<KvSlot>{{0, 3}}));
  EXPECT_EQ(cache->stats().pages_used, 1);
  ASSERT_TRUE(cache->append(b, V{8, 9}, &slots).ok());  // slots are appended to
  EXPECT_EQ(slots, (std::vector<KvSlot>{{0, 3}, {1, 0}, {1, 1}}));
  EXPECT_EQ(cache->stats().pages_used, 2);
  EXPECT_EQ(tokens_of(*cache, b), concat(seq(3), {7, 8, 9}));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, ForkAtAPageBoundarySharesEveryPage) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(8))->id;
  StatusOr<ForkResult> f = cache->fork(a, 3);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->branches.size(), 3u);
  EXPECT_TRUE(f->copies.empty());  // nothing page-aligned is ever copied
  EXPECT_EQ(cache->stats().pages_used, 2);
  for (BranchId c : f->branches) {
    EXPECT_EQ(tokens_of(*cache, c), seq(8));
    EXPECT_EQ(page_table_of(*cache, c), (std::vector<int32_t>{0, 1}));
  }
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(f->branches[0], V{1}, &slots).ok());
  EXPECT_EQ(slots, (std::vector<KvSlot>{{2, 0}}));  // a fresh page for the new tail
  EXPECT_EQ(cache->stats().live_branches, 4);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, ForkMidPageCopiesOnlyThePartialPage) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(6))->id;  // pages 0, 1; page 1 holds 2 slots
  StatusOr<ForkResult> f = cache->fork(a, 2);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->copies.size(), 2u);
  EXPECT_EQ(f->copies[0], (PageCopy{1, 2, 2}));
  EXPECT_EQ(f->copies[1], (PageCopy{1, 3, 2}));
  EXPECT_EQ(cache->stats().pages_used, 4);
  EXPECT_EQ(page_table_of(*cache, a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(page_table_of(*cache, f->branches[0]), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(page_table_of(*cache, f->branches[1]), (std::vector<int32_t>{0, 3}));
  // Each writes its own copy of the partial page, the parent its original.
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(f->branches[0], V{50}, &slots).ok());
  ASSERT_TRUE(cache->append(a, V{60}, &slots).ok());
  EXPECT_EQ(slots, (std::vector<KvSlot>{{2, 2}, {1, 2}}));
  EXPECT_EQ(tokens_of(*cache, f->branches[0]), concat(seq(6), {50}));
  EXPECT_EQ(tokens_of(*cache, f->branches[1]), seq(6));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, ForkAtAnEarlierLength) {
  auto cache = make_cache(16);
  const BranchId a = cache->create_branch(seq(10))->id;
  // Inside the tail, mid-page: the first 5 tokens become a shared node.
  StatusOr<ForkResult> f = cache->fork(a, 1, 5);
  ASSERT_TRUE(f.ok());
  ASSERT_EQ(f->copies.size(), 1u);
  EXPECT_EQ(f->copies[0].src_page, 1);
  EXPECT_EQ(f->copies[0].num_slots, 1);
  EXPECT_EQ(tokens_of(*cache, f->branches[0]), seq(5));
  EXPECT_EQ(tokens_of(*cache, a), seq(10));
  // Inside the now shared path, at a page boundary: no copy.
  StatusOr<ForkResult> g = cache->fork(a, 1, 4);
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->copies.empty());
  EXPECT_EQ(tokens_of(*cache, g->branches[0]), seq(4));
  EXPECT_EQ(page_table_of(*cache, g->branches[0]), (std::vector<int32_t>{0}));
  // Inside the shared path, mid-page: splits the node, copies the partial page.
  StatusOr<ForkResult> h = cache->fork(a, 1, 3);
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->copies.size(), 1u);
  EXPECT_EQ(h->copies[0].src_page, 0);
  EXPECT_EQ(h->copies[0].num_slots, 3);
  EXPECT_EQ(tokens_of(*cache, h->branches[0]), seq(3));
  EXPECT_EQ(tokens_of(*cache, a), seq(10));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, TruncateWithinTheTailFreesPages) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(10))->id;
  StatusOr<TruncateResult> t = cache->truncate(a, 5);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_pages, 1);
  EXPECT_TRUE(t->copies.empty());
  EXPECT_EQ(tokens_of(*cache, a), seq(5));
  EXPECT_EQ(cache->stats().pages_used, 2);
  t = cache->truncate(a, 5);  // no-op
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_pages, 0);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, TruncateIntoTheSharedPathCopiesThePartialPage) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(8))->id;
  const BranchId c = cache->fork(a, 1)->branches[0];  // both based on node [0, 8)
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(c, V{1, 2}, &slots).ok());  // c's tail: page 2
  StatusOr<TruncateResult> t = cache->truncate(c, 6);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_pages, 1);
  ASSERT_EQ(t->copies.size(), 1u);
  EXPECT_EQ(t->copies[0].src_page, 1);
  EXPECT_EQ(t->copies[0].num_slots, 2);
  EXPECT_EQ(tokens_of(*cache, c), seq(6));
  EXPECT_EQ(tokens_of(*cache, a), seq(8));
  EXPECT_EQ(page_table_of(*cache, a), (std::vector<int32_t>{0, 1}));
  EXPECT_KV_HEALTHY(*cache);
}

// Regression: shortening a branch on a full pool. A rewind into the shared path releases the
// tail before it reserves its fresh page, so it needs no free page.
TEST(KvCache, TruncateOnAFullPoolReusesItsOwnTailPage) {
  auto cache = make_cache(3);
  const BranchId a = cache->create_branch(seq(8))->id;
  const BranchId c = cache->fork(a, 1)->branches[0];
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(c, V{1}, &slots).ok());
  ASSERT_EQ(cache->stats().pages_free, 0);
  StatusOr<TruncateResult> t = cache->truncate(c, 6);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->copies, (std::vector<PageCopy>{{1, 2, 2}}));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, PruneOfABranchWhoseParentIsShared) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(6))->id;
  StatusOr<ForkResult> f = cache->fork(a, 2);  // node [0, 6) shared; copies in pages 2, 3
  ASSERT_TRUE(f.ok());
  const BranchId b = f->branches[0], c = f->branches[1];
  StatusOr<PruneResult> r = cache->prune(b, /*retain_kv=*/false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freed_pages, 1);  // only its private copy
  EXPECT_EQ(r->released_tokens, 0);
  EXPECT_EQ(tokens_of(*cache, a), seq(6));
  EXPECT_EQ(tokens_of(*cache, c), seq(6));
  // The parent's pages stay: c still reads through the shared node.
  r = cache->prune(a, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freed_pages, 0);
  EXPECT_EQ(page_table_of(*cache, c), (std::vector<int32_t>{0, 3}));
  KvCacheStats s = cache->stats();
  EXPECT_EQ(s.pages_locked, 3);
  EXPECT_EQ(s.pages_evictable, 0);
  // The last one out leaves the shared prefix cached and evictable.
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(c, V{9, 9, 9}, &slots).ok());
  r = cache->prune(c, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->released_tokens, 3);
  EXPECT_EQ(r->freed_pages, 2);
  s = cache->stats();
  EXPECT_EQ(s.pages_locked, 0);
  EXPECT_EQ(s.pages_evictable, 2);
  EXPECT_EQ(s.live_branches, 0);
  EXPECT_EQ(cache->evict_all(), 2);
  EXPECT_EQ(cache->stats().pages_free, 8);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, RetainedPrefixIsReusedByALaterBranch) {
  auto cache = make_cache(16);
  const BranchId a = cache->create_branch(seq(10))->id;
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(a, V{1, 2}, &slots).ok());
  StatusOr<PruneResult> r = cache->finish(a);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 12);
  EXPECT_EQ(r->freed_pages, 0);
  KvCacheStats s = cache->stats();
  EXPECT_EQ(s.pages_evictable, 3);
  EXPECT_EQ(s.pages_locked, 0);
  EXPECT_EQ(s.radix_cached_tokens, 12);
  const std::vector<int32_t> prompt = concat(seq(10), {1, 2});
  EXPECT_EQ(cache->match_prefix_length(concat(prompt, {5})), 12);
  // create_branch reuses at most size - 1 tokens; match_prefix_length predicts it.
  EXPECT_EQ(cache->match_prefix_length(prompt), 11);

  StatusOr<NewBranch> b = cache->create_branch(concat(prompt, {7, 8}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 12);
  EXPECT_TRUE(b->copies.empty());  // 12 is page-aligned
  EXPECT_EQ(b->slots, (std::vector<KvSlot>{{3, 0}, {3, 1}}));
  EXPECT_EQ(page_table_of(*cache, b->id), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(cache->stats().pages_evictable, 0);  // now locked by b

  // Matching ends mid-page: the node splits and the partial page is copied.
  StatusOr<NewBranch> c = cache->create_branch(concat(seq(10), {99}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->cached_tokens, 10);
  EXPECT_EQ(c->copies, (std::vector<PageCopy>{{2, 4, 2}}));
  EXPECT_EQ(c->slots, (std::vector<KvSlot>{{4, 2}}));
  EXPECT_EQ(tokens_of(*cache, c->id), concat(seq(10), {99}));
  EXPECT_EQ(tokens_of(*cache, b->id), concat(prompt, {7, 8}));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, RetainKeepsOnlyOneCopyOfKvTheTreeAlreadyHolds) {
  auto cache = make_cache(16);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8))->id).ok());
  // A second branch computes the same 8 tokens itself (a one-token prompt reuses nothing).
  const BranchId b = cache->create_branch(V{100})->id;
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(b, seq(7, 101), &slots).ok());
  EXPECT_EQ(cache->stats().pages_used, 4);
  StatusOr<PruneResult> r = cache->finish(b);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->freed_pages, 2);  // its duplicate pages
  EXPECT_EQ(cache->stats().pages_used, 2);
  EXPECT_EQ(cache->stats().radix_cached_tokens, 8);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, EvictionIsLruAndNeverTouchesLiveBranches) {
  auto cache = make_cache(7);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 100))->id).ok());  // A: 2 pages
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 200))->id).ok());  // B: 2 pages
  // Use A again: B becomes the least recently used prefix.
  const BranchId a = cache->create_branch(concat(seq(8, 100), {1}))->id;
  ASSERT_TRUE(cache->prune(a, false).ok());
  ASSERT_EQ(cache->stats().pages_free, 3);
  const BranchId c = cache->create_branch(seq(16, 300))->id;           // needs 4 pages
  EXPECT_EQ(cache->match_prefix_length(concat(seq(8, 200), {0})), 0);  // B evicted
  EXPECT_EQ(cache->match_prefix_length(concat(seq(8, 100), {0})), 8);  // A kept
  // A is locked by a live branch now: it is never evicted, the request fails instead.
  const BranchId d = cache->create_branch(concat(seq(8, 100), {1}))->id;
  const KvCacheStats before = cache->stats();
  StatusOr<NewBranch> e = cache->create_branch(seq(4, 400));
  EXPECT_EQ(e.status().code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(stats_equal(before, cache->stats()));
  EXPECT_EQ(tokens_of(*cache, d), concat(seq(8, 100), {1}));
  EXPECT_EQ(tokens_of(*cache, c), seq(16, 300));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, EvictFreesThatManyMorePagesAllOrNothing) {
  auto cache = make_cache(8);
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 100))->id).ok());
  ASSERT_TRUE(cache->finish(cache->create_branch(seq(8, 200))->id).ok());
  ASSERT_EQ(cache->stats().pages_free, 4);
  EXPECT_FALSE(cache->evict(5));
  EXPECT_EQ(cache->stats().pages_free, 4);
  EXPECT_TRUE(cache->evict(1));  // one whole prefix (2 pages) goes
  EXPECT_EQ(cache->stats().pages_free, 6);
  EXPECT_TRUE(cache->evict(0));
  EXPECT_EQ(cache->evict_all(), 2);
  EXPECT_EQ(cache->stats().pages_free, 8);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, EvictionUnderPressureFreesABatch) {
  // 128 pages: a pass evicts up to 128 / 64 = 2 pages, so the next allocation finds one free.
  auto cache = make_cache(128);
  for (int32_t i = 0; i < 128; ++i)
    ASSERT_TRUE(cache->finish(cache->create_branch(seq(4, 10 * i))->id).ok());
  ASSERT_EQ(cache->stats().pages_free, 0);
  ASSERT_TRUE(cache->create_branch(seq(4, 5000)).ok());
  EXPECT_EQ(cache->stats().pages_free, 1);
  EXPECT_EQ(cache->match_prefix_length(concat(seq(4, 0), {0})), 0);   // least recently used
  EXPECT_EQ(cache->match_prefix_length(concat(seq(4, 10), {0})), 0);  // next
  EXPECT_EQ(cache->match_prefix_length(concat(seq(4, 20), {0})), 4);
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, ExhaustionChangesNothing) {
  auto cache = make_cache(4);
  const BranchId a = cache->create_branch(seq(8, 100))->id;
  const BranchId b = cache->create_branch(seq(8, 200))->id;
  const BranchId c = cache->fork(a, 1)->branches[0];  // page-aligned: free
  const KvCacheStats before = cache->stats();
  ASSERT_EQ(before.pages_free, 0);
  std::vector<KvSlot> slots;
  auto expect_exhausted = [&](const Status& st) {
    EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
    EXPECT_TRUE(stats_equal(before, cache->stats()));
    EXPECT_KV_HEALTHY(*cache);
  };
  expect_exhausted(cache->create_branch(seq(3, 500)).status());
  expect_exhausted(cache->create_branch(concat(seq(8, 100), {1, 2})).status());  // reuse + 1
  expect_exhausted(cache->append(b, V{1}, &slots));
  expect_exhausted(cache->fork(b, 2, 6).status());
  expect_exhausted(cache->truncate(c, 6).status());  // no tail page of its own to reuse
  const std::vector<int32_t> drafts{1}, parents{-1};
  expect_exhausted(cache->append_token_tree(b, drafts, parents, &slots));
  EXPECT_TRUE(slots.empty());
  EXPECT_EQ(tokens_of(*cache, b), seq(8, 200));
  EXPECT_EQ(tokens_of(*cache, c), seq(8, 100));
  // Exhaustion first evicts cached prefixes: once b is cached and unlocked, a new branch fits.
  ASSERT_TRUE(cache->finish(b).ok());
  StatusOr<NewBranch> d = cache->create_branch(seq(3, 500));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(cache->match_prefix_length(concat(seq(8, 200), {0})), 0);  // b's prefix evicted
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, ErrorCodes) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(5))->id;
  const BranchId dead = cache->create_branch(seq(5, 50))->id;
  ASSERT_TRUE(cache->prune(dead, false).ok());
  std::vector<KvSlot> slots;
  std::vector<SlotMove> moves;
  std::vector<int32_t> out;
  const std::vector<int32_t> one{1}, root{-1};
  AttentionView view;
  const KvCacheStats before = cache->stats();

  for (BranchId unknown : {BranchId{0}, BranchId{-1}, BranchId{12345}, a + (BranchId{7} << 32)}) {
    EXPECT_EQ(cache->append(unknown, one, &slots).code(), StatusCode::kNotFound) << unknown;
    EXPECT_EQ(cache->fork(unknown, 1).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->truncate(unknown, 1).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->prune(unknown, true).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->branch_length(unknown).status().code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->branch_tokens(unknown, &out).code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->branch_page_table(unknown, &out).code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->append_token_tree(unknown, one, root, &slots).code(), StatusCode::kNotFound);
    EXPECT_EQ(cache->accept(unknown, {}, &moves).code(), StatusCode::kNotFound);
    const ViewQuery q{unknown, 1};
    EXPECT_EQ(cache->build_attention_view({&q, 1}, &view).code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(cache->append(dead, one, &slots).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->fork(dead, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->truncate(dead, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->prune(dead, false).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->finish(dead).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->branch_length(dead).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->branch_tokens(dead, &out).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->branch_page_table(dead, &out).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->append_token_tree(dead, one, root, &slots).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->accept(dead, {}, &moves).code(), StatusCode::kFailedPrecondition);

  auto invalid = [](const Status& st, const char* field) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find(field), std::string::npos) << st.ToString();
  };
  invalid(cache->create_branch({}).status(), "tokens");
  invalid(cache->append(a, {}, &slots), "tokens");
  invalid(cache->fork(a, 0).status(), "n");
  invalid(cache->fork(a, 1, 6).status(), "at_length");
  invalid(cache->fork(a, 1, -1).status(), "at_length");
  invalid(cache->truncate(a, 0).status(), "new_length");
  invalid(cache->truncate(a, 6).status(), "new_length");
  invalid(cache->append_token_tree(a, {}, {}, &slots), "tokens");
  invalid(cache->append_token_tree(a, one, {}, &slots), "parents");
  const std::vector<int32_t> self_parent{0};
  invalid(cache->append_token_tree(a, one, self_parent, &slots), "parents[0]");
  EXPECT_TRUE(slots.empty());
  EXPECT_TRUE(moves.empty());
  EXPECT_TRUE(stats_equal(before, cache->stats()));
  EXPECT_KV_HEALTHY(*cache);
}

TEST(KvCache, SlotsOfPrunedBranchesAreReusedWithNewIds) {
  auto cache = make_cache(8);
  const BranchId a = cache->create_branch(seq(2))->id;
  ASSERT_TRUE(cache->prune(a, false).ok());
  const BranchId b = cache->create_branch(seq(2))->id;
  EXPECT_NE(a, b);
  EXPECT_EQ(cache->branch_length(a).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*cache->branch_length(b), 2);
}

TEST(KvCache, IdleCacheAfterPruningEverythingHoldsNoLockedPage) {
  auto cache = make_cache(32);
  const BranchId a = cache->create_branch(seq(9))->id;
  StatusOr<ForkResult> f = cache->fork(a, 4, 7);
  ASSERT_TRUE(f.ok());
  std::vector<KvSlot> slots;
  for (BranchId c : f->branches)
    ASSERT_TRUE(cache->append(c, V{static_cast<int32_t>(c)}, &slots).ok());
  bool retain = false;
  for (BranchId c : f->branches) {
    ASSERT_TRUE(cache->prune(c, retain).ok());
    retain = !retain;
  }
  ASSERT_TRUE(cache->finish(a).ok());
  KvCacheStats s = cache->stats();
  EXPECT_EQ(s.pages_locked, 0);
  EXPECT_EQ(s.pages_evictable, s.pages_used);
  cache->evict_all();
  s = cache->stats();
  EXPECT_EQ(s.pages_free, s.pages_total);
  EXPECT_EQ(s.radix_nodes, 0);
  EXPECT_KV_HEALTHY(*cache);
}

}  // namespace
}  // namespace treeserve

namespace treeserve {
namespace {

// commit: a live branch's tail becomes matchable; the branch keeps growing in its own
// partly filled page, and the sharer copies that page instead of writing into it.
TEST(KvCache, CommitSharesALiveBranchsTail) {
  auto cache = testing::make_cache(16);
  std::vector<int32_t> prompt = testing::seq(10);  // page size 4: ends mid-page
  StatusOr<NewBranch> a = cache->create_branch(prompt);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(cache->match_prefix_length(testing::concat(prompt, {99})), 0);
  ASSERT_TRUE(cache->commit(a->id).ok());
  ASSERT_TRUE(cache->check_invariants().ok());
  EXPECT_EQ(cache->match_prefix_length(testing::concat(prompt, {99})), 10);
  StatusOr<NewBranch> b = cache->create_branch(testing::concat(prompt, {99}));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->cached_tokens, 10);
  ASSERT_EQ(b->copies.size(), 1u);  // the shared partial page is copied, not written
  EXPECT_EQ(b->copies[0].num_slots, 2);
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(a->id, std::vector<int32_t>{7, 8}, &slots).ok());
  EXPECT_EQ(testing::tokens_of(*cache, a->id), testing::concat(prompt, {7, 8}));
  EXPECT_EQ(testing::tokens_of(*cache, b->id), testing::concat(prompt, {99}));
  ASSERT_TRUE(cache->check_invariants().ok());
  EXPECT_TRUE(cache->commit(a->id).ok());  // again: idempotent for committed tokens
  ASSERT_TRUE(cache->prune(a->id, false).ok());
  ASSERT_TRUE(cache->prune(b->id, false).ok());
  EXPECT_EQ(cache->commit(a->id).code(), StatusCode::kFailedPrecondition);
  cache->evict_all();
  EXPECT_EQ(cache->stats().pages_free, cache->stats().pages_total);
}

TEST(KvCache, SharedPagesCountTheRadixPathAndPagesListedTwice) {
  auto cache = make_cache(16);
  const BranchId a = cache->create_branch(seq(6))->id;  // a private tail: pages 0, 1
  EXPECT_EQ(*cache->branch_shared_pages(a), 0);
  StatusOr<ForkResult> f = cache->fork(a, 1);  // node [0, 6); the child copies page 1
  ASSERT_TRUE(f.ok());
  const BranchId b = f->branches[0];
  // a: page 0 is the node's, page 1 is listed by the node and a's tail.
  EXPECT_EQ(*cache->branch_shared_pages(a), 2);
  // b: page 0 is the node's, page 1 is its own copy.
  EXPECT_EQ(*cache->branch_shared_pages(b), 1);
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(b, seq(8, 200), &slots).ok());  // pages 2, 3 its own
  EXPECT_EQ(page_table_of(*cache, b).size(), 4u);
  EXPECT_EQ(*cache->branch_shared_pages(b), 1);
  ASSERT_TRUE(cache->prune(b, false).ok());
  EXPECT_EQ(cache->branch_shared_pages(b).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->branch_shared_pages(12345).status().code(), StatusCode::kNotFound);
  EXPECT_KV_HEALTHY(*cache);
}

}  // namespace
}  // namespace treeserve
