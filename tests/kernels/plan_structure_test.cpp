// Structure of attention plans: the coverage invariant on random trees and workload shapes,
// determinism, no steady-state allocation, the cost model's choices, long-context splitting,
// masks only where needed, rejection of invalid views and configs, and validate_attention_plan
// on built and corrupted plans.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_plan.h"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"
#include "tests/kernels/plan_test_util.h"

namespace treeserve {
namespace {

using testing::expect_plan_covers_view;
using testing::TreeCase;

AttentionPlanConfig small_config(int32_t gqa) {
  AttentionPlanConfig c;
  c.gqa_group_size = gqa;
  c.query_tile_rows = 16;
  c.kv_tile_tokens = 16;
  c.kv_chunk_tokens = 64;
  c.min_split_tokens = 16;
  c.pack_max_tokens = 48;
  c.num_sms = 8;
  return c;
}

testing::RandomTreeOptions options_for_seed(uint64_t seed) {
  testing::RandomTreeOptions o;
  o.depth = 1 + int32_t(seed % 10);
  o.max_width = std::vector<int32_t>{1, 2, 4, 8, 64}[seed % 5];
  o.max_runs = 80;
  o.max_run_tokens = std::vector<int32_t>{3, 40, 200}[seed % 3];
  o.page_size = std::vector<int32_t>{1, 16, 64}[(seed / 3) % 3];
  o.prefill_prob = 0.25;
  o.speculative_prob = 0.3;
  o.internal_query_prob = 0.2;
  o.dead_leaf_prob = 0.1;
  return o;
}

TEST(PlanStructure, EveryVisiblePairCoveredExactlyOnce) {
  for (uint64_t seed = 1; seed <= 120; ++seed) {
    const TreeCase c = testing::random_tree_case(seed, options_for_seed(seed));
    AttentionPlanConfig config = small_config(std::vector<int32_t>{1, 4, 8}[seed % 3]);
    config.greedy_grouping = seed % 4 != 1;
    config.pack_subtrees = seed % 5 != 2;
    config.long_context_split = seed % 6 != 3;
    config.balance_query_tiles = seed % 2 == 0;
    if (seed % 7 == 0) config = AttentionPlanConfig{};  // production defaults
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok()) << "seed " << seed;
    SCOPED_TRACE("seed " + std::to_string(seed));
    expect_plan_covers_view(plan, c.view, config);
    if (HasFatalFailure() || HasNonfatalFailure()) return;
  }
}

// testing::place_runs_at_depth_slots (bench_tree_attention --depth-slots): the server's layout,
// each run from slot depth % page size, is a valid view that the plans cover like any other.
TEST(PlanStructure, RunsAtDepthSlotsAreValidAndCovered) {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    TreeCase c = testing::random_tree_case(seed, options_for_seed(seed));
    testing::place_runs_at_depth_slots(&c, seed);
    SCOPED_TRACE("seed " + std::to_string(seed));
    ASSERT_TRUE(validate_attention_view(c.view, c.num_pages).ok());
    for (const KvNodeRun& n : c.view.nodes) {
      EXPECT_EQ(n.first_slot, n.depth_tokens % c.view.page_size);
    }
    std::vector<int32_t> pages(c.view.pages.begin(), c.view.pages.end());
    std::sort(pages.begin(), pages.end());
    EXPECT_TRUE(std::adjacent_find(pages.begin(), pages.end()) == pages.end()) << "page reused";
    const AttentionPlanConfig config = small_config(std::vector<int32_t>{1, 4, 8}[seed % 3]);
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    expect_plan_covers_view(plan, c.view, config);
    if (HasFatalFailure() || HasNonfatalFailure()) return;
  }
}

// testing::place_pages_as_fresh_pool (bench_tree_attention --fresh-pages): ids 0..n-1 in the
// order the pages' first tokens are written, so a few-shot prompt's pages come first and in
// order, and its branches' pages interleave (page k of every branch before page k + 1).
TEST(PlanStructure, FreshPoolPagesFollowTheTokensPositions) {
  TreeCase c = testing::few_shot_case(4000, 3, 200, 16, 4);
  testing::place_pages_as_fresh_pool(&c);
  ASSERT_TRUE(validate_attention_view(c.view, c.num_pages).ok());
  ASSERT_EQ(c.num_pages, int64_t(c.view.pages.size()));
  std::vector<int32_t> sorted(c.view.pages.begin(), c.view.pages.end());
  std::sort(sorted.begin(), sorted.end());
  for (int32_t i = 0; i < int32_t(sorted.size()); ++i) ASSERT_EQ(sorted[i], i);
  const KvNodeRun& prompt = c.view.nodes[0];
  ASSERT_EQ(prompt.parent, -1);
  for (int32_t k = 0; k < prompt.page_count; ++k) {
    EXPECT_EQ(c.view.pages[prompt.page_begin + k], k);
  }
  // Each branch's pages rise, and a later page of any branch follows every branch's pages
  // that start at an earlier position.
  for (size_t a = 1; a < c.view.nodes.size(); ++a) {
    const KvNodeRun& run = c.view.nodes[a];
    for (int32_t k = 1; k < run.page_count; ++k) {
      EXPECT_LT(c.view.pages[run.page_begin + k - 1], c.view.pages[run.page_begin + k]);
    }
    for (size_t b = 1; b < c.view.nodes.size(); ++b) {
      const KvNodeRun& other = c.view.nodes[b];
      if (run.page_count > 2 && other.page_count > 1) {
        EXPECT_LT(c.view.pages[other.page_begin], c.view.pages[run.page_begin + 2])
            << "branch " << b << "'s first page after branch " << a << "'s third";
      }
    }
  }
  const AttentionPlanConfig config = small_config(4);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  expect_plan_covers_view(plan, c.view, config);
}

TEST(PlanStructure, WorkloadShapesCovered) {
  const AttentionPlanConfig config;
  std::vector<TreeCase> cases;
  cases.push_back(testing::fasttree_case({1, 10}, {4000, 400}, 16, 1));
  cases.push_back(testing::fasttree_case({1, 4, 16}, {1024, 256, 64}, 16, 2));
  cases.push_back(testing::fasttree_case({1, 2, 4, 8}, {512, 128, 128, 128}, 16, 3));
  cases.push_back(testing::few_shot_case(4000, 20, 200, 16, 4));
  for (int32_t t : {32, 64, 128, 256}) {
    cases.push_back(testing::speculative_case(4000, testing::medusa_like_paths(t - 1), 16, 5));
  }
  for (const TreeCase& c : cases) {
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    expect_plan_covers_view(plan, c.view, config);
  }
}

bool same_plan(const AttentionPlan& a, const AttentionPlan& b) {
  return a.item_segment_begin == b.item_segment_begin && a.item_segment_end == b.item_segment_end &&
         a.item_query_begin == b.item_query_begin && a.item_query_end == b.item_query_end &&
         a.item_num_tokens == b.item_num_tokens && a.item_mask_offset == b.item_mask_offset &&
         a.seg_page_begin == b.seg_page_begin && a.seg_first_slot == b.seg_first_slot &&
         a.seg_num_tokens == b.seg_num_tokens && a.seg_node == b.seg_node &&
         a.item_queries == b.item_queries && a.mask_words == b.mask_words &&
         a.query_merge_begin == b.query_merge_begin && a.merge_partials == b.merge_partials;
}

TEST(PlanStructure, DeterministicAndReusesStorage) {
  testing::RandomTreeOptions o = options_for_seed(9);
  o.speculative_prob = 0.6;
  const TreeCase c = testing::random_tree_case(77, o);
  const TreeCase other = testing::few_shot_case(4000, 30, 200, 16, 1);
  const AttentionPlanConfig config = small_config(4);
  AttentionPlan a, b;
  ASSERT_TRUE(build_attention_plan(c.view, config, &a).ok());
  ASSERT_TRUE(build_attention_plan(other.view, config, &b).ok());  // dirty b first
  ASSERT_TRUE(build_attention_plan(c.view, config, &b).ok());
  EXPECT_TRUE(same_plan(a, b));
  // Steady state: rebuilding the same step reuses every buffer.
  const int32_t* items = b.item_num_tokens.data();
  const int32_t* segs = b.seg_node.data();
  const uint32_t* masks = b.mask_words.data();
  const int32_t* merge = b.merge_partials.data();
  const int32_t* units = b.scratch.unit_len.data();
  ASSERT_TRUE(build_attention_plan(c.view, config, &b).ok());
  EXPECT_EQ(items, b.item_num_tokens.data());
  EXPECT_EQ(segs, b.seg_node.data());
  EXPECT_EQ(masks, b.mask_words.data());
  EXPECT_EQ(merge, b.merge_partials.data());
  EXPECT_EQ(units, b.scratch.unit_len.data());
  EXPECT_TRUE(same_plan(a, b));
}

