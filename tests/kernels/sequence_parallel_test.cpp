// Sequence-parallel plan split (kernels/sequence_parallel.h) on the CPU: on random trees and
// long-prefix shapes, for world 1-7, the shards validate, hold every item of the plan exactly
// once (same segments, queries and mask bits), read one contiguous token range of a long
// prefix each, are balanced within one start position's items; running each shard with the
// CPU executor (pages outside its plan_read_pages poisoned with NaN) and merging the states
// per query by log-sum-exp gives the unsplit plan's output and LSE. Also the split's argument
// checks.
#include "kernels/sequence_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention_cpu.h"
#include "kernels/attention_plan.h"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"
#include "tests/kernels/plan_test_util.h"

namespace treeserve {
namespace {

using testing::TreeCase;

constexpr float kTolerance = 1e-5f;

testing::RandomTreeOptions random_options(uint64_t seed) {
  testing::RandomTreeOptions o;
  o.depth = 1 + int32_t(seed % 8);
  o.max_width = std::vector<int32_t>{1, 3, 8, 32}[seed % 4];
  o.max_runs = 48;
  o.max_run_tokens = std::vector<int32_t>{4, 60, 400}[(seed / 4) % 3];
  o.root_tokens = seed % 3 == 0 ? 3000 : 0;
  o.page_size = std::vector<int32_t>{1, 16, 64}[seed % 3];
  o.prefill_prob = 0.2;
  o.speculative_prob = 0.3;
  o.internal_query_prob = 0.15;
  o.dead_leaf_prob = 0.05;
  return o;
}

AttentionPlanConfig random_config(uint64_t seed) {
  AttentionPlanConfig c;
  c.gqa_group_size = std::vector<int32_t>{1, 4, 8}[seed % 3];
  c.query_tile_rows = seed % 2 ? 64 : 16;
  c.kv_tile_tokens = 16;
  c.kv_chunk_tokens = seed % 2 ? 128 : 64;
  c.min_split_tokens = 16;
  c.pack_max_tokens = 64;
  c.num_sms = 16;
  c.greedy_grouping = seed % 5 != 0;
  c.item_order = AttentionPlanConfig::ItemOrder(seed % 4);
  return c;
}

// An item as comparable data: its segments (node, offset, tokens, page, slot), its queries and
// its mask bits (or a marker for none), independent of where the plan stores them.
std::vector<int64_t> describe_item(const AttentionPlan& p, int32_t i) {
  std::vector<int64_t> d;
  for (int32_t g = p.item_segment_begin[i]; g < p.item_segment_end[i]; ++g) {
    d.insert(d.end(), {p.seg_node[g], p.seg_token_begin[g], p.seg_num_tokens[g],
                       p.page_table[p.seg_page_begin[g]], p.seg_first_slot[g]});
  }
  d.push_back(-1);
  for (int32_t q = p.item_query_begin[i]; q < p.item_query_end[i]; ++q) {
    d.push_back(p.item_queries[q]);
  }
  d.push_back(-2);
  if (p.item_mask_offset[i] >= 0) {
    const int32_t words = (p.item_query_end[i] - p.item_query_begin[i]) *
                          AttentionPlan::mask_words_per_row(p.item_num_tokens[i]);
    for (int32_t w = 0; w < words; ++w) d.push_back(p.mask_words[p.item_mask_offset[i] + w]);
  }
  return d;
}

std::vector<std::vector<int64_t>> describe_items(const std::vector<const AttentionPlan*>& plans,
                                                 bool paired_only = false) {
  std::vector<std::vector<int64_t>> all;
  for (const AttentionPlan* p : plans) {
    const int32_t begin = paired_only ? p->num_items() - p->num_paired_items() : 0;
    for (int32_t i = begin; i < p->num_items(); ++i) all.push_back(describe_item(*p, i));
  }
  std::sort(all.begin(), all.end());
  return all;
}

// Shards validate, hold the plan's items exactly once, merge each query's partials exactly
// once over all shards, and keep the plan's per-view data.
void expect_valid_split(const AttentionPlan& plan, const std::vector<AttentionPlan>& shards,
                        int32_t world) {
  ASSERT_EQ(int32_t(shards.size()), world);
  std::vector<const AttentionPlan*> shard_ptrs;
  for (int32_t r = 0; r < world; ++r) {
    const AttentionPlan& s = shards[r];
    const Status v = validate_attention_plan(s);
    ASSERT_TRUE(v.ok()) << "rank " << r << ": " << v.ToString();
    EXPECT_EQ(s.query_rows, plan.query_rows);
    EXPECT_EQ(s.page_table, plan.page_table);
    EXPECT_EQ(s.gqa_group_size, plan.gqa_group_size);
    EXPECT_EQ(s.queries_per_tile, plan.queries_per_tile);
    EXPECT_EQ(s.pair_heads, plan.pair_heads);
    shard_ptrs.push_back(&s);
  }
  // Head pairing kept: the plan's paired items are the shards' paired items.
  EXPECT_TRUE(describe_items({&plan}, true) == describe_items(shard_ptrs, true))
      << "the shards' paired items differ from the plan's";
  EXPECT_TRUE(describe_items({&plan}) == describe_items(shard_ptrs))
      << "the shards' items differ from the plan's";
  for (int32_t q = 0; q < plan.num_queries(); ++q) {
    int32_t merged = 0;
    for (const AttentionPlan& s : shards) {
      merged += s.query_merge_begin[q + 1] - s.query_merge_begin[q];
    }
    EXPECT_EQ(merged, plan.query_merge_begin[q + 1] - plan.query_merge_begin[q]) << "query " << q;
  }
}

// Max shard cost <= total / world + the costliest group of items sharing a start position.
void expect_balanced(const AttentionPlan& plan, const std::vector<AttentionPlan>& shards,
                     SequenceParallelCost how = SequenceParallelCost::kTokensRows) {
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> starts;  // (start key, cost)
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    const int32_t g = plan.item_segment_begin[i];
    const int64_t cost = sequence_parallel_cost(plan, i, how);
    starts.push_back({(int64_t(plan.seg_node[g]) << 32) | plan.seg_token_begin[g], cost});
    total += cost;
  }
  std::sort(starts.begin(), starts.end());
  int64_t largest = 0;
  for (size_t k = 0; k < starts.size();) {
    int64_t group = 0;
    size_t j = k;
    for (; j < starts.size() && starts[j].first == starts[k].first; ++j) group += starts[j].second;
    largest = std::max(largest, group);
    k = j;
  }
  const double bound = double(total) / double(shards.size()) + double(largest);
  for (size_t r = 0; r < shards.size(); ++r) {
    int64_t cost = 0;
    for (int32_t i = 0; i < shards[r].num_items(); ++i) {
      cost += sequence_parallel_cost(shards[r], i, how);
    }
    EXPECT_LE(double(cost), bound) << "rank " << r << " of " << shards.size();
  }
}

// Every rank reads one contiguous, non-empty range of node's tokens, the ranks in order, the
// ranges covering the node's tokens together.
void expect_contiguous_ranges(const std::vector<AttentionPlan>& shards, int32_t node,
                              int32_t tokens) {
  int32_t previous_end = 0;
  for (size_t r = 0; r < shards.size(); ++r) {
    const AttentionPlan& s = shards[r];
    std::vector<uint8_t> read(size_t(tokens), 0);
    for (int32_t g = 0; g < s.num_segments(); ++g) {
      if (s.seg_node[g] != node) continue;
      for (int32_t t = 0; t < s.seg_num_tokens[g]; ++t) read[s.seg_token_begin[g] + t] = 1;
    }
    const auto first = std::find(read.begin(), read.end(), 1);
    ASSERT_NE(first, read.end()) << "rank " << r << " reads none of node " << node;
    const auto last = std::find(first, read.end(), 0);
    EXPECT_EQ(std::find(last, read.end(), 1), read.end()) << "rank " << r << ": not contiguous";
    EXPECT_EQ(int32_t(first - read.begin()), previous_end) << "rank " << r;
    previous_end = int32_t(last - read.begin());
  }
  EXPECT_EQ(previous_end, tokens);
}

// The default split of a plan over a long prefix (node, of tokens): valid, balanced, and the
// prefix cut into contiguous ranges.
void split_long_prefix(const AttentionPlan& plan, int32_t world, int32_t node, int32_t tokens,
                       std::vector<AttentionPlan>* shards) {
  ASSERT_TRUE(split_plan_for_sequence_parallel(plan, world, shards).ok());
  expect_valid_split(plan, *shards, world);
  expect_balanced(plan, *shards);
  expect_contiguous_ranges(*shards, node, tokens);
}

struct Problem {
  KvLayout layout;
  int32_t num_q_heads = 0;
  int32_t num_rows = 0;
  float scale = 1.f;
  std::vector<float> q, k, v;
};

Problem make_problem(const TreeCase& c, int32_t num_kv_heads, int32_t gqa, int32_t head_dim,
                     uint64_t seed) {
  Problem p;
  p.layout.num_layers = 1;
  p.layout.num_kv_heads = num_kv_heads;
  p.layout.head_dim = head_dim;
  p.layout.page_size = c.view.page_size;
  p.layout.num_pages = c.num_pages;
  p.layout.dtype_bytes = 4;
  p.num_q_heads = num_kv_heads * gqa;
  p.num_rows = c.num_rows;
  p.scale = 1.f / std::sqrt(float(head_dim));
  p.q = testing::random_floats(size_t(p.num_rows) * p.num_q_heads * head_dim, seed);
  p.k = testing::random_floats(size_t(p.layout.layer_elems()), seed + 1);
  p.v = testing::random_floats(size_t(p.layout.layer_elems()), seed + 2);
  return p;
}

// Runs every shard on its own copy of K/V, with every page outside plan_read_pages(shard) set to
// NaN, merges the states per query in rank order, and compares them with the unsplit plan's
// (want_o, want_lse). Also: a query without partials on a rank gets O = 0, LSE = -inf there.
void expect_merged_shards_match(const TreeCase& c, const std::vector<AttentionPlan>& shards,
                                const Problem& p, const std::vector<float>& want_o,
                                const std::vector<float>& want_lse) {
  const int32_t d = p.layout.head_dim;
  const int32_t nq = shards[0].num_queries();
  const size_t state_elems = size_t(nq) * p.num_q_heads;
  AttentionCpuWorkspace ws;
  std::vector<float> got_o(state_elems * d, 0.f);
  std::vector<float> got_lse(state_elems, -std::numeric_limits<float>::infinity());
  std::vector<float> shard_o(state_elems * d), shard_lse(state_elems);
  std::vector<int32_t> pages;
  const int64_t page_elems = p.layout.page_elems();
  for (size_t r = 0; r < shards.size(); ++r) {
    plan_read_pages(shards[r], &pages);
    std::vector<float> k(p.layout.layer_elems(), NAN), v = k;
    for (int32_t page : pages) {
      std::copy_n(p.k.begin() + page * page_elems, page_elems, k.begin() + page * page_elems);
      std::copy_n(p.v.begin() + page * page_elems, page_elems, v.begin() + page * page_elems);
    }
    const Status s = execute_attention_plan_cpu_state(
        shards[r], c.view, p.layout, p.q.data(), p.num_rows, k.data(), v.data(), p.num_q_heads,
        p.scale, shard_o.data(), shard_lse.data(), &ws);
    ASSERT_TRUE(s.ok()) << s.ToString();
    for (int32_t q = 0; q < nq; ++q) {
      const bool empty = shards[r].query_merge_begin[q] == shards[r].query_merge_begin[q + 1];
      for (int32_t h = 0; h < p.num_q_heads; ++h) {
        const size_t at = size_t(q) * p.num_q_heads + h;
        if (empty) {
          ASSERT_EQ(shard_lse[at], -std::numeric_limits<float>::infinity());
          ASSERT_EQ(shard_o[at * d], 0.f);
        }
        merge_attention_state(&got_o[at * d], &got_lse[at], &shard_o[at * d], shard_lse[at], d);
      }
    }
  }
  float worst_o = 0.f, worst_lse = 0.f;
  for (size_t i = 0; i < got_o.size(); ++i) {
    worst_o = std::max(worst_o, std::isnan(got_o[i]) ? INFINITY : std::fabs(got_o[i] - want_o[i]));
  }
  for (size_t i = 0; i < got_lse.size(); ++i) {
    worst_lse = std::max(worst_lse,
                         std::isnan(got_lse[i]) ? INFINITY : std::fabs(got_lse[i] - want_lse[i]));
  }
  EXPECT_LE(worst_o, kTolerance);
  EXPECT_LE(worst_lse, 1e-4f);
}

// The unsplit plan's states (checked against its output rows), then every world's split merged.
void expect_splits_match_unsplit(const TreeCase& c, const AttentionPlan& plan,
                                 const std::vector<int32_t>& worlds, const Problem& p) {
  const int32_t d = p.layout.head_dim;
  const size_t state_elems = size_t(plan.num_queries()) * p.num_q_heads;
  AttentionCpuWorkspace ws;
  std::vector<float> want_o(state_elems * d), want_lse(state_elems);
  Status s = execute_attention_plan_cpu_state(plan, c.view, p.layout, p.q.data(), p.num_rows,
                                              p.k.data(), p.v.data(), p.num_q_heads, p.scale,
                                              want_o.data(), want_lse.data(), &ws);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<float> want_out(size_t(p.num_rows) * p.num_q_heads * d, 7.f);
  s = execute_attention_plan_cpu(plan, c.view, p.layout, p.q.data(), p.num_rows, p.k.data(),
                                 p.v.data(), p.num_q_heads, p.scale, want_out.data(), &ws);
  ASSERT_TRUE(s.ok()) << s.ToString();
  const size_t row_elems = size_t(p.num_q_heads) * d;
  for (int32_t q = 0; q < plan.num_queries(); ++q) {  // the output rows are the states' O
    ASSERT_TRUE(std::equal(want_o.begin() + q * row_elems, want_o.begin() + (q + 1) * row_elems,
                           want_out.begin() + plan.query_rows[q] * row_elems))
        << "query " << q;
  }
  for (int32_t world : worlds) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<AttentionPlan> shards;
    ASSERT_TRUE(split_plan_for_sequence_parallel(plan, world, &shards).ok());
    expect_merged_shards_match(c, shards, p, want_o, want_lse);
  }
}

