// RadixTree on its own: match, insert (reuse and divergence), split mid-page and at a page
// boundary, node_at / node_on_path, lock counting, LRU eviction (leaves first, locked never,
// all or nothing) and the page references all of it holds.
#include "kvcache/radix_tree.h"

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <vector>

namespace treeserve {
namespace {

class RadixTreeTest : public ::testing::Test {
 protected:
  static constexpr int32_t kPageSize = 4;
  PagePool pool_{32, kPageSize};
  std::unique_ptr<RadixTree> tree_ = std::make_unique<RadixTree>(&pool_);

  // Inserts `tokens` under `parent` the way a branch commit does: fresh pages (of the tree's
  // owner) for the page indices the run touches, the caller's references dropped afterwards.
  RadixNode* insert(RadixNode* parent, std::vector<int32_t> tokens) {
    const int32_t start = parent->end();
    const int32_t end = start + static_cast<int32_t>(tokens.size());
    const int32_t count = (end + kPageSize - 1) / kPageSize - start / kPageSize;
    std::vector<int32_t> pages;
    EXPECT_TRUE(pool_.allocate(count, &pages, parent->owner).ok());
    RadixNode* node = tree_->insert(parent, tokens, pages);
    for (int32_t p : pages) pool_.release(p);
    EXPECT_TRUE(tree_->check_invariants().ok());
    EXPECT_TRUE(pool_.check_invariants().ok());
    return node;
  }
  static std::vector<int32_t> iota(int32_t n, int32_t first) {
    std::vector<int32_t> v(n);
    std::iota(v.begin(), v.end(), first);
    return v;
  }
};

TEST_F(RadixTreeTest, EmptyTreeMatchesNothing) {
  const std::vector<int32_t> t{1, 2, 3};
  PrefixMatch m = tree_->match_prefix(t, 3);
  EXPECT_EQ(m.node, tree_->root());
  EXPECT_EQ(m.length, 0);
  EXPECT_EQ(tree_->node_at(m), tree_->root());
  EXPECT_EQ(tree_->node_count(), 0);
  EXPECT_EQ(tree_->cached_tokens(), 0);
}

TEST_F(RadixTreeTest, InsertThenMatchLongestPrefix) {
  RadixNode* a = insert(tree_->root(), iota(10, 100));
  EXPECT_EQ(a->start, 0);
  EXPECT_EQ(a->end(), 10);
  EXPECT_EQ(a->pages.size(), 3u);
  EXPECT_EQ(tree_->cached_tokens(), 10);
  EXPECT_EQ(tree_->node_count(), 1);
  for (int32_t p : a->pages) EXPECT_EQ(pool_.ref_count(p), 1);  // the tree's own reference

  std::vector<int32_t> q = iota(12, 100);
  PrefixMatch full = tree_->match_prefix(q, 12);
  EXPECT_EQ(full.node, a);
  EXPECT_EQ(full.node_tokens, 10);
  EXPECT_EQ(full.length, 10);
  PrefixMatch capped = tree_->match_prefix(q, 6);  // max_length stops inside the node
  EXPECT_EQ(capped.node, a);
  EXPECT_EQ(capped.node_tokens, 6);
  EXPECT_EQ(capped.length, 6);
  q[3] = -1;
  PrefixMatch diverged = tree_->match_prefix(q, 12);
  EXPECT_EQ(diverged.length, 3);
  EXPECT_EQ(tree_->node_count(), 1);  // matching changes nothing
}

TEST_F(RadixTreeTest, SplitInTheMiddleOfAPageSharesThatPage) {
  RadixNode* a = insert(tree_->root(), iota(10, 0));  // pages for indices 0, 1, 2
  const std::vector<int32_t> pages = a->pages;
  RadixNode* upper = tree_->split(a, 6);  // position 6 is slot 2 of page index 1
  EXPECT_EQ(upper->parent, tree_->root());
  EXPECT_EQ(a->parent, upper);
  EXPECT_EQ(upper->start, 0);
  EXPECT_EQ(upper->end(), 6);
  EXPECT_EQ(a->start, 6);
  EXPECT_EQ(a->end(), 10);
  EXPECT_EQ(upper->pages, (std::vector<int32_t>{pages[0], pages[1]}));
  EXPECT_EQ(a->pages, (std::vector<int32_t>{pages[1], pages[2]}));
  EXPECT_EQ(pool_.ref_count(pages[0]), 1);
  EXPECT_EQ(pool_.ref_count(pages[1]), 2);  // both halves list it, one reference each
  EXPECT_EQ(pool_.ref_count(pages[2]), 1);
  EXPECT_EQ(tree_->node_count(), 2);
  EXPECT_EQ(tree_->cached_tokens(), 10);
  EXPECT_NE(upper->id, a->id);
  EXPECT_TRUE(tree_->check_invariants().ok());
  EXPECT_TRUE(pool_.check_invariants().ok());
}

TEST_F(RadixTreeTest, SplitAtAPageBoundarySharesNothing) {
  RadixNode* a = insert(tree_->root(), iota(10, 0));
  const std::vector<int32_t> pages = a->pages;
  RadixNode* upper = tree_->split(a, 8);
  EXPECT_EQ(upper->pages, (std::vector<int32_t>{pages[0], pages[1]}));
  EXPECT_EQ(a->pages, (std::vector<int32_t>{pages[2]}));
  for (int32_t p : pages) EXPECT_EQ(pool_.ref_count(p), 1);
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, SplitKeepsLocksOnBothHalves) {
  RadixNode* a = insert(tree_->root(), iota(8, 0));
  tree_->lock(a);
  RadixNode* upper = tree_->split(a, 3);
  EXPECT_EQ(upper->lock_ref, 1);
  EXPECT_EQ(a->lock_ref, 1);
  tree_->unlock(a);
  EXPECT_EQ(upper->lock_ref, 0);
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, InsertReusesAndSplitsWhereTokensDiverge) {
  RadixNode* a = insert(tree_->root(), {1, 2, 3, 4, 5, 6});
  const std::vector<int32_t> a_pages = a->pages;
  // Same first three tokens, then different: the old node splits at 3.
  RadixNode* b = insert(tree_->root(), {1, 2, 3, 9, 9});
  EXPECT_EQ(tree_->node_count(), 3);
  EXPECT_EQ(tree_->cached_tokens(), 8);
  RadixNode* shared = b->parent;
  EXPECT_EQ(shared, a->parent);
  EXPECT_EQ(shared->end(), 3);
  EXPECT_EQ(b->start, 3);
  EXPECT_EQ(b->tokens, (std::vector<int32_t>{9, 9}));
  // The shared part keeps the old node's page; the new node lists the inserter's pages.
  EXPECT_EQ(shared->pages, (std::vector<int32_t>{a_pages[0]}));
  EXPECT_EQ(b->pages.size(), 2u);  // page indices 0 (slot 3) and 1
  EXPECT_NE(b->pages[0], a_pages[0]);
  // Inserting what is already there creates nothing and returns the existing node.
  EXPECT_EQ(insert(tree_->root(), {1, 2, 3, 9, 9}), b);
  // A prefix of an existing run splits it and returns the upper half.
  RadixNode* prefix = insert(tree_->root(), {1, 2});
  EXPECT_EQ(prefix->end(), 2);
  EXPECT_EQ(shared->parent, prefix);
  EXPECT_EQ(tree_->cached_tokens(), 8);
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, NodeAtAndNodeOnPath) {
  RadixNode* a = insert(tree_->root(), iota(9, 0));
  const std::vector<int32_t> q = iota(5, 0);
  PrefixMatch m = tree_->match_prefix(q, 5);
  RadixNode* at = tree_->node_at(m);  // splits a at 5
  EXPECT_EQ(at->end(), 5);
  EXPECT_EQ(a->parent, at);
  EXPECT_EQ(tree_->node_on_path(a, 0), tree_->root());
  EXPECT_EQ(tree_->node_on_path(a, 5), at);
  EXPECT_EQ(tree_->node_on_path(a, 9), a);
  RadixNode* two = tree_->node_on_path(a, 2);  // splits `at`
  EXPECT_EQ(two->end(), 2);
  EXPECT_EQ(at->parent, two);
  EXPECT_EQ(tree_->node_count(), 3);
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, LockCountsOnTheWholePath) {
  RadixNode* a = insert(tree_->root(), {1, 1});
  RadixNode* b = insert(a, {2, 2});
  tree_->lock(b);
  tree_->lock(a);
  EXPECT_EQ(a->lock_ref, 2);
  EXPECT_EQ(b->lock_ref, 1);
  const uint64_t before = a->last_access;
  tree_->unlock(a, /*touch=*/false);
  EXPECT_EQ(a->last_access, before);
  tree_->unlock(b);
  EXPECT_GT(a->last_access, before);
  EXPECT_EQ(a->lock_ref, 0);
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, EvictionIsLruLeavesFirstAndNeverLocked) {
  // root -> p(0..3) -> {x, y, z}; one page each beyond p.
  RadixNode* p = insert(tree_->root(), {5, 5, 5, 5});
  RadixNode* x = insert(p, {1, 1, 1, 1});
  RadixNode* y = insert(p, {2, 2, 2, 2});
  RadixNode* z = insert(p, {3, 3, 3, 3});
  tree_->touch(y);
  tree_->touch(x);  // LRU order now: z, y, x (p is touched with them)
  tree_->lock(x);
  const int32_t free0 = pool_.num_free();
  ASSERT_TRUE(tree_->evict(1));
  EXPECT_EQ(pool_.num_free(), free0 + 1);
  EXPECT_EQ(p->children.count(3), 0u);  // z went first
  EXPECT_EQ(p->children.count(2), 1u);
  (void)z;
  // Two more pages: only y is evictable (x is locked, so p is an inner node of a live path).
  EXPECT_FALSE(tree_->evict(2));
  EXPECT_EQ(pool_.num_free(), free0 + 1);  // all or nothing
  EXPECT_EQ(p->children.count(2), 1u);
  ASSERT_TRUE(tree_->evict(1));
  EXPECT_EQ(p->children.size(), 1u);
  EXPECT_EQ(p->children.count(1), 1u);
  EXPECT_FALSE(tree_->evict(1));
  EXPECT_TRUE(tree_->evict(0));
  EXPECT_EQ(tree_->evict_all(), 0);  // everything left is locked
  EXPECT_EQ(tree_->node_count(), 2);
  tree_->unlock(x);
  EXPECT_EQ(tree_->evict_all(), 2);
  EXPECT_EQ(tree_->node_count(), 0);
  EXPECT_EQ(tree_->cached_tokens(), 0);
  EXPECT_EQ(pool_.num_free(), pool_.num_pages());
  EXPECT_TRUE(tree_->check_invariants().ok());
}

TEST_F(RadixTreeTest, EvictionGoesOnUpToPagesWanted) {
  for (int32_t i = 0; i < 4; ++i) insert(tree_->root(), {i, i, i, i});
  const int32_t free0 = pool_.num_free();
  ASSERT_TRUE(tree_->evict(1, 3));
  EXPECT_EQ(pool_.num_free(), free0 + 3);
  EXPECT_EQ(tree_->node_count(), 1);
  EXPECT_FALSE(tree_->evict(2, 10));  // needed is what decides success
  EXPECT_EQ(tree_->node_count(), 1);
  ASSERT_TRUE(tree_->evict(1, 10));  // wanted beyond what exists: evicts what there is
  EXPECT_EQ(tree_->node_count(), 0);
}

TEST_F(RadixTreeTest, EvictionFreesParentsOnceTheirChildrenAreGone) {
  RadixNode* p = insert(tree_->root(), {5, 5, 5, 5});
  insert(p, {1, 1, 1, 1});
  tree_->touch(p);  // the parent is more recent than its child, but still goes after it
  ASSERT_TRUE(tree_->evict(2));
  EXPECT_EQ(tree_->node_count(), 0);
  EXPECT_EQ(pool_.num_free(), pool_.num_pages());
}

TEST_F(RadixTreeTest, SharedPageFreesOnlyWithItsLastHolder) {
  RadixNode* a = insert(tree_->root(), iota(6, 0));  // pages for indices 0, 1
  RadixNode* upper = tree_->split(a, 5);             // both list page index 1
  (void)upper;
  // Evicting the lower half alone frees nothing: its only page is still the upper's.
  const int32_t free0 = pool_.num_free();
  ASSERT_TRUE(tree_->evict(2));  // needs both halves
  EXPECT_EQ(pool_.num_free(), free0 + 2);
  EXPECT_EQ(tree_->node_count(), 0);
}

TEST_F(RadixTreeTest, ForEachNodeVisitsAllButRoot) {
  RadixNode* a = insert(tree_->root(), {1, 2});
  insert(a, {3});
  insert(a, {4});
  int visited = 0;
  tree_->for_each_node([&](const RadixNode& n) {
    EXPECT_NE(&n, tree_->root());
    ++visited;
  });
  EXPECT_EQ(visited, 3);
}

TEST_F(RadixTreeTest, DestructorReturnsEveryPageEvenForDeepChains) {
  RadixNode* n = tree_->root();
  for (int32_t i = 0; i < 20; ++i) n = insert(n, {i});
  tree_->lock(n);  // locks do not keep pages past the tree's lifetime
  EXPECT_LT(pool_.num_free(), pool_.num_pages());
  tree_.reset();
  EXPECT_EQ(pool_.num_free(), pool_.num_pages());
  EXPECT_TRUE(pool_.check_invariants().ok());
}

// One root per cache namespace: the same tokens under two roots are two nodes with their own
// pages, matched and evicted separately; one LRU clock orders eviction over all roots.
TEST_F(RadixTreeTest, RootsAreSeparateTrees) {
  RadixNode* other = tree_->add_root(0);
  EXPECT_EQ(tree_->root_count(), 2);
  RadixNode* a = insert(tree_->root(), {1, 2, 3, 4});
  RadixNode* b = insert(other, {1, 2, 3, 4});
  EXPECT_NE(a, b);
  EXPECT_NE(a->pages[0], b->pages[0]);
  const std::vector<int32_t> t{1, 2, 3, 4, 5};
  EXPECT_EQ(tree_->match_prefix(t, 5).node, a);
  EXPECT_EQ(tree_->match_prefix(t, 5, other).node, b);
  EXPECT_EQ(tree_->node_on_path(b, 0), other);
  EXPECT_EQ(tree_->node_on_path(a, 0), tree_->root());
  int visited = 0;
  tree_->for_each_node([&](const RadixNode&) { ++visited; }, other);
  EXPECT_EQ(visited, 1);
  // Eviction limited to one root leaves the other alone, even though `a` is older.
  EXPECT_TRUE(tree_->evict(1, 0, other));
  EXPECT_EQ(tree_->match_prefix(t, 5, other).length, 0);
  EXPECT_EQ(tree_->match_prefix(t, 5).length, 4);
  EXPECT_FALSE(tree_->evict(1, 0, other));  // nothing left there
  // Global eviction takes the least recently used leaf of any root.
  RadixNode* c = insert(other, {7, 7});
  tree_->touch(a);
  EXPECT_TRUE(tree_->evict(1));
  EXPECT_EQ(tree_->match_prefix(t, 5).length, 4);
  EXPECT_EQ(other->children.size(), 0u);
  (void)c;
  EXPECT_EQ(tree_->evict_all(other), 0);
  tree_->remove_root(other);
  EXPECT_EQ(tree_->root_count(), 1);
  EXPECT_TRUE(tree_->check_invariants().ok());
  EXPECT_TRUE(pool_.check_invariants().ok());
}

// A node's lock moving between 0 and 1 adds or removes its pages from its owner's locked
// count; a page both halves of a split list counts once.
TEST_F(RadixTreeTest, LockedPagesAreCountedOncePerPage) {
  RadixNode* other = tree_->add_root(1);
  RadixNode* a = insert(tree_->root(), iota(6, 0));  // pages for indices 0, 1
  RadixNode* b = insert(other, iota(4, 0));
  EXPECT_EQ(b->owner, 1);
  EXPECT_EQ(pool_.num_locked(), 0);
  tree_->lock(a);
  tree_->lock(a);
  EXPECT_EQ(pool_.owner_locked(0), 2);
  EXPECT_EQ(pool_.owner_locked(1), 0);
  RadixNode* upper = tree_->split(a, 5);  // position 5: page index 1 is in both halves
  EXPECT_TRUE(a->shares_first_page);
  EXPECT_FALSE(upper->shares_first_page);
  EXPECT_EQ(pool_.owner_locked(0), 2);
  EXPECT_TRUE(tree_->check_invariants().ok());
  tree_->unlock(a);
  tree_->unlock_node(a);  // the lower half alone: the upper half keeps its lock
  EXPECT_EQ(upper->lock_ref, 1);
  EXPECT_EQ(pool_.owner_locked(0), 2);
  tree_->unlock(upper);
  EXPECT_EQ(pool_.owner_locked(0), 0);
  // A commit inside a page: the new node's first page is its parent's last one.
  const std::vector<int32_t> tokens{7, 7};
  const std::vector<int32_t> pages{a->pages.back()};
  RadixNode* c = tree_->insert(a, tokens, pages);
  EXPECT_TRUE(c->shares_first_page);
  tree_->lock(c);
  EXPECT_EQ(pool_.owner_locked(0), 2);  // pages of indices 0 and 1, each once
  tree_->lock(b);
  EXPECT_EQ(pool_.owner_locked(1), 1);
  EXPECT_TRUE(tree_->check_invariants().ok());
  tree_.reset();  // teardown returns the locked counts with the pages
  EXPECT_EQ(pool_.num_locked(), 0);
  EXPECT_EQ(pool_.num_free(), pool_.num_pages());
  EXPECT_TRUE(pool_.check_invariants().ok());
}

// Regression: teardown of a deep tree. A chain of 100k nodes (a branch committed one token at
// a time) must not overflow the stack, as recursive unique_ptr teardown (one stack frame per
// level) would in the sanitizer build.
TEST(RadixTreeDeep, TearsDownAHundredThousandLevels) {
  constexpr int32_t kDepth = 100000;
  PagePool pool(kDepth, 1);
  auto tree = std::make_unique<RadixTree>(&pool);
  RadixNode* n = tree->root();
  for (int32_t i = 0; i < kDepth; ++i) {
    const int32_t page = pool.allocate();
    const std::vector<int32_t> token{i % 7}, pages{page};
    n = tree->insert(n, token, pages);
    pool.release(page);
  }
  EXPECT_EQ(tree->node_count(), kDepth);
  EXPECT_EQ(pool.num_free(), 0);
  tree.reset();
  EXPECT_EQ(pool.num_free(), kDepth);
}

}  // namespace
}  // namespace treeserve