TEST(PlanStructure, LongestFirstOrdersItemsByCostAndKeepsCoverage) {
  const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 4);
  AttentionPlanConfig config = small_config(4);
  AttentionPlan plain, sorted;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plain).ok());
  config.item_order = AttentionPlanConfig::ItemOrder::kLongestFirst;
  ASSERT_TRUE(build_attention_plan(c.view, config, &sorted).ok());
  testing::expect_plan_covers_view(sorted, c.view, config);
  ASSERT_EQ(plain.num_items(), sorted.num_items());
  auto cost = [&](const AttentionPlan& p, int32_t i) {
    return int64_t(p.item_num_tokens[i]) *
           (config.query_tile_rows + (p.item_query_end[i] - p.item_query_begin[i]) * 4);
  };
  bool moved = false;
  for (int32_t i = 0; i < sorted.num_items(); ++i) {
    if (i > 0) {
      EXPECT_GE(cost(sorted, i - 1), cost(sorted, i)) << "item " << i;
    }
    moved |= sorted.item_num_tokens[i] != plain.item_num_tokens[i];
  }
  EXPECT_TRUE(moved) << "this case's plan order is not already longest-first";
  // Same items, same partial slots: only the launch order differs.
  EXPECT_EQ(plain.item_queries, sorted.item_queries);
  EXPECT_EQ(plain.query_merge_begin, sorted.query_merge_begin);
  // Rebuilding reuses the reordered arrays' storage.
  const int32_t* items = sorted.item_num_tokens.data();
  ASSERT_TRUE(build_attention_plan(c.view, config, &sorted).ok());
  EXPECT_EQ(items, sorted.item_num_tokens.data());
}

// Plans of one view in two launch orders; both cover the view, with the same items.
void build_in_two_orders(const TreeCase& c, AttentionPlanConfig config,
                         AttentionPlanConfig::ItemOrder first,
                         AttentionPlanConfig::ItemOrder second, AttentionPlan* a,
                         AttentionPlan* b) {
  config.item_order = first;
  ASSERT_TRUE(build_attention_plan(c.view, config, a).ok());
  config.item_order = second;
  ASSERT_TRUE(build_attention_plan(c.view, config, b).ok());
  testing::expect_plan_covers_view(*b, c.view, config);
  ASSERT_EQ(a->num_items(), b->num_items());
}

TEST(PlanStructure, InterleavedOrderAlternatesLongAndShortItems) {
  const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 4);
  const AttentionPlanConfig config = small_config(4);
  AttentionPlan sorted, mixed;
  build_in_two_orders(c, config, AttentionPlanConfig::ItemOrder::kLongestFirst,
                      AttentionPlanConfig::ItemOrder::kInterleaved, &sorted, &mixed);
  const int32_t n = sorted.num_items();
  ASSERT_GE(n, 4);
  auto cost = [&](const AttentionPlan& p, int32_t i) {
    return int64_t(p.item_num_tokens[i]) *
           (config.query_tile_rows + (p.item_query_end[i] - p.item_query_begin[i]) * 4);
  };
  // Longest, shortest, second longest, second shortest, ...
  for (int32_t i = 0; i < n; ++i) {
    const int32_t from = i % 2 == 0 ? i / 2 : n - 1 - i / 2;
    EXPECT_EQ(cost(mixed, i), cost(sorted, from)) << "item " << i;
  }
  EXPECT_GT(cost(mixed, 0), cost(mixed, 1));
  EXPECT_EQ(sorted.item_queries, mixed.item_queries);
}

TEST(PlanStructure, KvMajorOrderPutsTheQueryTilesOfAChunkSideBySide) {
  // 64 one-token branches x GQA 4 over a 16000-token prompt: 4 query tiles, each its own
  // group, so as built each tile's 32 chunks come in a run; kv-major launches the 4 tiles of
  // each chunk side by side.
  const TreeCase c = testing::few_shot_case(16000, 64, 1, 16, 5);
  AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);  // the kernel's
  config.max_chunk_tokens = 0;  // chunks of 512 (growth would make them 2048)
  AttentionPlan plain, kv;
  build_in_two_orders(c, config, AttentionPlanConfig::ItemOrder::kPlan,
                      AttentionPlanConfig::ItemOrder::kKvMajor, &plain, &kv);
  ASSERT_EQ(kv.num_items(), 128);  // 4 tiles x 32 chunks
  auto key = [](const AttentionPlan& p, int32_t i) {
    const int32_t g = p.item_segment_begin[i];
    return std::pair{p.seg_node[g], p.seg_token_begin[g]};
  };
  auto adjacent_repeats = [&](const AttentionPlan& p) {
    int32_t n = 0;
    for (int32_t i = 1; i < p.num_items(); ++i) n += key(p, i) == key(p, i - 1);
    return n;
  };
  for (int32_t i = 1; i < kv.num_items(); ++i) EXPECT_LE(key(kv, i - 1), key(kv, i)) << i;
  EXPECT_EQ(adjacent_repeats(kv), 32 * 3);  // each chunk's 4 tiles together
  EXPECT_EQ(adjacent_repeats(plain), 0) << "the built order already groups the tiles";
  EXPECT_EQ(plain.item_queries, kv.item_queries);  // same partial slots, only the order moves
}

// Chunk growth (AttentionPlanConfig::max_chunk_tokens) on the kernel's config at GQA 4 (33
// item slots a kv head): the chunk among 512, 1024, 1536 and 2048 whose items, list-scheduled
// longest first at a block's fixed cost plus their KV tiles, end soonest. The cases are the
// benchmark's few-shot trees, each picking the chunk it runs fastest with
// (docs/tree-attention.md): a 16000-token prompt under 64 branches of 200 (4 query tiles) 2048,
// a 4000-token prompt under 50 branches 1024 (16 prompt items and 50 branches in one wave,
// where 32 prompt items leave 49 branches a wave of their own), and under 30 branches 512.
TEST(PlanStructure, ChunksGrowWhereTheSimulatedSpanShrinks) {
  AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  config.pair_heads = 0;  // chunk growth alone (HeadPairingWhereTheSimulatedSpanShrinks)
  ASSERT_EQ(config.kv_chunk_tokens, 512);
  ASSERT_EQ(config.num_sms, 33);
  auto chunk_of = [](const TreeCase& c, const AttentionPlanConfig& cfg) {
    AttentionPlan p;
    EXPECT_TRUE(build_attention_plan(c.view, cfg, &p).ok());
    testing::expect_plan_covers_view(p, c.view, cfg);
    int32_t longest = 0;
    for (int32_t i = 0; i < p.num_items(); ++i) longest = std::max(longest, p.item_num_tokens[i]);
    EXPECT_LE(longest, p.split_chunk_tokens);
    return p.split_chunk_tokens;
  };
  const TreeCase long_prompt = testing::few_shot_case(16000, 64, 200, 16, 7);
  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 8);
  const TreeCase b30 = testing::few_shot_case(4000, 30, 200, 16, 9);
  AttentionPlanConfig off = config;
  off.max_chunk_tokens = 0;
  EXPECT_EQ(chunk_of(long_prompt, off), 512) << "0 turns growth off";
  ASSERT_EQ(config.max_chunk_tokens, 2048) << "on by default";
  EXPECT_EQ(chunk_of(long_prompt, config), 2048);
  EXPECT_EQ(chunk_of(b50, config), 1024);
  EXPECT_EQ(chunk_of(b30, config), 512);
  AttentionPlanConfig capped = config;
  capped.max_chunk_tokens = 1024;
  EXPECT_EQ(chunk_of(long_prompt, capped), 1024);
  // GQA 1 (8 slots a kv head). FastTree's N=1,4,16 tree: growth would make its 1024-token
  // root one item, longer than all the rest (and slower), so it stays at 512.
  AttentionPlanConfig gqa1 = tree_attention_plan_config(32, 32, 128, 132);
  ASSERT_EQ(gqa1.num_sms, 8);
  EXPECT_EQ(chunk_of(testing::fasttree_case({1, 4, 16}, {1024, 256, 64}, 16, 2), gqa1), 512);
  EXPECT_EQ(chunk_of(b50, gqa1), 1024);
  // 256 one-token queries over 4000 tokens are 16 query tiles: 32 items of 2048 fill one wave
  // of the 33 slots, as 128 of 512 fill four. 257 make 17 tiles: 34 items of 2048 or 68 of
  // 1024 leave a last wave of 1 or 2 long items, 51 of 1536 (3 chunks of 1344) make two
  // waves, shorter than five of 512.
  EXPECT_EQ(chunk_of(testing::few_shot_case(4000, 256, 1, 16, 9), config), 2048);
  EXPECT_EQ(chunk_of(testing::few_shot_case(4000, 257, 1, 16, 9), config), 1536);
  // The engine's verify step for a 128-token tree (129 queries): 1536, a shorter step than
  // with 512.
  EXPECT_EQ(
      chunk_of(testing::speculative_case(4000, testing::medusa_like_paths(128), 16, 10), config),
      1536);
}