TEST(SequenceParallel, RandomTreesSplitIntoValidBalancedShards) {
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    const TreeCase c = testing::random_tree_case(seed * 6151, random_options(seed));
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, random_config(seed), &plan).ok()) << seed;
    for (int32_t world : {1, 2, 3, 4, 7}) {
      for (SequenceParallelCost how :
           {SequenceParallelCost::kTokensRows, SequenceParallelCost::kBlocks}) {
        SCOPED_TRACE("seed " + std::to_string(seed) + " world " + std::to_string(world) + " cost " +
                     std::to_string(int(how)));
        std::vector<AttentionPlan> shards;
        ASSERT_TRUE(split_plan_for_sequence_parallel(plan, world, &shards, how).ok());
        expect_valid_split(plan, shards, world);
        expect_balanced(plan, shards, how);
        if (HasFailure()) return;
      }
    }
  }
}

TEST(SequenceParallel, ShardsMergedByLogSumExpMatchUnsplitPlan) {
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const TreeCase c = testing::random_tree_case(seed * 7919, random_options(seed));
    const AttentionPlanConfig config = random_config(seed);
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    const Problem p =
        make_problem(c, seed % 4 == 0 ? 2 : 1, config.gqa_group_size, seed % 2 ? 64 : 128, seed);
    expect_splits_match_unsplit(c, plan, {2, 3, 5}, p);
    if (HasFailure()) return;
  }
}

