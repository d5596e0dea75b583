// Speculative token trees (append_token_tree / accept) and the attention view: shared runs
// listed once, query rows and leaves, drafts as one-token runs, and validate_attention_view.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/attention_plan.h"
#include "kvcache/kv_cache.h"
#include "tests/kvcache/kv_cache_test_util.h"

namespace treeserve {
namespace {

using testing::concat;
using testing::make_cache;
using testing::seq;
using testing::tokens_of;
using V = std::vector<int32_t>;

void expect_valid(const AttentionView& view, const KvCache& cache) {
  const Status st = validate_attention_view(view, cache.pool().num_pages());
  EXPECT_TRUE(st.ok()) << st.ToString();
}

TEST(KvCacheDraft, AcceptKeepsOnePathAndCompactsIt) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(6))->id;  // pages 0, 1
  //        d0
  //       /  \      (parents: -1, 0, 0, 2)
  //      d1  d2
  //           |
  //          d3
  const V drafts{10, 11, 12, 13}, parents{-1, 0, 0, 2};
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append_token_tree(b, drafts, parents, &slots).ok());
  // Stored at positions 6..9: page 1 slots 2, 3 and a new page 2 slots 0, 1.
  EXPECT_EQ(slots, (std::vector<KvSlot>{{1, 2}, {1, 3}, {2, 0}, {2, 1}}));
  EXPECT_EQ(*cache->branch_length(b), 6);  // drafts are not tokens yet
  EXPECT_EQ(tokens_of(*cache, b), seq(6));
  EXPECT_TRUE(cache->check_invariants().ok());

  std::vector<SlotMove> moves;
  const V path{0, 2, 3};
  ASSERT_TRUE(cache->accept(b, path, &moves).ok());
  // d0 stays at position 6; d2 moves 8 -> 7; d3 moves 9 -> 8.
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].src, (KvSlot{2, 0}));
  EXPECT_EQ(moves[0].dst, (KvSlot{1, 3}));
  EXPECT_EQ(moves[1].src, (KvSlot{2, 1}));
  EXPECT_EQ(moves[1].dst, (KvSlot{2, 0}));
  EXPECT_EQ(tokens_of(*cache, b), concat(seq(6), {10, 12, 13}));
  EXPECT_EQ(cache->stats().pages_used, 3);
  EXPECT_TRUE(cache->check_invariants().ok());
}

TEST(KvCacheDraft, RejectedDraftsReleaseTheirPages) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(4))->id;  // page 0 full
  const V drafts{1, 2, 3, 4, 5}, parents{-1, 0, 1, 2, 3};
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append_token_tree(b, drafts, parents, &slots).ok());
  EXPECT_EQ(cache->stats().pages_used, 3);
  std::vector<SlotMove> moves;
  ASSERT_TRUE(cache->accept(b, {}, &moves).ok());  // nothing accepted
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(cache->stats().pages_used, 1);
  EXPECT_EQ(tokens_of(*cache, b), seq(4));
  // A chain accepted in order needs no moves at all.
  ASSERT_TRUE(cache->append_token_tree(b, drafts, parents, &slots).ok());
  const V path{0, 1};
  ASSERT_TRUE(cache->accept(b, path, &moves).ok());
  EXPECT_TRUE(moves.empty());
  EXPECT_EQ(tokens_of(*cache, b), concat(seq(4), {1, 2}));
  EXPECT_EQ(cache->stats().pages_used, 2);
  EXPECT_TRUE(cache->check_invariants().ok());
}

TEST(KvCacheDraft, PendingTreeBlocksOtherEdits) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(5))->id;
  const V one{1}, root{-1};
  std::vector<KvSlot> slots;
  std::vector<SlotMove> moves;
  EXPECT_EQ(cache->accept(b, {}, &moves).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache->append_token_tree(b, one, root, &slots).ok());
  EXPECT_EQ(cache->append_token_tree(b, one, root, &slots).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->append(b, one, &slots).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->fork(b, 1).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(cache->truncate(b, 1).status().code(), StatusCode::kFailedPrecondition);
  const V not_a_root{1}, out_of_range{5}, negative{-1};
  EXPECT_EQ(cache->accept(b, not_a_root, &moves).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->accept(b, out_of_range, &moves).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache->accept(b, negative, &moves).code(), StatusCode::kInvalidArgument);
  const V broken_chain{0, 0};
  EXPECT_EQ(cache->accept(b, broken_chain, &moves).code(), StatusCode::kInvalidArgument);
  // Prune drops the drafts with the branch.
  StatusOr<PruneResult> r = cache->finish(b);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 5);
  EXPECT_EQ(cache->stats().pages_used, 2);
  EXPECT_EQ(cache->match_prefix_length(concat(seq(5), {1, 0})), 5);  // drafts never cached
  EXPECT_TRUE(cache->check_invariants().ok());
}