// place_equal_items (the simulation's list scheduling, whole rounds at once) leaves the same
// loads as placing the items one by one on a least-loaded slot.
TEST(PlanStructure, EqualItemsPlacedInRoundsMatchOneByOne) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const int slots = 1 + int(rng() % 40);
    const int64_t c = 1 + int64_t(rng() % 300);
    const int64_t n = int64_t(rng() % 400);
    std::vector<int64_t> loads(static_cast<size_t>(slots));
    const int64_t spread = trial % 3 == 0 ? 0 : 1 + int64_t(rng() % 2000);
    for (int64_t& l : loads) l = spread == 0 ? 0 : int64_t(rng() % uint64_t(spread));
    std::sort(loads.begin(), loads.end());
    std::vector<int64_t> heap = loads;  // one by one: a min-heap
    std::make_heap(heap.begin(), heap.end(), std::greater<>());
    for (int64_t i = 0; i < n; ++i) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      heap.back() += c;
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
    std::sort(heap.begin(), heap.end());
    place_equal_items(&loads, n, c);
    ASSERT_EQ(loads, heap) << "trial " << trial << ": " << slots << " slots, " << n
                           << " items of cost " << c;
  }
  std::vector<int64_t> loads = {0, 5, 9};
  place_equal_items(&loads, -3, 7);  // no items
  place_equal_items(&loads, 4, 0);   // no cost
  EXPECT_EQ(loads, (std::vector<int64_t>{0, 5, 9}));
  std::vector<int64_t> none;
  place_equal_items(&none, 5, 3);  // no slots
  EXPECT_TRUE(none.empty());
}