// A plan that pairs heads (few-shot, Llama-3-8B heads): every shard pairs from the first of
// its items the plan paired, so the rank holding the branches runs them paired; the merged
// states still match.
TEST(SequenceParallel, PairedPlansKeepTheirPairingInEveryShard) {
  const TreeCase c = testing::few_shot_case(1000, 20, 100, 16, 4);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, tree_attention_plan_config(32, 8, 128, 32), &plan).ok());
  ASSERT_EQ(plan.pair_heads, kTreeAttentionPairHeads);
  ASSERT_GT(plan.paired_items_begin, 0);
  for (int32_t world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<AttentionPlan> shards;
    ASSERT_TRUE(split_plan_for_sequence_parallel(plan, world, &shards).ok());
    expect_valid_split(plan, shards, world);
    int32_t paired = 0;
    for (const AttentionPlan& s : shards) paired += s.num_paired_items();
    EXPECT_EQ(paired, plan.num_paired_items());
    ASSERT_TRUE(
        split_plan_for_sequence_parallel(plan, world, &shards, SequenceParallelCost::kBlocks).ok());
    expect_valid_split(plan, shards, world);
    expect_balanced(plan, shards, SequenceParallelCost::kBlocks);
  }
  expect_splits_match_unsplit(c, plan, {2, 3}, make_problem(c, 8, 4, 128, 9));
}

