// Helpers shared by the kernel plan tests: expanding a plan into (query, token) coverage
// counts, the structural checks every plan must pass, and random Q/K/V for the executors.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/attention_plan.h"
#include "kernels/attention_view.h"

namespace treeserve::testing {

// Fails the current test (with the first few offending pairs) unless every (query, visible
// token) pair of the view is covered by exactly one (item, unmasked bit) of the plan and no
// invisible pair is; also checks segments against the view's pages and the reduction map.
inline void expect_plan_covers_view(const AttentionPlan& plan, const AttentionView& view,
                                    const AttentionPlanConfig& config) {
  const int32_t num_nodes = int32_t(view.nodes.size());
  std::vector<int64_t> token_base(num_nodes + 1, 0);  // flat token index of each run
  for (int32_t n = 0; n < num_nodes; ++n) {
    token_base[n + 1] = token_base[n] + view.nodes[n].num_tokens;
  }
  const int64_t total = token_base[num_nodes];
  const int32_t nq = int32_t(view.queries.size());
  std::vector<uint8_t> covered(size_t(nq) * total, 0);
  int failures = 0;
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    const int32_t tokens = plan.item_num_tokens[i];
    const int32_t words = AttentionPlan::mask_words_per_row(tokens);
    const int32_t num_item_queries = plan.item_query_end[i] - plan.item_query_begin[i];
    ASSERT_GE(num_item_queries, 1) << "item " << i;
    ASSERT_LE(num_item_queries, plan.queries_per_tile) << "item " << i;
    ASSERT_LE(tokens, std::max(config.kv_chunk_tokens, config.max_chunk_tokens)) << "item " << i;
    int32_t seg_tokens = 0;
    for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
      const KvNodeRun& node = view.nodes[plan.seg_node[g]];
      ASSERT_GE(plan.seg_token_begin[g], 0);
      ASSERT_LE(plan.seg_token_begin[g] + plan.seg_num_tokens[g], node.num_tokens);
      for (int32_t j = 0; j < plan.seg_num_tokens[g]; j += 7) {  // page mapping, sampled
        const int32_t ps = view.page_size;
        const int32_t s_plan = plan.seg_first_slot[g] + j;
        const int32_t s_view = node.first_slot + plan.seg_token_begin[g] + j;
        ASSERT_EQ(plan.page_table[plan.seg_page_begin[g] + s_plan / ps],
                  view.pages[node.page_begin + s_view / ps]);
        ASSERT_EQ(s_plan % ps, s_view % ps);
      }
      seg_tokens += plan.seg_num_tokens[g];
    }
    ASSERT_EQ(seg_tokens, tokens) << "item " << i;
    for (int32_t p = plan.item_query_begin[i]; p < plan.item_query_end[i]; ++p) {
      const int32_t q = plan.item_queries[p];
      const uint32_t* mask = plan.item_mask_offset[i] < 0
                                 ? nullptr
                                 : plan.mask_words.data() + plan.item_mask_offset[i] +
                                       size_t(p - plan.item_query_begin[i]) * words;
      if (mask != nullptr && tokens % 32 != 0) {
        ASSERT_EQ(mask[words - 1] >> (tokens % 32), 0u) << "mask bits past the item's end";
      }
      int32_t t = 0;
      for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
        for (int32_t j = 0; j < plan.seg_num_tokens[g]; ++j, ++t) {
          if (mask != nullptr && !((mask[t >> 5] >> (t & 31)) & 1u)) continue;
          const int64_t flat = token_base[plan.seg_node[g]] + plan.seg_token_begin[g] + j;
          ++covered[size_t(q) * total + flat];
        }
      }
    }
  }
  // Expected visibility: ancestors fully, leaf's first leaf_tokens.
  std::vector<uint8_t> visible(total);
  for (int32_t q = 0; q < nq && failures < 5; ++q) {
    std::fill(visible.begin(), visible.end(), 0);
    const AttentionQuery& query = view.queries[q];
    int32_t count = query.leaf_tokens;
    for (int32_t n = query.leaf; n >= 0; n = view.nodes[n].parent) {
      for (int32_t t = 0; t < count; ++t) visible[token_base[n] + t] = 1;
      if (view.nodes[n].parent >= 0) count = view.nodes[view.nodes[n].parent].num_tokens;
    }
    for (int64_t t = 0; t < total && failures < 5; ++t) {
      const uint8_t got = covered[size_t(q) * total + t];
      if (got != visible[t]) {
        ++failures;
        ADD_FAILURE() << "query " << q << " flat token " << t << ": covered " << int(got)
                      << " times, visible " << int(visible[t]);
      }
    }
  }
  // Reduction map: each partial merged exactly once, into its own query.
  ASSERT_EQ(int32_t(plan.query_merge_begin.size()), nq + 1);
  ASSERT_EQ(plan.query_merge_begin[nq], plan.num_partials());
  std::vector<int32_t> seen(plan.num_partials(), 0);
  for (int32_t q = 0; q < nq; ++q) {
    ASSERT_LT(plan.query_merge_begin[q], plan.query_merge_begin[q + 1]) << "query " << q;
    for (int32_t m = plan.query_merge_begin[q]; m < plan.query_merge_begin[q + 1]; ++m) {
      const int32_t p = plan.merge_partials[m];
      ASSERT_EQ(plan.item_queries[p], q);
      ++seen[p];
    }
    ASSERT_EQ(plan.query_rows[q], view.queries[q].row);
  }
  for (int32_t p = 0; p < plan.num_partials(); ++p) ASSERT_EQ(seen[p], 1) << "partial " << p;
}

inline std::vector<float> random_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

}  // namespace treeserve::testing