// Head pairing (AttentionPlanConfig::pair_heads): tree_attention_plan_config pairs at GQA >= 4
// with kv heads in groups of 4; the builder pairs where the simulated span is shorter by the
// margin (few-shot b=50 at Llama-3-8B heads pairs), with the paired (decode-shaped) items last
// and the same items as unpaired; pair_decode_items pairs any plan.
TEST(PlanStructure, HeadPairingWhereTheSimulatedSpanShrinks) {
  const AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  ASSERT_EQ(config.pair_heads, kTreeAttentionPairHeads);
  EXPECT_EQ(tree_attention_plan_config(32, 4, 128, 132).pair_heads, kTreeAttentionPairHeads);
  EXPECT_EQ(tree_attention_plan_config(32, 32, 128, 132).pair_heads, 0) << "GQA 1";
  EXPECT_EQ(tree_attention_plan_config(32, 2, 128, 132).pair_heads, 0) << "2 kv heads";
  auto rows = [](const AttentionPlan& p, int32_t i) {
    return (p.item_query_end[i] - p.item_query_begin[i]) * p.gqa_group_size;
  };
  // Items as (first segment, segment end, tokens, queries), sorted: the plan's work, in any order.
  auto work = [](const AttentionPlan& p) {
    std::vector<std::array<int32_t, 4>> w;
    for (int32_t i = 0; i < p.num_items(); ++i) {
      w.push_back({p.item_segment_begin[i], p.item_segment_end[i], p.item_num_tokens[i],
                   p.item_query_end[i] - p.item_query_begin[i]});
    }
    std::sort(w.begin(), w.end());
    return w;
  };
  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 8);
  AttentionPlan paired, unpaired;
  ASSERT_TRUE(build_attention_plan(b50.view, config, &paired).ok());
  AttentionPlanConfig off = config;
  off.pair_heads = 0;
  ASSERT_TRUE(build_attention_plan(b50.view, off, &unpaired).ok());
  EXPECT_EQ(unpaired.pair_heads, 0);
  ASSERT_EQ(paired.pair_heads, kTreeAttentionPairHeads);
  EXPECT_EQ(unpaired.split_chunk_tokens, 1024);
  // Paired, 5 chunks of 832: 160 wide and 100 paired blocks fill one wave (shorter than 4
  // chunks of 1024).
  EXPECT_EQ(paired.split_chunk_tokens, 832);
  ASSERT_EQ(paired.paired_items_begin, paired.num_items() - 50) << "the 50 branches, last";
  for (int32_t i = 0; i < paired.num_items(); ++i) {
    EXPECT_EQ(rows(paired, i) <= 16, i >= paired.paired_items_begin) << "item " << i;
  }
  AttentionPlanConfig off_832 = off;  // the same chunk, unpaired: the same items
  off_832.kv_chunk_tokens = 832;
  off_832.max_chunk_tokens = 0;
  AttentionPlan unpaired_832;
  ASSERT_TRUE(build_attention_plan(b50.view, off_832, &unpaired_832).ok());
  EXPECT_TRUE(work(paired) == work(unpaired_832));
  EXPECT_TRUE(validate_attention_plan(paired, b50.num_pages).ok());
  testing::expect_plan_covers_view(paired, b50.view, config);
  // Few-shot b=20 and b=30: the wide items (chunks of 512) fill the slots, and each branch
  // paired whole (13 tiles) would leave a long tail; cut in two (128 + 72 tokens) they pair.
  // The branches' items are the paired ones, none longer than 128 tokens; the prompt's keep
  // the 512-token chunk.
  for (const int32_t branches : {20, 30}) {
    const TreeCase c = testing::few_shot_case(4000, branches, 200, 16, 9);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    ASSERT_EQ(p.pair_heads, kTreeAttentionPairHeads) << branches;
    EXPECT_EQ(p.split_chunk_tokens, 512);
    EXPECT_EQ(p.num_items() - p.paired_items_begin, 2 * branches);
    for (int32_t i = 0; i < p.num_items(); ++i) {
      const bool paired_item = i >= p.paired_items_begin;
      EXPECT_EQ(rows(p, i) <= 16, paired_item) << branches << " item " << i;
      if (paired_item) {
        EXPECT_TRUE(p.item_num_tokens[i] == 128 || p.item_num_tokens[i] == 72) << i;
      } else {  // 7 chunks of 512 and one of 416
        EXPECT_TRUE(p.item_num_tokens[i] == 512 || p.item_num_tokens[i] == 416) << i;
      }
    }
    EXPECT_TRUE(validate_attention_plan(p, c.num_pages).ok());
    testing::expect_plan_covers_view(p, c.view, config);
  }
  // P=16000 + 64 x 200 simulates 5.7% shorter with its branches paired in pieces of 128 and
  // 72: it pairs so at the default 1/32 margin, not at 1/16. A margin under 2 is refused by
  // name.
  {
    const TreeCase c = testing::few_shot_case(16000, 64, 200, 16, 7);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    EXPECT_EQ(p.pair_heads, kTreeAttentionPairHeads);
    EXPECT_EQ(p.split_chunk_tokens, 2048);
    EXPECT_EQ(p.decode_chunk_tokens, 128);
    EXPECT_EQ(p.num_items() - p.paired_items_begin, 128);
    // Longest first (paired_longest_first): the 64 pieces of 128 tokens, then the 64 of 72,
    // each kind in kv-major order (one branch's pieces 64 items apart).
    for (int32_t i = p.paired_items_begin; i < p.num_items(); ++i) {
      const int32_t k = i - p.paired_items_begin;
      EXPECT_EQ(p.item_num_tokens[i], k < 64 ? 128 : 72) << "paired item " << k;
      if (k > 0 && k != 64) {
        EXPECT_LT(p.seg_node[p.item_segment_begin[i - 1]], p.seg_node[p.item_segment_begin[i]]);
      }
      if (k < 64) {
        EXPECT_EQ(p.seg_node[p.item_segment_begin[i]], p.seg_node[p.item_segment_begin[i + 64]]);
      }
    }
    testing::expect_plan_covers_view(p, c.view, config);
    // In kv-major order (false), each branch's two pieces side by side; the same items.
    AttentionPlanConfig kv_order = config;
    kv_order.paired_longest_first = false;
    AttentionPlan q;
    ASSERT_TRUE(build_attention_plan(c.view, kv_order, &q).ok());
    ASSERT_EQ(q.paired_items_begin, p.paired_items_begin);
    for (int32_t i = q.paired_items_begin; i < q.num_items(); ++i) {
      EXPECT_EQ(q.item_num_tokens[i], (i - q.paired_items_begin) % 2 == 0 ? 128 : 72) << i;
    }
    EXPECT_TRUE(work(q) == work(p));
    // decode_chunk_tokens overrides the builder's pieces (64: 64, 64, 64 and 8 tokens);
    // negative is refused by name.
    AttentionPlanConfig dc = config;
    dc.decode_chunk_tokens = 64;
    ASSERT_TRUE(build_attention_plan(c.view, dc, &q).ok());
    EXPECT_EQ(q.decode_chunk_tokens, 64);
    ASSERT_EQ(q.num_items() - q.paired_items_begin, 256);
    for (int32_t i = q.paired_items_begin; i < q.num_items(); ++i) {
      EXPECT_EQ(q.item_num_tokens[i], i - q.paired_items_begin < 192 ? 64 : 8) << i;
    }
    EXPECT_TRUE(validate_attention_plan(q, c.num_pages).ok());
    testing::expect_plan_covers_view(q, c.view, dc);
    dc.decode_chunk_tokens = -1;
    const Status neg = build_attention_plan(c.view, dc, &q);
    EXPECT_EQ(neg.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(neg.message().find("decode_chunk_tokens"), std::string::npos) << neg.message();
    AttentionPlanConfig m16 = config;
    m16.pair_margin = 16;
    ASSERT_TRUE(build_attention_plan(c.view, m16, &p).ok());
    EXPECT_EQ(p.pair_heads, 0);
    m16.pair_margin = 1;
    const Status bad = build_attention_plan(c.view, m16, &p);
    EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(bad.message().find("pair_margin"), std::string::npos) << bad.message();
  }
  // Not where pairing, whole or cut, does not shorten the simulated span by 1/32, nor at GQA 1.
  {
    const TreeCase c = testing::speculative_case(4000, testing::medusa_like_paths(255), 16, 10);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    EXPECT_EQ(p.pair_heads, 0) << c.view.queries.size() << " queries";
  }
  // Chunks other than the unpaired pick and the two shorter cuts are simulated paired too, and
  // kept only where every item (a paired group counting one) has an item slot of its own, one
  // wave: few-shot + 40 / 48 / 56 / 64 x 200, P=8000 + 32 x 200 and speculative t=64 (one
  // paired item) take such plans. Without the one-wave condition + 96 x 200 (2048 unpaired)
  // and P=8000 + 64 / 100 x 200 (1024, pieces of 128) would take plans of several waves, which
  // run slower; they keep their plans.
  auto slot_items = [](const AttentionPlan& p) {
    const int32_t paired = p.pair_heads > 1 ? p.num_items() - p.paired_items_begin : 0;
    return p.num_items() - paired +
           (paired + kTreeAttentionPairHeads - 1) / kTreeAttentionPairHeads;
  };
  const struct {
    int32_t prompt, branches, chunk;
  } one_wave[] = {
      {4000, 40, 832}, {4000, 48, 832}, {4000, 56, 1024}, {4000, 64, 1024}, {8000, 32, 832}};
  for (const auto& w : one_wave) {
    const TreeCase c = testing::few_shot_case(w.prompt, w.branches, 200, 16, 11);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    ASSERT_EQ(p.pair_heads, kTreeAttentionPairHeads) << w.prompt << " + " << w.branches;
    EXPECT_EQ(p.split_chunk_tokens, w.chunk) << w.prompt << " + " << w.branches;
    EXPECT_EQ(p.decode_chunk_tokens, w.chunk) << "branches whole";
    EXPECT_EQ(p.num_items() - p.paired_items_begin, w.branches);
    EXPECT_LE(slot_items(p), config.num_sms) << w.prompt << " + " << w.branches;
    EXPECT_TRUE(validate_attention_plan(p, c.num_pages).ok());
    testing::expect_plan_covers_view(p, c.view, config);
  }
  {
    const TreeCase c = testing::speculative_case(4000, testing::medusa_like_paths(63), 16, 10);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    EXPECT_EQ(p.pair_heads, kTreeAttentionPairHeads);
    EXPECT_EQ(p.split_chunk_tokens, 576);
    EXPECT_EQ(p.num_items() - p.paired_items_begin, 1);
    EXPECT_LE(slot_items(p), config.num_sms);
    testing::expect_plan_covers_view(p, c.view, config);
  }
  const struct {
    int32_t prompt, branches, chunk, decode_chunk;
    bool paired;
  } kept[] = {
      {4000, 96, 2048, 2048, false}, {8000, 64, 1024, 128, true}, {8000, 100, 1024, 128, true}};
  for (const auto& k : kept) {
    const TreeCase c = testing::few_shot_case(k.prompt, k.branches, 200, 16, 11);
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, config, &p).ok());
    EXPECT_EQ(p.pair_heads > 1, k.paired) << k.prompt << " + " << k.branches;
    EXPECT_EQ(p.split_chunk_tokens, k.chunk) << k.prompt << " + " << k.branches;
    EXPECT_EQ(p.decode_chunk_tokens, k.decode_chunk) << k.prompt << " + " << k.branches;
    EXPECT_GT(slot_items(p), config.num_sms) << "several waves";
  }
  AttentionPlan gqa1;
  ASSERT_TRUE(build_attention_plan(b50.view, tree_attention_plan_config(32, 32, 128), &gqa1).ok());
  EXPECT_EQ(gqa1.pair_heads, 0);
  // Any plan: random trees with masks and packs.
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    const TreeCase c = testing::random_tree_case(seed * 7717, options_for_seed(seed));
    AttentionPlan p;
    ASSERT_TRUE(build_attention_plan(c.view, small_config(4), &p).ok());
    const auto before = work(p);
    AttentionPlan longest = p;
    pair_decode_items(&p, 4);
    EXPECT_EQ(p.pair_heads, 4);
    for (int32_t i = 0; i < p.num_items(); ++i) {
      EXPECT_EQ(rows(p, i) <= 16, i >= p.paired_items_begin) << "seed " << seed << " item " << i;
    }
    EXPECT_TRUE(work(p) == before) << "seed " << seed;
    EXPECT_TRUE(validate_attention_plan(p, c.num_pages).ok()) << "seed " << seed;
    testing::expect_plan_covers_view(p, c.view, small_config(4));
    // Longest first: the same items at the front, the paired ones by decreasing tokens.
    pair_decode_items(&longest, 4, true);
    ASSERT_EQ(longest.paired_items_begin, p.paired_items_begin) << "seed " << seed;
    for (int32_t i = 0; i < longest.num_items(); ++i) {
      if (i < p.paired_items_begin) {
        EXPECT_EQ(longest.item_segment_begin[i], p.item_segment_begin[i]) << "seed " << seed;
      } else if (i > p.paired_items_begin) {
        EXPECT_GE(longest.item_num_tokens[i - 1], longest.item_num_tokens[i]) << "seed " << seed;
      }
    }
    EXPECT_TRUE(work(longest) == before) << "seed " << seed;
    EXPECT_TRUE(validate_attention_plan(longest, c.num_pages).ok()) << "seed " << seed;
    testing::expect_plan_covers_view(longest, c.view, small_config(4));
  }
}

TEST(PlanStructure, KvMixedOrderSpreadsNarrowItemsAmongWideOnes) {
  // Few-shot b=50 at GQA 4: the prompt's chunks are read by wide items (16 queries x 4 heads),
  // each branch by a narrow one (4 rows). Mixed keeps each kind in kv-major order and spreads
  // the narrow items evenly among the wide ones.
  const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 4);
  AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  config.pair_heads = 0;  // head pairing only pairs kv-major plans
  AttentionPlan kv, mixed;
  build_in_two_orders(c, config, AttentionPlanConfig::ItemOrder::kKvMajor,
                      AttentionPlanConfig::ItemOrder::kKvMixed, &kv, &mixed);
  auto narrow = [&](const AttentionPlan& p, int32_t i) {
    return (p.item_query_end[i] - p.item_query_begin[i]) * p.gqa_group_size <= config.narrow_rows;
  };
  auto kinds = [&](const AttentionPlan& p, bool want_narrow) {
    std::vector<std::pair<int32_t, int32_t>> items;  // (first segment's node, token) per item
    for (int32_t i = 0; i < p.num_items(); ++i) {
      if (narrow(p, i) != want_narrow) continue;
      const int32_t g = p.item_segment_begin[i];
      items.emplace_back(p.seg_node[g], p.seg_token_begin[g]);
    }
    return items;
  };
  const int32_t n = mixed.num_items();
  const auto wide = kinds(mixed, false), narrows = kinds(mixed, true);
  ASSERT_GT(wide.size(), 8u);
  ASSERT_GT(narrows.size(), 8u);
  EXPECT_EQ(kinds(kv, false), wide) << "wide items keep their kv-major order";
  EXPECT_EQ(kinds(kv, true), narrows) << "narrow items keep their kv-major order";
  EXPECT_FALSE(narrow(kv, 0)) << "kv-major: the prompt's (wide) items come first";
  // Every prefix of the mixed order holds each kind in proportion, within one item.
  int64_t seen_narrow = 0;
  for (int32_t i = 0; i < n; ++i) {
    seen_narrow += narrow(mixed, i) ? 1 : 0;
    const double share = double(i + 1) * double(narrows.size()) / n;
    EXPECT_LE(std::abs(double(seen_narrow) - share), 1.0) << "after item " << i;
  }
  EXPECT_EQ(kv.item_queries, mixed.item_queries);  // same partial slots, only the order moves
}