// A few-shot tree over 2 GPUs (the plan for 264 SMs, as bench_sequence_parallel builds it): the
// prompt's chunks are cut into contiguous ranges, the 64 branches (short runs, which all start
// after the prompt in KV order) dealt to the least-loaded rank: 32 on each of 2 ranks (over 3
// and 4, the ranks with more of the prompt's chunks may get none). In KV order alone the last
// rank would take them all.
TEST(SequenceParallel, ShortRunsAreDealtToTheLeastLoadedRank) {
  const TreeCase c = testing::few_shot_case(32768, 64, 200, 16, 4);
  AttentionPlan plan;
  ASSERT_TRUE(
      build_attention_plan(c.view, tree_attention_plan_config(32, 8, 128, 264), &plan).ok());
  const int32_t prompt_node = 0;
  ASSERT_EQ(c.view.nodes[prompt_node].num_tokens, 32768);
  for (int32_t world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<AttentionPlan> shards;
    split_long_prefix(plan, world, prompt_node, 32768, &shards);
    if (::testing::Test::HasFatalFailure()) return;
    int32_t branches_total = 0;
    for (int32_t r = 0; r < world; ++r) {
      int32_t branches = 0;
      for (int32_t i = 0; i < shards[r].num_items(); ++i) {
        branches += shards[r].seg_node[shards[r].item_segment_begin[i]] != prompt_node;
      }
      if (world == 2) {
        EXPECT_EQ(branches, 32) << "rank " << r;
      }
      branches_total += branches;
    }
    EXPECT_EQ(branches_total, 64);
  }
}

