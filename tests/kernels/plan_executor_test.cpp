// The CPU plan executor against naive per-query tree attention, to 1e-5 max abs, over random
// trees (depths 1-10, widths 1-64, runs up to 4000 tokens, GQA 1/4/8, head_dim 64/128, page
// sizes 1/16/64) with decode queries, causal prefill chunks and speculative token trees.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/attention_cpu.h"
#include "kernels/attention_plan.h"
#include "kernels/testing/random_tree.h"
#include "tests/kernels/plan_test_util.h"

namespace treeserve {
namespace {

using testing::TreeCase;

struct RunResult {
  float max_abs_diff = 0.f;
  bool untouched_rows_kept = true;
};

// Runs plan executor and naive reference on random Q/K/V; returns the max abs difference.
RunResult compare(const TreeCase& c, const AttentionPlanConfig& base, int32_t num_kv_heads,
                  int32_t head_dim, uint64_t seed) {
  AttentionPlanConfig config = base;
  config.head_dim = head_dim;
  AttentionPlan plan;
  Status s = build_attention_plan(c.view, config, &plan);
  EXPECT_TRUE(s.ok()) << s.ToString();
  KvLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = num_kv_heads;
  layout.head_dim = head_dim;
  layout.page_size = c.view.page_size;
  layout.num_pages = c.num_pages;
  layout.dtype_bytes = 4;
  const int32_t num_q_heads = num_kv_heads * config.gqa_group_size;
  const int32_t num_rows = c.num_rows + 2;  // two rows no query names: must stay untouched
  const size_t row_elems = size_t(num_q_heads) * head_dim;
  const std::vector<float> q = testing::random_floats(num_rows * row_elems, seed);
  const std::vector<float> k = testing::random_floats(layout.layer_elems(), seed + 1);
  const std::vector<float> v = testing::random_floats(layout.layer_elems(), seed + 2);
  std::vector<float> out_plan(num_rows * row_elems, 7.f), out_ref(num_rows * row_elems, 7.f);
  const float scale = 1.f / std::sqrt(float(head_dim));
  AttentionCpuWorkspace ws;
  s = execute_attention_plan_cpu(plan, c.view, layout, q.data(), num_rows, k.data(), v.data(),
                                 num_q_heads, scale, out_plan.data(), &ws);
  EXPECT_TRUE(s.ok()) << s.ToString();
  s = naive_tree_attention_cpu(c.view, layout, q.data(), num_rows, k.data(), v.data(), num_q_heads,
                               scale, out_ref.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  RunResult r;
  for (size_t i = 0; i < out_plan.size(); ++i) {
    r.max_abs_diff = std::max(r.max_abs_diff, std::fabs(out_plan[i] - out_ref[i]));
  }
  for (size_t i = size_t(c.num_rows) * row_elems; i < out_plan.size(); ++i) {
    r.untouched_rows_kept &= out_plan[i] == 7.f && out_ref[i] == 7.f;
  }
  return r;
}

constexpr float kTolerance = 1e-5f;

TEST(PlanExecutor, RandomTreesMatchNaive) {
  for (uint64_t seed = 1; seed <= 48; ++seed) {
    testing::RandomTreeOptions o;
    o.depth = 1 + int32_t(seed % 10);
    o.max_width = std::vector<int32_t>{1, 3, 8, 64}[seed % 4];
    o.max_runs = 48;
    o.max_run_tokens = std::vector<int32_t>{4, 60, 300}[(seed / 4) % 3];
    o.page_size = std::vector<int32_t>{1, 16, 64}[seed % 3];
    o.prefill_prob = 0.2;
    o.speculative_prob = 0.3;
    o.internal_query_prob = 0.15;
    o.dead_leaf_prob = 0.05;
    const TreeCase c = testing::random_tree_case(seed * 7919, o);
    AttentionPlanConfig config;
    config.gqa_group_size = std::vector<int32_t>{1, 4, 8}[seed % 3];
    config.query_tile_rows = seed % 2 ? 64 : 16;
    config.kv_tile_tokens = 16;
    config.kv_chunk_tokens = seed % 2 ? 128 : 64;
    config.min_split_tokens = 16;
    config.pack_max_tokens = 64;
    config.num_sms = 16;
    config.greedy_grouping = seed % 5 != 0;
    config.item_order = AttentionPlanConfig::ItemOrder(seed % 4);
    config.balance_query_tiles = seed % 3 == 1;
    const int32_t head_dim = seed % 2 ? 64 : 128;
    const RunResult r = compare(c, config, seed % 4 == 0 ? 2 : 1, head_dim, seed);
    EXPECT_LE(r.max_abs_diff, kTolerance) << "seed " << seed;
    EXPECT_TRUE(r.untouched_rows_kept) << "seed " << seed;
  }
}

TEST(PlanExecutor, LongRunsAndWorkloadShapesMatchNaive) {
  struct Case {
    std::string name;
    TreeCase tree;
    int32_t gqa;
    int32_t head_dim;
  };
  std::vector<Case> cases;
  cases.push_back({"few-shot 4000+20x200", testing::few_shot_case(4000, 20, 200, 16, 1), 4, 128});
  cases.push_back(
      {"fasttree 1,10 4000,400", testing::fasttree_case({1, 10}, {4000, 400}, 64, 2), 1, 64});
  cases.push_back({"fasttree 1,2,4,8",
                   testing::fasttree_case({1, 2, 4, 8}, {512, 128, 128, 128}, 1, 3), 8, 64});
  cases.push_back({"speculative 64 over 4000",
                   testing::speculative_case(4000, testing::medusa_like_paths(63), 16, 4), 4, 128});
  testing::TreeViewBuilder prefill(16);  // causal prefill chunk of 40 under a long prefix
  const int32_t leaf = prefill.add_run(prefill.add_run(-1, 3000), 200);
  for (int32_t j = 0; j < 40; ++j) prefill.add_query(leaf, 160 + j + 1);
  cases.push_back({"prefill chunk", prefill.build(5), 8, 128});
  testing::TreeViewBuilder single(16);  // long-context splitting: 1 query over 16k
  single.add_query(single.add_run(-1, 16384));
  cases.push_back({"1 query x 16k", single.build(6), 1, 64});
  for (const Case& c : cases) {
    AttentionPlanConfig config;
    config.gqa_group_size = c.gqa;
    const RunResult r = compare(c.tree, config, 1, c.head_dim, 11);
    EXPECT_LE(r.max_abs_diff, kTolerance) << c.name;
    EXPECT_TRUE(r.untouched_rows_kept) << c.name;
  }
}

TEST(PlanExecutor, MergeStateIsOrderFreeLogSumExp) {
  // Merging (o1, lse1) and (o2, lse2) equals attention over the union of their tokens.
  float o1[2] = {1.f, 0.f}, lse1 = std::log(2.f);
  const float o2[2] = {0.f, 1.f}, lse2 = std::log(6.f);
  merge_attention_state(o1, &lse1, o2, lse2, 2);
  EXPECT_NEAR(o1[0], 0.25f, 1e-6f);
  EXPECT_NEAR(o1[1], 0.75f, 1e-6f);
  EXPECT_NEAR(lse1, std::log(8.f), 1e-6f);
  float o3[2] = {0.5f, 0.5f}, lse3 = -INFINITY;  // an empty partial is neutral
  merge_attention_state(o3, &lse3, o2, lse2, 2);
  EXPECT_NEAR(o3[1], 1.f, 1e-6f);
}

TEST(PlanExecutor, RejectsMismatchedInputs) {
  const TreeCase c = testing::few_shot_case(64, 2, 8, 16, 1);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(c.view, AttentionPlanConfig{}, &plan).ok());
  KvLayout layout;
  layout.num_kv_heads = 1;
  layout.head_dim = 8;
  layout.page_size = 32;  // differs from the view's 16
  layout.num_pages = c.num_pages;
  std::vector<float> buf(1 << 16);
  AttentionCpuWorkspace ws;
  Status s = execute_attention_plan_cpu(plan, c.view, layout, buf.data(), c.num_rows, buf.data(),
                                        buf.data(), 1, 1.f, buf.data(), &ws);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  layout.page_size = 16;
  s = execute_attention_plan_cpu(plan, c.view, layout, buf.data(), 1, buf.data(), buf.data(), 1,
                                 1.f, buf.data(), &ws);
  EXPECT_NE(s.message().find("row"), std::string::npos) << s.ToString();
}

}  // namespace
}  // namespace treeserve