// Tokens of run `node` read by the plan, over all items.
int64_t tokens_read(const AttentionPlan& plan, int32_t node) {
  int64_t total = 0;
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
      if (plan.seg_node[g] == node) total += plan.seg_num_tokens[g];
    }
  }
  return total;
}

TEST(PlanStructure, CostModelKeepsSharedPrefixGroup) {
  for (int32_t gqa : {1, 4, 8}) {
    const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 3);
    AttentionPlanConfig config;
    config.gqa_group_size = gqa;
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    EXPECT_EQ(plan.num_folded_edges, 0) << "gqa " << gqa;
    EXPECT_EQ(plan.num_groups, 51) << "gqa " << gqa;
    // The prefix is read once per query tile of the 50 queries, never once per query.
    const int64_t tiles = (50 + plan.queries_per_tile - 1) / plan.queries_per_tile;
    EXPECT_EQ(tokens_read(plan, 0), 4000 * tiles) << "gqa " << gqa;
    expect_plan_covers_view(plan, c.view, config);
  }
}

TEST(PlanStructure, CostModelFoldsTinySharedRunIntoChildren) {
  // root(4000) -> {mid(1) -> {a(300), b(300)}, c(300)}: mid is one token read by 2 queries.
  testing::TreeViewBuilder builder(16);
  const int32_t root = builder.add_run(-1, 4000);
  const int32_t mid = builder.add_run(root, 1);
  builder.add_query(builder.add_run(mid, 300));
  builder.add_query(builder.add_run(mid, 300));
  builder.add_query(builder.add_run(root, 300));
  const TreeCase c = builder.build(5);
  AttentionPlanConfig config;
  config.pack_subtrees = false;
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  EXPECT_EQ(plan.num_folded_edges, 2);  // mid folded into a and b; root kept shared
  EXPECT_EQ(plan.num_groups, 4);        // root, a+mid, b+mid, c
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    const int32_t first = plan.item_segment_begin[i];
    if (plan.seg_node[first] == 1) {  // preorder index of mid
      ASSERT_EQ(plan.item_segment_end[i] - first, 2) << "mid read with its child";
    }
  }
  expect_plan_covers_view(plan, c.view, config);
  config.greedy_grouping = false;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  EXPECT_EQ(plan.num_groups, 5);
  expect_plan_covers_view(plan, c.view, config);
}

TEST(PlanStructure, LongContextSplitFillsSms) {
  testing::TreeViewBuilder builder(16);
  builder.add_query(builder.add_run(-1, 16384));
  const TreeCase c = builder.build(1);
  AttentionPlanConfig config;  // 132 SMs, 1024-token chunks, 128-token minimum
  config.long_context_split = false;
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  EXPECT_EQ(plan.num_items(), 16);
  config.long_context_split = true;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  EXPECT_EQ(plan.split_chunk_tokens, 128);
  EXPECT_EQ(plan.num_items(), 128);  // 16384 / 128: as many as min_split_tokens allows
  config.num_sms = 32;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  EXPECT_GE(plan.num_items(), 32);
  EXPECT_LT(plan.num_items(), 64);  // the largest chunk that fills the SMs, no finer
  expect_plan_covers_view(plan, c.view, config);
  // Enough work already: no splitting.
  const TreeCase wide = testing::few_shot_case(1000, 200, 1000, 16, 2);
  ASSERT_TRUE(build_attention_plan(wide.view, AttentionPlanConfig{}, &plan).ok());
  EXPECT_EQ(plan.split_chunk_tokens, 1024);
}

// balance_query_tiles: the same number of query tiles per chunk, their sizes within one
// query of each other, so a chunk read by 50 queries at 16 a tile has no 2-query remainder.
TEST(PlanStructure, BalancedQueryTilesSplitEvenly) {
  const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 3);
  AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128);
  ASSERT_TRUE(config.balance_query_tiles);
  const int32_t per_tile = config.query_tile_rows / config.gqa_group_size;  // 16
  for (const bool balanced : {false, true}) {
    SCOPED_TRACE(balanced ? "balanced" : "full tiles");
    config.balance_query_tiles = balanced;
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    expect_plan_covers_view(plan, c.view, config);
    // The prompt's chunks (more than one query): tile sizes per chunk.
    std::vector<std::pair<int32_t, std::vector<int32_t>>> chunks;  // (first segment, sizes)
    for (int32_t i = 0; i < plan.num_items(); ++i) {
      const int32_t n = plan.item_query_end[i] - plan.item_query_begin[i];
      if (n == 1) continue;  // a branch's own item
      auto it = std::find_if(chunks.begin(), chunks.end(),
                             [&](const auto& e) { return e.first == plan.item_segment_begin[i]; });
      if (it == chunks.end()) {
        chunks.push_back({plan.item_segment_begin[i], {}});
        it = chunks.end() - 1;
      }
      it->second.push_back(n);
    }
    ASSERT_FALSE(chunks.empty());
    for (const auto& [seg, sizes] : chunks) {
      ASSERT_EQ(sizes.size(), 4u) << "ceil(50 / 16) tiles, segment " << seg;
      int32_t total = 0;
      for (int32_t n : sizes) total += n;
      EXPECT_EQ(total, 50);
      const auto [lo, hi] = std::minmax_element(sizes.begin(), sizes.end());
      if (balanced) {
        EXPECT_LE(*hi - *lo, 1);
        EXPECT_EQ(*lo, 12);
      } else {
        EXPECT_EQ(*hi, per_tile);
        EXPECT_EQ(*lo, 2);  // 50 - 3 * 16
      }
    }
  }
}

TEST(PlanStructure, MasksOnlyWherePartlyVisible) {
  // Causal prefill chunk: 32 queries at the end of a 100-token run under a 4000-token prefix.
  testing::TreeViewBuilder builder(16);
  const int32_t leaf = builder.add_run(builder.add_run(-1, 4000), 100);
  for (int32_t j = 0; j < 32; ++j) builder.add_query(leaf, 68 + j + 1);
  const TreeCase c = builder.build(3);
  AttentionPlanConfig config;
  config.long_context_split = false;
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    bool has_leaf = false;
    for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
      has_leaf |= plan.seg_node[g] == 1;
    }
    EXPECT_EQ(plan.item_mask_offset[i] >= 0, has_leaf) << "item " << i;
  }
  expect_plan_covers_view(plan, c.view, config);

  // Queries at a run's own node: those that see the run whole (decode; an internal query with
  // a child below it) need no mask, and one that sees part of it masks the items it is in even
  // where a later query at the same node sees it whole.
  {
    testing::TreeViewBuilder b(16);
    const int32_t root = b.add_run(-1, 3000);
    const int32_t decode = b.add_run(root, 200);
    b.add_query(decode);
    const int32_t inner = b.add_run(root, 90);
    b.add_query(inner);
    b.add_query(b.add_run(inner, 40));
    const int32_t part = b.add_run(root, 120);
    b.add_query(part, 50);
    b.add_query(part);
    const TreeCase t = b.build(5);
    AttentionPlanConfig no_pack = config;
    no_pack.pack_subtrees = false;
    ASSERT_TRUE(build_attention_plan(t.view, no_pack, &plan).ok());
    const int32_t part_node = t.view.queries.back().leaf;  // the last query sees `part` whole
    for (int32_t i = 0; i < plan.num_items(); ++i) {
      bool has_part = false;
      for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
        has_part |= plan.seg_node[g] == part_node;
      }
      EXPECT_EQ(plan.item_mask_offset[i] >= 0, has_part) << "item " << i;
    }
    expect_plan_covers_view(plan, t.view, no_pack);
  }

  // Speculative token tree: packed into masked items; the prefix stays unmasked.
  const TreeCase spec = testing::speculative_case(4000, testing::medusa_like_paths(63), 16, 4);
  ASSERT_TRUE(build_attention_plan(spec.view, config, &plan).ok());
  EXPECT_GT(plan.num_packs, 0);
  EXPECT_FALSE(plan.mask_words.empty());
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    if (plan.seg_node[plan.item_segment_begin[i]] == 0) {
      EXPECT_LT(plan.item_mask_offset[i], 0);
    }
  }
  expect_plan_covers_view(plan, spec.view, config);
}