// pair_heads on a plan the builder left unpaired (P=32k + 64 x 200 for 264 SMs): every shard
// pairs its branches, longest first after its other items, and keeps every item of the plan
// once; the shards of a plan that pairs, or with pair_heads 0, are as without it. Merged on the
// CPU, paired shards give the unsplit plan's states.
TEST(SequenceParallel, ShardsOfAnUnpairedPlanPairTheirBranches) {
  {
    const TreeCase c = testing::few_shot_case(32768, 64, 200, 16, 4);
    const AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 264);
    ASSERT_EQ(config.pair_heads, kTreeAttentionPairHeads);
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
    ASSERT_LE(plan.pair_heads, 1) << "the builder paired this plan: the case tests nothing";
    std::vector<AttentionPlan> shards, unpaired;
    ASSERT_TRUE(split_plan_for_sequence_parallel(plan, 2, &unpaired).ok());
    ASSERT_TRUE(split_plan_for_sequence_parallel(
                    plan, 2, &shards, SequenceParallelCost::kTokensRows, config.pair_heads)
                    .ok());
    std::vector<const AttentionPlan*> ptrs;
    for (int32_t r = 0; r < 2; ++r) {
      const AttentionPlan& s = shards[r];
      ASSERT_TRUE(validate_attention_plan(s).ok()) << "rank " << r;
      ptrs.push_back(&s);
      EXPECT_EQ(s.pair_heads, kTreeAttentionPairHeads) << "rank " << r;
      EXPECT_EQ(s.num_paired_items(), 32) << "rank " << r;  // its 32 branches
      for (int32_t i = 0; i < s.num_items(); ++i) {
        EXPECT_EQ(i >= s.paired_items_begin, s.item_rows(i) <= kDecodeShapedRows)
            << "rank " << r << " item " << i;
      }
      EXPECT_EQ(describe_items({&s}), describe_items({&unpaired[r]})) << "rank " << r;
      EXPECT_EQ(unpaired[r].pair_heads, plan.pair_heads);
    }
    EXPECT_TRUE(describe_items({&plan}) == describe_items(ptrs));
  }
  {  // A plan that pairs: the same shards with or without pair_heads.
    const TreeCase c = testing::few_shot_case(1000, 20, 100, 16, 4);
    AttentionPlan plan;
    ASSERT_TRUE(
        build_attention_plan(c.view, tree_attention_plan_config(32, 8, 128, 32), &plan).ok());
    ASSERT_EQ(plan.pair_heads, kTreeAttentionPairHeads);
    std::vector<AttentionPlan> a, b;
    ASSERT_TRUE(split_plan_for_sequence_parallel(plan, 3, &a).ok());
    ASSERT_TRUE(split_plan_for_sequence_parallel(plan, 3, &b, SequenceParallelCost::kTokensRows,
                                                 kTreeAttentionPairHeads)
                    .ok());
    for (int32_t r = 0; r < 3; ++r) {
      EXPECT_EQ(a[r].paired_items_begin, b[r].paired_items_begin);
      EXPECT_EQ(a[r].item_num_tokens, b[r].item_num_tokens);
    }
  }
  {  // Merged on the CPU: a small few-shot tree whose plan for many SMs does not pair.
    const TreeCase c = testing::few_shot_case(3000, 12, 60, 16, 4);
    AttentionPlan plan;
    ASSERT_TRUE(
        build_attention_plan(c.view, tree_attention_plan_config(32, 8, 64, 1024), &plan).ok());
    ASSERT_LE(plan.pair_heads, 1);
    const Problem p = make_problem(c, 8, 4, 64, 13);
    const int32_t d = p.layout.head_dim;
    const size_t state_elems = size_t(plan.num_queries()) * p.num_q_heads;
    AttentionCpuWorkspace ws;
    std::vector<float> want_o(state_elems * d), want_lse(state_elems);
    ASSERT_TRUE(execute_attention_plan_cpu_state(plan, c.view, p.layout, p.q.data(), p.num_rows,
                                                 p.k.data(), p.v.data(), p.num_q_heads, p.scale,
                                                 want_o.data(), want_lse.data(), &ws)
                    .ok());
    for (int32_t world : {2, 3}) {
      SCOPED_TRACE("world " + std::to_string(world));
      std::vector<AttentionPlan> shards;
      ASSERT_TRUE(split_plan_for_sequence_parallel(plan, world, &shards,
                                                   SequenceParallelCost::kTokensRows,
                                                   kTreeAttentionPairHeads)
                      .ok());
      int32_t paired = 0, narrow = 0;
      for (const AttentionPlan& s : shards) paired += s.num_paired_items();
      for (int32_t i = 0; i < plan.num_items(); ++i)
        narrow += plan.item_rows(i) <= kDecodeShapedRows;
      EXPECT_GT(narrow, 0);
      EXPECT_EQ(paired, narrow);  // the branches' items
      expect_merged_shards_match(c, shards, p, want_o, want_lse);
    }
  }
}