TEST(KvCacheView, SharedPrefixIsListedOnceForAllBranches) {
  auto cache = make_cache(16);
  const BranchId a = cache->create_branch(seq(10))->id;
  StatusOr<ForkResult> f = cache->fork(a, 3);  // shared node [0, 10), three tails
  ASSERT_TRUE(f.ok());
  const BranchId c1 = f->branches[0], c2 = f->branches[1], c3 = f->branches[2];
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(c1, V{1}, &slots).ok());
  ASSERT_TRUE(cache->append(c2, V{2, 3}, &slots).ok());
  // c3 appends nothing: its last token is in the shared node.
  const std::vector<ViewQuery> queries{{c1, 1}, {c2, 2}, {c3, 1}};
  AttentionView view;
  ASSERT_TRUE(cache->build_attention_view(queries, &view).ok());
  expect_valid(view, *cache);
  EXPECT_EQ(view.page_size, 4);
  ASSERT_EQ(view.nodes.size(), 3u);  // the shared node once, two tails
  const KvNodeRun& shared = view.nodes[0];
  EXPECT_EQ(shared.parent, -1);
  EXPECT_EQ(shared.num_tokens, 10);
  EXPECT_EQ(shared.depth_tokens, 0);
  EXPECT_EQ(shared.first_slot, 0);
  EXPECT_EQ(shared.page_count, 3);
  EXPECT_EQ(shared.query_begin, 0);
  EXPECT_EQ(shared.query_end, 4);
  for (int i = 1; i <= 2; ++i) {
    EXPECT_EQ(view.nodes[i].parent, 0);
    EXPECT_EQ(view.nodes[i].depth_tokens, 10);
    EXPECT_EQ(view.nodes[i].first_slot, 2);
    EXPECT_EQ(view.nodes[i].page_count, 1);
  }
  EXPECT_EQ(view.nodes[1].num_tokens, 1);
  EXPECT_EQ(view.nodes[1].node_id, c1);
  EXPECT_EQ(view.nodes[2].num_tokens, 2);
  EXPECT_EQ(view.nodes[2].node_id, c2);
  // Rows: c1 -> 0, c2 -> 1, 2, c3 -> 3; sorted by leaf, then position.
  ASSERT_EQ(view.queries.size(), 4u);
  EXPECT_EQ(view.queries[0].row, 3);
  EXPECT_EQ(view.queries[0].leaf, 0);
  EXPECT_EQ(view.queries[0].leaf_tokens, 10);
  EXPECT_EQ(view.queries[1].row, 0);
  EXPECT_EQ(view.queries[1].leaf, 1);
  EXPECT_EQ(view.queries[1].leaf_tokens, 1);
  EXPECT_EQ(view.queries[2].row, 1);
  EXPECT_EQ(view.queries[2].leaf_tokens, 1);
  EXPECT_EQ(view.queries[3].row, 2);
  EXPECT_EQ(view.queries[3].leaf, 2);
  EXPECT_EQ(view.queries[3].leaf_tokens, 2);
  // Pages: the shared node's three, then each tail's own copy of the partial page.
  EXPECT_EQ(view.pages, (std::vector<int32_t>{0, 1, 2, 3, 4}));
}

TEST(KvCacheView, PrefillChunkQueriesAreCausal) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(6))->id;
  const ViewQuery q{b, 6};
  AttentionView view;
  ASSERT_TRUE(cache->build_attention_view({&q, 1}, &view).ok());
  expect_valid(view, *cache);
  ASSERT_EQ(view.nodes.size(), 1u);
  EXPECT_EQ(view.nodes[0].num_tokens, 6);
  EXPECT_EQ(view.pages, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(view.queries.size(), 6u);
  for (int32_t i = 0; i < 6; ++i) {
    EXPECT_EQ(view.queries[i].row, i);
    EXPECT_EQ(view.queries[i].leaf_tokens, i + 1);
  }
}