// item_visible_tokens (the record word that lets stage 1 skip the mask test on whole tiles):
// on hand-made masks, and on built plans against the bits read one token at a time.
TEST(PlanStructure, VisibleTokensAreTheLeadingTokensEveryQuerySees) {
  AttentionPlan plan;
  // Item 0: no mask. Item 1: 3 queries over 100 tokens (4 words a row): the first invisible
  // tokens are 70, 33 and none (bits past the item's end are clear). Item 2: one query whose
  // first token is invisible.
  plan.item_num_tokens = {50, 100, 40};
  plan.item_query_begin = {0, 1, 4};
  plan.item_query_end = {1, 4, 5};
  plan.item_mask_offset = {-1, 0, 12};
  plan.mask_words.assign(14, 0xffffffffu);
  plan.mask_words[2] &= ~(1u << (70 - 64));
  plan.mask_words[3] = 0xfu;             // tokens 96..99
  plan.mask_words[4 + 1] &= ~(1u << 1);  // token 33
  plan.mask_words[4 + 3] = 0xfu;
  plan.mask_words[8 + 3] = 0xfu;
  plan.mask_words[12] = 0xfffffffeu;  // token 0
  plan.mask_words[13] = 0xffu;
  EXPECT_EQ(item_visible_tokens(plan, 0), 50);
  EXPECT_EQ(item_visible_tokens(plan, 1), 33);
  EXPECT_EQ(item_visible_tokens(plan, 2), 0);
  plan.mask_words[4 + 1] = 0xffffffffu;
  EXPECT_EQ(item_visible_tokens(plan, 1), 70);
  plan.mask_words[2] = 0xffffffffu;
  EXPECT_EQ(item_visible_tokens(plan, 1), 100);
  // Mask rows past the plan's mask words (an invalid plan): nothing is assumed visible.
  plan.item_mask_offset[1] = 3;
  EXPECT_EQ(item_visible_tokens(plan, 1), 0);

  int masked_items = 0, with_prefix = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const TreeCase c = testing::random_tree_case(seed, options_for_seed(seed));
    AttentionPlanConfig config = small_config(std::vector<int32_t>{1, 4, 8}[seed % 3]);
    if (seed % 3 == 0) config = tree_attention_plan_config(32, 8, 128);
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok()) << "seed " << seed;
    for (int32_t i = 0; i < plan.num_items(); ++i) {
      const int32_t n = plan.item_num_tokens[size_t(i)];
      const int32_t queries = plan.item_query_end[size_t(i)] - plan.item_query_begin[size_t(i)];
      const int32_t off = plan.item_mask_offset[size_t(i)];
      const int32_t words = AttentionPlan::mask_words_per_row(n);
      auto sees = [&](int32_t q, int32_t t) {
        return off < 0 || (plan.mask_words[size_t(off + q * words + t / 32)] >> (t % 32)) & 1u;
      };
      int32_t expect = n;
      for (int32_t q = 0; q < queries; ++q) {
        for (int32_t t = 0; t < expect; ++t) {
          if (!sees(q, t)) {
            expect = t;
            break;
          }
        }
      }
      EXPECT_EQ(item_visible_tokens(plan, i), expect) << "seed " << seed << " item " << i;
      if (off >= 0) {
        ++masked_items;
        with_prefix += expect > 0;
      }
    }
  }
  // The random trees make masked items, and some of them begin with tokens all their queries
  // see (a shared run packed with the subtrees below it).
  EXPECT_GT(masked_items, 500);
  EXPECT_GT(with_prefix, 500);
}

TEST(PlanStructure, WorkspaceBoundsEnforced) {
  const TreeCase c = testing::few_shot_case(4000, 50, 200, 16, 3);
  AttentionPlanConfig config;
  config.max_work_items = 10;
  AttentionPlan plan;
  const Status s = build_attention_plan(c.view, config, &plan);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("work items"), std::string::npos) << s.ToString();
}

void expect_invalid(const AttentionView& view, const std::string& needle) {
  AttentionPlan plan;
  const Status s = build_attention_plan(view, AttentionPlanConfig{}, &plan);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.ToString();
}

TEST(PlanStructure, RejectsInvalidViews) {
  testing::TreeViewBuilder builder(16);
  const int32_t root = builder.add_run(-1, 40);
  builder.add_query(builder.add_run(root, 20));
  builder.add_query(builder.add_run(root, 20));
  const AttentionView good = builder.build(0).view;
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(good, AttentionPlanConfig{}, &plan).ok());

  AttentionView v = good;
  v.nodes[1].parent = 2;
  expect_invalid(v, "parent after child");
  v = good;
  v.queries[0].leaf_tokens = 21;
  expect_invalid(v, "leaf_tokens = 21 is out of range");
  v = good;
  v.queries[1].leaf_tokens = 0;
  expect_invalid(v, "queries[1].leaf_tokens");
  v = good;
  v.nodes[0].query_end = 1;
  expect_invalid(v, "nodes[0].query_begin/query_end");
  v = good;
  v.nodes[2].page_begin = int32_t(v.pages.size()) - 1;
  expect_invalid(v, "nodes[2].page_begin");
  v = good;
  v.pages[1] = -3;
  expect_invalid(v, "pages[1] = -3");
  v = good;
  std::swap(v.queries[0], v.queries[1]);
  expect_invalid(v, "not sorted");
  v = good;
  v.nodes[1].page_count = 7;
  expect_invalid(v, "nodes[1].page_count");
  v = good;
  v.nodes[2].depth_tokens = 3;
  expect_invalid(v, "nodes[2].depth_tokens");
  v = good;
  v.queries[0].leaf = 9;
  expect_invalid(v, "queries[0].leaf = 9");

  AttentionPlanConfig config;
  config.num_pages = 2;  // the view uses more pages than the pool has
  EXPECT_EQ(build_attention_plan(good, config, &plan).code(), StatusCode::kInvalidArgument);
  config = AttentionPlanConfig{};
  config.query_tile_rows = 4;
  config.gqa_group_size = 8;
  const Status s = build_attention_plan(good, config, &plan);
  EXPECT_NE(s.message().find("query_tile_rows"), std::string::npos) << s.ToString();
}

TEST(ValidateAttentionPlan, BuiltPlansPassCorruptedPlansFail) {
  const TreeCase c = testing::speculative_case(500, testing::medusa_like_paths(15), 16, 3);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, AttentionPlanConfig{}, &plan).ok());
  ASSERT_TRUE(validate_attention_plan(plan, c.num_pages).ok());
  ASSERT_GE(plan.num_items(), 2);
  struct Corruption {
    const char* field;  // expected in the message
    void (*apply)(AttentionPlan*);
  };
  const Corruption corruptions[] = {
      {"item_num_tokens", [](AttentionPlan* p) { p->item_num_tokens[0] += 1; }},
      {"item_segment_begin",
       [](AttentionPlan* p) { p->item_segment_end[0] = p->item_segment_begin[0]; }},
      {"item_query_begin", [](AttentionPlan* p) { p->item_query_end[0] = p->num_partials() + 1; }},
      {"belongs to items",
       [](AttentionPlan* p) {
         p->item_query_begin[1] = p->item_query_begin[0];
         p->item_query_end[1] = p->item_query_end[0];
       }},
      {"page_table", [](AttentionPlan* p) { p->page_table[0] = -3; }},
      {"seg_num_tokens", [](AttentionPlan* p) { p->seg_first_slot[0] = p->page_size; }},
      {"item_mask_offset",
       [](AttentionPlan* p) { p->item_mask_offset[0] = int32_t(p->mask_words.size()); }},
      {"query_merge_begin", [](AttentionPlan* p) { p->query_merge_begin.pop_back(); }},
      {"merge_partials", [](AttentionPlan* p) { p->merge_partials[0] = p->merge_partials[1]; }},
      {"max_item_tokens", [](AttentionPlan* p) { p->max_item_tokens = 0; }},
      {"query_rows", [](AttentionPlan* p) { p->query_rows[0] = -1; }},
      {"paired_items_begin",
       [](AttentionPlan* p) {
         p->pair_heads = 4;
         p->paired_items_begin = p->num_items() + 1;
       }},
      {"a paired item with more than 16",
       [](AttentionPlan* p) {
         p->pair_heads = 4;
         p->paired_items_begin = 0;
         p->item_query_end[0] = p->item_query_begin[0] + 17;
       }},
  };
  for (const Corruption& k : corruptions) {
    AttentionPlan broken = plan;
    k.apply(&broken);
    const Status s = validate_attention_plan(broken);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << k.field;
    EXPECT_NE(s.message().find(k.field), std::string::npos) << k.field << ": " << s.ToString();
  }
  EXPECT_FALSE(validate_attention_plan(plan, 1).ok()) << "page ids past a 1-page pool";
}

}  // namespace
}  // namespace treeserve