// A 20000-token prompt with decode branches and a speculative token tree below one of them:
// every rank reads one contiguous, disjoint range of the prompt, in rank order, and the prompt's
// pages are divided between the ranks (at most a boundary page shared).
TEST(SequenceParallel, LongPrefixIsCutIntoContiguousRanges) {
  testing::TreeViewBuilder b(16);
  const int32_t prompt = b.add_run(-1, 20000);
  int32_t spec_parent = -1;
  for (int32_t i = 0; i < 6; ++i) {
    const int32_t branch = b.add_run(prompt, 150 + 40 * i);
    b.add_query(branch);
    if (i == 2) spec_parent = branch;
  }
  for (int32_t chain = 0; chain < 2; ++chain) {  // a token tree: two chains of 4 draft tokens
    int32_t parent = spec_parent;
    for (int32_t depth = 0; depth < 4; ++depth) {
      parent = b.add_run(parent, 1);
      b.add_query(parent);
    }
  }
  const TreeCase c = b.build(17);
  AttentionPlanConfig config;
  config.gqa_group_size = 4;
  config.num_sms = 64;
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, config, &plan).ok());
  const int32_t prompt_node = 0;  // the root comes first in preorder
  ASSERT_EQ(c.view.nodes[prompt_node].num_tokens, 20000);
  for (int32_t world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<AttentionPlan> shards;
    split_long_prefix(plan, world, prompt_node, 20000, &shards);
    if (::testing::Test::HasFatalFailure()) return;
    // Page sets: the prompt's ~1250 pages are dealt out, not replicated.
    std::vector<int32_t> pages, all;
    size_t sum = 0;
    for (const AttentionPlan& s : shards) {
      plan_read_pages(s, &pages);
      sum += pages.size();
    }
    plan_read_pages(plan, &all);
    EXPECT_LE(sum, all.size() + size_t(world) * 20) << "pages read by several ranks";
  }
  expect_splits_match_unsplit(c, plan, {2, 3, 4}, make_problem(c, 1, 4, 64, 5));
}