TEST(KvCacheView, QueriesInsideTheSharedPathAndDeeperTrees) {
  auto cache = make_cache(32);
  const BranchId a = cache->create_branch(seq(7))->id;
  const BranchId b = cache->fork(a, 1, 5)->branches[0];  // [0, 5) shared
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append(b, V{1, 2, 3}, &slots).ok());
  const BranchId c = cache->fork(b, 1)->branches[0];  // [5, 8) shared by b and c
  ASSERT_TRUE(cache->append(c, V{4}, &slots).ok());
  // a: its last 4 tokens (two of them inside the shared node); b: its last token, which is
  // in the second shared node; c: one decode token.
  const std::vector<ViewQuery> queries{{a, 4}, {b, 1}, {c, 1}};
  AttentionView view;
  ASSERT_TRUE(cache->build_attention_view(queries, &view).ok());
  expect_valid(view, *cache);
  // Runs: [0,5) root; a's tail [5,7); [5,8) shared; c's tail [8,9).
  ASSERT_EQ(view.nodes.size(), 4u);
  int shared_roots = 0;
  for (const KvNodeRun& n : view.nodes) shared_roots += n.parent == -1;
  EXPECT_EQ(shared_roots, 1);
  EXPECT_EQ(view.queries.size(), 6u);
  int in_root = 0;
  for (const AttentionQuery& q : view.queries) {
    if (q.leaf == 0) {
      ++in_root;
      EXPECT_TRUE(q.row == 0 || q.row == 1);
      EXPECT_EQ(q.leaf_tokens, q.row + 4);  // positions 3 and 4
    }
  }
  EXPECT_EQ(in_root, 2);
}

TEST(KvCacheView, DraftsAreOneTokenRunsUnderTheirParents) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(6))->id;
  const V drafts{10, 11, 12, 13}, parents{-1, 0, 0, 2};
  std::vector<KvSlot> slots;
  ASSERT_TRUE(cache->append_token_tree(b, drafts, parents, &slots).ok());
  const ViewQuery q{b, 1};
  AttentionView view;
  ASSERT_TRUE(cache->build_attention_view({&q, 1}, &view).ok());
  expect_valid(view, *cache);
  // Preorder: tail, d0, d1, d2, d3.
  ASSERT_EQ(view.nodes.size(), 5u);
  EXPECT_EQ(view.nodes[0].num_tokens, 6);
  const int32_t want_parent[] = {0, 1, 1, 3};
  const int32_t want_depth[] = {6, 7, 7, 8};
  for (int d = 0; d < 4; ++d) {
    const KvNodeRun& n = view.nodes[1 + d];
    EXPECT_EQ(n.num_tokens, 1);
    EXPECT_EQ(n.parent, want_parent[d]) << d;
    EXPECT_EQ(n.depth_tokens, want_depth[d]) << d;
    EXPECT_EQ(view.pages[n.page_begin], slots[d].page);
    EXPECT_EQ(n.first_slot, slots[d].slot);
  }
  ASSERT_EQ(view.queries.size(), 5u);  // the decode token, then drafts in order (rows 1..4)
  EXPECT_EQ(view.queries[0].row, 0);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(view.queries[1 + d].row, 1 + d);
    EXPECT_EQ(view.queries[1 + d].leaf, 1 + d);
  }
  // num_tokens = 0 is allowed when drafts are pending: only the drafts query.
  const ViewQuery drafts_only{b, 0};
  ASSERT_TRUE(cache->build_attention_view({&drafts_only, 1}, &view).ok());
  expect_valid(view, *cache);
  EXPECT_EQ(view.queries.size(), 4u);
}

TEST(KvCacheView, RejectsBadQueries) {
  auto cache = make_cache(8);
  const BranchId b = cache->create_branch(seq(3))->id;
  AttentionView view;
  const std::vector<ViewQuery> twice{{b, 1}, {b, 1}};
  EXPECT_EQ(cache->build_attention_view(twice, &view).code(), StatusCode::kInvalidArgument);
  for (int32_t n : {0, -1, 4}) {
    const ViewQuery q{b, n};
    Status st = cache->build_attention_view({&q, 1}, &view);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << n;
    EXPECT_NE(st.message().find("num_tokens"), std::string::npos);
  }
  // An empty query list is an empty view.
  ASSERT_TRUE(cache->build_attention_view({}, &view).ok());
  EXPECT_TRUE(view.nodes.empty());
  EXPECT_TRUE(view.queries.empty());
}

}  // namespace
}  // namespace treeserve