namespace treeserve {
namespace {

TEST(TreeAttentionGridBucket, CoversTheCountWithAtMostAnEighthSpare) {
  EXPECT_EQ(tree_attention_grid_bucket(0), 64);
  EXPECT_EQ(tree_attention_grid_bucket(64), 64);
  EXPECT_EQ(tree_attention_grid_bucket(65), 72);
  EXPECT_EQ(tree_attention_grid_bucket(128), 128);
  EXPECT_EQ(tree_attention_grid_bucket(129), 144);
  for (int32_t n = 1; n < 200000; n += 1 + n / 50) {
    const int32_t b = tree_attention_grid_bucket(n);
    EXPECT_GE(b, n);
    if (n > 64) {
      EXPECT_LE(b - n, b / 8) << n;
    }
    EXPECT_EQ(tree_attention_grid_bucket(b), b) << n;  // a bucket is its own bucket
  }
}

// A tail grid's stage 1 capacity (TreeAttentionGrid::wide_items): at most 7 items of padding,
// and never more than the grid's items (the launch refuses wide_items > items), taking the
// items the plan has as the bound for the wide ones it runs.
TEST(TreeAttentionGridBucket, WideItemsPadAtMostSevenWithinTheGrid) {
  EXPECT_EQ(tree_attention_wide_bucket(0), 8);
  EXPECT_EQ(tree_attention_wide_bucket(8), 8);
  EXPECT_EQ(tree_attention_wide_bucket(9), 16);
  EXPECT_EQ(tree_attention_wide_bucket(32), 32);
  for (int32_t n = 1; n < 200000; n += 1 + n / 50) {
    const int32_t b = tree_attention_wide_bucket(n);
    EXPECT_GE(b, n);
    EXPECT_LE(b - n, 7) << n;
    EXPECT_LE(b, tree_attention_grid_bucket(n)) << n;
  }
}

// The tail kernel's launch padding on sm_90 (228 KB an SM, 1 KB reserved a block; stage 1
// at head_dim 128 with a 2048-token table takes 92,704 bytes): three of its blocks fit beside
// two stage 1 blocks and four do not, at any allocation granularity up to 256 bytes; no padding
// where it would more than double the block, or where three would not fit.
TEST(TreeAttentionTail, LaunchPaddingFitsThreeBesideStageOne) {
  constexpr int32_t kSm = 233472, kReserved = 1024, kOwn = 10240, kStage1 = 92704;
  const int32_t pad = tree_attention_tail_block_smem(kOwn, kStage1, kSm, kReserved);
  EXPECT_EQ(pad, 12032);
  EXPECT_EQ(pad % 128, 0);
  for (int32_t unit : {1, 128, 256}) {
    auto round = [unit](int32_t b) { return (b + unit - 1) / unit * unit; };
    const int32_t left = kSm - 2 * round(kStage1 + kReserved);
    const int32_t block = round(pad + kReserved);
    EXPECT_LE(3 * block, left) << unit;
    EXPECT_GT(4 * block, left) << unit;
  }
  // head_dim 64: stage 1's block is smaller, three would take more than twice the kernel's own.
  EXPECT_EQ(tree_attention_tail_block_smem(5120, 51744, kSm, kReserved), 5120);
  // A stage 1 block that leaves no room for three: the kernel's own.
  EXPECT_EQ(tree_attention_tail_block_smem(kOwn, 110000, kSm, kReserved), kOwn);
}

// The kAuto rules of the wide kernel (tree_attention_wide_pays) and of the tail kernel
// (tree_attention_tail_pays), on the plans the builder makes for an H100's 132 SMs at
// Llama-3-8B heads: both take P=16000 + 64 x 200's paired items (one wave of wide blocks, the
// paired ones a second), neither those of few-shot P=4000 + b x 200 (the paired blocks fit
// beside the wide ones); at speculative t=128 (its wide blocks more than a wave) only the wide
// kernel's block rule holds (it does not run there: masked items are left after its pairs,
// tree_attention_wide_rest); the tail kernel only where
// the wide blocks fill 3/4 of one wave (P=8000 + 40 x 100: 192 of 264, where stage 1 alone is
// faster; P=4000 + 80 x 200: 200, where the tail kernel is), the wide kernel also where they
// take more than a wave (P=16000 + 128 x 200: 512). Timings in docs/tree-attention.md.
TEST(TreeAttentionTail, PaysWhereThePairedBlocksWouldFormASecondWave) {
  // (wide blocks, paired blocks) at 132 SMs' 264 slots: whether each rule pays.
  struct Blocks {
    int64_t wide, paired;
    bool wide_pays, tail_pays;
  };
  for (const Blocks& b :
       {Blocks{0, 100, false, false}, Blocks{100, 0, false, false}, Blocks{264, 0, false, false},
        Blocks{264, 1, true, true}, Blocks{265, 500, true, false}, Blocks{200, 64, false, false},
        Blocks{200, 65, true, true}, Blocks{197, 100, true, false}, Blocks{198, 100, true, true},
        Blocks{96, 240, true, false}}) {
    EXPECT_EQ(tree_attention_wide_pays(b.wide, b.paired, 132), b.wide_pays)
        << b.wide << " wide blocks, " << b.paired << " paired";
    EXPECT_EQ(tree_attention_tail_pays(b.wide, b.paired, 132), b.tail_pays)
        << b.wide << " wide blocks, " << b.paired << " paired";
  }
  struct Expect {
    std::string name;
    testing::TreeCase tree;
    bool wide, tail;
  };
  std::vector<Expect> cases;
  cases.push_back({"P=16000 + 64x200", testing::few_shot_case(16000, 64, 200, 16, 7), true, true});
  for (int32_t b : {20, 30, 50}) {
    cases.push_back({"P=4000 + " + std::to_string(b) + "x200",
                     testing::few_shot_case(4000, b, 200, 16, 4), false, false});
  }
  cases.push_back({"speculative t=128",
                   testing::speculative_case(4000, testing::medusa_like_paths(127), 16, 5), true,
                   false});
  cases.push_back({"P=8000 + 40x100", testing::few_shot_case(8000, 40, 100, 16, 8), true, false});
  cases.push_back({"P=4000 + 80x200", testing::few_shot_case(4000, 80, 200, 16, 9), true, true});
  cases.push_back(
      {"P=16000 + 128x200", testing::few_shot_case(16000, 128, 200, 16, 10), true, false});
  const AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  for (const Expect& e : cases) {
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(e.tree.view, config, &plan).ok());
    ASSERT_EQ(plan.pair_heads, kTreeAttentionPairHeads) << e.name;
    const int64_t wide = int64_t(plan.paired_items_begin) * 8;
    const int64_t paired = int64_t(plan.num_paired_items()) * (8 / kTreeAttentionPairHeads);
    EXPECT_EQ(tree_attention_wide_pays(wide, paired, 132), e.wide)
        << e.name << ": " << wide << " wide blocks, " << paired << " paired";
    EXPECT_EQ(tree_attention_tail_pays(wide, paired, 132), e.tail)
        << e.name << ": " << wide << " wide blocks, " << paired << " paired";
  }
}

// The plan-level facts the workspace's upload and bench_tree_attention --plan-only read: the
// decode kernel's condition (every item decode-shaped) and where head pairing begins.
TEST(TreeAttentionAuto, DecodeShapedAndPairedBeginFromThePlan) {
  const AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  AttentionPlan few_shot, baseline;
  const testing::TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 4);
  ASSERT_TRUE(build_attention_plan(b50.view, config, &few_shot).ok());
  ASSERT_TRUE(build_baseline_plan(b50.view, config, &baseline).ok());
  EXPECT_FALSE(tree_attention_all_decode_shaped(few_shot));  // its prompt items: 64-row tiles
  EXPECT_TRUE(tree_attention_all_decode_shaped(baseline));   // one query's 4 heads an item
  EXPECT_FALSE(tree_attention_all_decode_shaped(AttentionPlan{}));  // no items
  ASSERT_EQ(few_shot.pair_heads, kTreeAttentionPairHeads);
  EXPECT_EQ(tree_attention_paired_begin(few_shot), few_shot.paired_items_begin);
  EXPECT_GT(tree_attention_paired_begin(few_shot), 0);
  AttentionPlanConfig unpaired = config;
  unpaired.pair_heads = 0;
  AttentionPlan plain;
  ASSERT_TRUE(build_attention_plan(b50.view, unpaired, &plain).ok());
  EXPECT_EQ(tree_attention_paired_begin(plain), -1);
  AttentionPlan negative = few_shot;  // invalid (the upload refuses it): never a begin
  negative.paired_items_begin = -2;
  EXPECT_EQ(tree_attention_paired_begin(negative), -1);
}