TEST(SequenceParallel, ReadPagesAreTheSegmentsPages) {
  const TreeCase c = testing::few_shot_case(300, 3, 20, 16, 2);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, AttentionPlanConfig{}, &plan).ok());
  std::vector<int32_t> pages;
  plan_read_pages(plan, &pages);
  std::vector<int32_t> want;
  for (const KvNodeRun& n : c.view.nodes) {
    for (int32_t k = 0; k < n.page_count; ++k) want.push_back(c.view.pages[n.page_begin + k]);
  }
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  EXPECT_EQ(pages, want);
}

// sequence_parallel_block_cost: a block's fixed 11 quarter tiles plus 4 a 64-token tile, times
// pair_heads for an unpaired item; a paired item's tiles pair_heads times shorter, its block
// shared. Rows do not count.
TEST(SequenceParallel, BlockCostIsStageOnesBlockModel) {
  const TreeCase c = testing::few_shot_case(1000, 20, 100, 16, 4);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, tree_attention_plan_config(32, 8, 128, 32), &plan).ok());
  ASSERT_EQ(plan.pair_heads, 4);
  ASSERT_GT(plan.paired_items_begin, 0);
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    const int64_t tokens = plan.item_num_tokens[i];
    const int64_t want = i < plan.paired_items_begin ? 4 * (11 + 4 * ((tokens + 63) / 64))
                                                     : 11 + 4 * ((4 * tokens + 63) / 64);
    EXPECT_EQ(sequence_parallel_block_cost(plan, i), want) << "item " << i;
    EXPECT_EQ(sequence_parallel_cost(plan, i, SequenceParallelCost::kBlocks), want);
    EXPECT_EQ(sequence_parallel_cost(plan, i, SequenceParallelCost::kTokensRows),
              sequence_parallel_item_cost(plan, i));
  }
  AttentionPlan unpaired = plan;
  unpaired.pair_heads = 0;
  EXPECT_EQ(sequence_parallel_block_cost(unpaired, plan.num_items() - 1),
            11 + 4 * ((plan.item_num_tokens.back() + 63) / 64));
}

TEST(SequenceParallel, RejectsBadArguments) {
  const TreeCase c = testing::few_shot_case(300, 3, 20, 16, 2);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, AttentionPlanConfig{}, &plan).ok());
  std::vector<AttentionPlan> shards;
  Status s = split_plan_for_sequence_parallel(plan, 0, &shards);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("world"), std::string::npos) << s.ToString();
  s = split_plan_for_sequence_parallel(plan, 2, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  AttentionPlan broken = plan;
  std::swap(broken.merge_partials.front(), broken.merge_partials.back());
  s = split_plan_for_sequence_parallel(broken, 2, &shards);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("merge_partials"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace treeserve