// tree_attention_auto_kernels: the kAuto picks from a plan's counts (132 SMs, 8 kv heads).
// The wide kernel needs pairs covering every item before the paired ones, on top of its block
// rule, or, in a plan without paired items, pairs covering every item, whose stage 1 blocks fill
// 3/4 of its 264 slots, over chunks of 1024+ tokens; the tail kernel needs paired items past
// the first.
TEST(TreeAttentionAuto, KernelsFromThePlansCounts) {
  struct Counts {
    int32_t items, paired_begin, wide_pairs, max_tokens;
    bool wide, tail;
  };
  for (const Counts& c :
       {Counts{160, 32, 16, 2048, true, true},   // P=16000 + 64 x 200: 256 wide blocks, 256 paired
        Counts{160, 32, 15, 2048, false, true},  // the same with an item left after the pairs
        Counts{192, 64, 32, 2048, true, false},  // P=16000 + 128 x 200: 512 wide blocks
        Counts{185, 25, 2, 512, false, true},    // P=4000 + 80 x 200: 200 wide blocks, rest 21
        Counts{100, 20, 2, 512, false, false},   // P=4000 + 80 x 100: 160 wide blocks, rest 16
        Counts{70, 20, 10, 832, false, false},   // P=4000 + 50 x 200: the paired blocks fit
        Counts{60, -1, 15, 2048, false, false},  // no paired items, items after the pairs
        Counts{32, -1, 16, 2048, true, false},   // pairs alone (P=32k + 64 x 200's rank 0): 256
        Counts{32, -1, 16, 512, false, false},   // the same over 512-token chunks
        Counts{32, -1, 16, 1024, true, false},   // over 1024-token chunks
        Counts{24, -1, 12, 2048, false, false},  // pairs alone, 192 blocks: under 3/4 of 264
        Counts{26, -1, 13, 2048, true, false},   // 208 blocks
        Counts{34, -1, 16, 2048, false, false},  // an item left after the pairs
        Counts{60, 0, 0, 200, false, false},     // only paired items
        Counts{60, 60, 30, 2048, true, false}}) {  // paired_begin past the items: pairs alone
    const TreeAttentionAutoKernels k =
        tree_attention_auto_kernels(c.items, c.paired_begin, c.wide_pairs, c.max_tokens, 8, 132);
    const std::string what = std::to_string(c.items) + " items, paired from " +
                             std::to_string(c.paired_begin) + ", " + std::to_string(c.wide_pairs) +
                             " pairs, " + std::to_string(c.max_tokens) + " tokens";
    EXPECT_EQ(k.wide, c.wide) << what;
    EXPECT_EQ(k.tail, c.tail) << what;
  }
}

// The wide kernel's pairs: the query tiles of one shared chunk, side by side in the kV-major
// order, pair up (P=16000 + 64 x 200: 8 chunks of 4 tiles, 16 pairs; a speculative tree's
// prompt tiles); a pair ends at the first masked, decode-shaped, head-paired or differently
// chunked item, and a plan of decode branches alone has none.
TEST(TreeAttentionWide, PairsTheQueryTilesOfASharedChunk) {
  const AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  AttentionPlan plan;
  const TreeCase p16k = testing::few_shot_case(16000, 64, 200, 16, 7);
  ASSERT_TRUE(build_attention_plan(p16k.view, config, &plan).ok());
  const int32_t pairs = tree_attention_wide_pairs(plan);
  EXPECT_EQ(2 * pairs, plan.paired_items_begin);
  for (int32_t i = 0; i < pairs; ++i) {
    const size_t a = size_t(2 * i), b = a + 1;
    EXPECT_EQ(plan.item_num_tokens[a], plan.item_num_tokens[b]);
    EXPECT_EQ(plan.seg_page_begin[size_t(plan.item_segment_begin[a])],
              plan.seg_page_begin[size_t(plan.item_segment_begin[b])]);
    EXPECT_LT(plan.item_mask_offset[a], 0);
    EXPECT_GT(plan.item_rows(int32_t(a)), kDecodeShapedRows);
  }
  const TreeCase spec = testing::speculative_case(4000, testing::medusa_like_paths(255), 16, 5);
  ASSERT_TRUE(build_attention_plan(spec.view, config, &plan).ok());
  const int32_t spec_pairs = tree_attention_wide_pairs(plan);
  EXPECT_GT(spec_pairs, 0);
  ASSERT_LT(2 * spec_pairs, plan.num_items());
  for (int32_t i = 0; i < 2 * spec_pairs; ++i) EXPECT_LT(plan.item_mask_offset[size_t(i)], 0);
  // Queries at the prompt's end (few_shot_case with no branch tokens): pairs alone, which
  // kAuto gives the wide kernel (tree_attention_wide_alone_pays: 256 blocks of 1024 tokens).
  const TreeCase alone = testing::few_shot_case(8000, 64, 0, 16, 38);
  ASSERT_TRUE(build_attention_plan(alone.view, config, &plan).ok());
  EXPECT_EQ(tree_attention_paired_begin(plan), -1);
  EXPECT_EQ(2 * tree_attention_wide_pairs(plan), plan.num_items());
  EXPECT_TRUE(tree_attention_auto_kernels(plan.num_items(), -1, tree_attention_wide_pairs(plan),
                                          plan.max_item_tokens, 8, 132)
                  .wide);

  // A pair broken by a different chunk, a mask, or a narrow first item stops the count there.
  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 4);
  ASSERT_TRUE(build_attention_plan(b50.view, config, &plan).ok());
  const int32_t full = tree_attention_wide_pairs(plan);
  ASSERT_GE(full, 2);
  AttentionPlan broken = plan;
  broken.item_num_tokens[3] -= 1;
  EXPECT_EQ(tree_attention_wide_pairs(broken), 1);
  broken = plan;
  broken.item_mask_offset[2] = 0;
  EXPECT_EQ(tree_attention_wide_pairs(broken), 1);
  broken = plan;
  broken.item_query_end[0] = broken.item_query_begin[0] + 1;  // 4 rows
  EXPECT_EQ(tree_attention_wide_pairs(broken), 0);
  // Item 1's segments copied to the end of the list: equal content still pairs, one slot
  // off does not.
  broken = plan;
  const int32_t copy = broken.num_segments();
  for (int32_t j = broken.item_segment_begin[1]; j < broken.item_segment_end[1]; ++j) {
    for (std::vector<int32_t>* v :
         {&broken.seg_page_begin, &broken.seg_first_slot, &broken.seg_num_tokens, &broken.seg_node,
          &broken.seg_token_begin}) {
      v->push_back((*v)[size_t(j)]);
    }
  }
  broken.item_segment_end[1] = copy + broken.item_segment_end[1] - broken.item_segment_begin[1];
  broken.item_segment_begin[1] = copy;
  EXPECT_EQ(tree_attention_wide_pairs(broken), full);
  broken.seg_first_slot[size_t(copy)] += 1;
  EXPECT_EQ(tree_attention_wide_pairs(broken), 0);
  broken = plan;
  broken.pair_heads = kTreeAttentionPairHeads;
  broken.paired_items_begin = 3;
  EXPECT_EQ(tree_attention_wide_pairs(broken), 1);

  const TreeCase branches = testing::few_shot_case(16, 8, 200, 16, 4);  // one prompt tile
  ASSERT_TRUE(build_attention_plan(branches.view, config, &plan).ok());
  EXPECT_EQ(tree_attention_wide_pairs(plan), 0);
}

}  // namespace
}  // namespace treeserve
