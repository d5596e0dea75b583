// split_plan_for_sequence_parallel and plan_read_pages (sequence_parallel.h): dealing an
// AttentionPlan's work items out to ranks by KV position, and rebuilding each rank's share as a
// plan of its own (segments, masks, partial slots renumbered; reduction map over all queries).
#include "kernels/sequence_parallel.h"

#include <algorithm>
#include <string>

namespace treeserve {
namespace {

// Where an item starts in the view: its first segment's (node, token offset), as one key.
int64_t start_key(const AttentionPlan& plan, int32_t item) {
  const int32_t g = plan.item_segment_begin[item];
  return (int64_t(plan.seg_node[g]) << 32) | uint32_t(plan.seg_token_begin[g]);
}

void clear_items(AttentionPlan* p) {
  for (std::vector<int32_t>* v :
       {&p->item_segment_begin, &p->item_segment_end, &p->item_query_begin, &p->item_query_end,
        &p->item_num_tokens, &p->item_mask_offset, &p->seg_page_begin, &p->seg_first_slot,
        &p->seg_num_tokens, &p->seg_node, &p->seg_token_begin, &p->item_queries, &p->merge_partials,
        &p->query_merge_begin}) {
    v->clear();
  }
  p->mask_words.clear();
}

// Appends item i of plan to shard: its segments, partials (renumbered; new_slot[p] records the
// shard slot of plan partial p) and mask words.
void append_item(const AttentionPlan& plan, int32_t i, AttentionPlan* shard,
                 std::vector<int32_t>* new_slot) {
  shard->item_segment_begin.push_back(shard->num_segments());
  for (int32_t g = plan.item_segment_begin[i]; g < plan.item_segment_end[i]; ++g) {
    shard->seg_page_begin.push_back(plan.seg_page_begin[g]);
    shard->seg_first_slot.push_back(plan.seg_first_slot[g]);
    shard->seg_num_tokens.push_back(plan.seg_num_tokens[g]);
    shard->seg_node.push_back(plan.seg_node[g]);
    shard->seg_token_begin.push_back(plan.seg_token_begin[g]);
  }
  shard->item_segment_end.push_back(shard->num_segments());
  shard->item_query_begin.push_back(shard->num_partials());
  for (int32_t p = plan.item_query_begin[i]; p < plan.item_query_end[i]; ++p) {
    (*new_slot)[p] = shard->num_partials();
    shard->item_queries.push_back(plan.item_queries[p]);
  }
  shard->item_query_end.push_back(shard->num_partials());
  shard->item_num_tokens.push_back(plan.item_num_tokens[i]);
  shard->max_item_tokens = std::max(shard->max_item_tokens, plan.item_num_tokens[i]);
  const int32_t mask = plan.item_mask_offset[i];
  if (mask < 0) {
    shard->item_mask_offset.push_back(-1);
    return;
  }
  shard->item_mask_offset.push_back(int32_t(shard->mask_words.size()));
  const int64_t words = int64_t(plan.item_query_end[i] - plan.item_query_begin[i]) *
                        AttentionPlan::mask_words_per_row(plan.item_num_tokens[i]);
  shard->mask_words.insert(shard->mask_words.end(), plan.mask_words.begin() + mask,
                           plan.mask_words.begin() + mask + words);
}

}  // namespace

int64_t sequence_parallel_item_cost(const AttentionPlan& plan, int32_t i) {
  const int64_t rows = plan.item_rows(i);
  const int64_t tile_rows = int64_t(plan.queries_per_tile) * plan.gqa_group_size;
  return int64_t(plan.item_num_tokens[i]) * (tile_rows + rows);
}

int64_t sequence_parallel_block_cost(const AttentionPlan& plan, int32_t i) {
  const int64_t pair = std::max(1, plan.pair_heads);
  const int64_t tokens = plan.item_num_tokens[i];
  if (pair > 1 && i >= plan.paired_items_begin) {
    return kBlockFixedQuarterTiles +
           4 * ((tokens * pair + kSequenceParallelKvTile - 1) / kSequenceParallelKvTile);
  }
  return pair * (kBlockFixedQuarterTiles +
                 4 * ((tokens + kSequenceParallelKvTile - 1) / kSequenceParallelKvTile));
}

int64_t sequence_parallel_cost(const AttentionPlan& plan, int32_t i, SequenceParallelCost cost) {
  return cost == SequenceParallelCost::kBlocks ? sequence_parallel_block_cost(plan, i)
                                               : sequence_parallel_item_cost(plan, i);
}

Status split_plan_for_sequence_parallel(const AttentionPlan& plan, int32_t world,
                                        std::vector<AttentionPlan>* shards,
                                        SequenceParallelCost cost, int32_t pair_heads) {
  if (world < 1) {
    return InvalidArgument("split_plan_for_sequence_parallel: world = " + std::to_string(world) +
                           " must be >= 1");
  }
  if (shards == nullptr) return InvalidArgument("split_plan_for_sequence_parallel: shards is null");
  TS_RETURN_IF_ERROR(validate_attention_plan(plan));
  const int32_t num_items = plan.num_items();

  // Items in KV order (stable: a chunk's query tiles keep their plan order).
  std::vector<int32_t> order(num_items);
  std::vector<int64_t> key(num_items);
  for (int32_t i = 0; i < num_items; ++i) {
    order[i] = i;
    key[i] = start_key(plan, i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key[a] < key[b]; });

  // Groups: runs of order with one start key (a chunk's query tiles, or one short run's items).
  // A group is part of a long run where its node starts more than one group (the plan cut the
  // run into chunks); the others are short runs (decode branches, token trees).
  std::vector<int32_t> group_at;  // group g is order[group_at[g], group_at[g + 1])
  for (int32_t k = 0; k < num_items; ++k) {
    if (k == 0 || key[order[k]] != key[order[k - 1]]) group_at.push_back(k);
  }
  group_at.push_back(num_items);
  const int32_t num_groups = int32_t(group_at.size()) - 1;
  std::vector<int64_t> group_cost(size_t(num_groups), 0);
  std::vector<uint8_t> long_group(size_t(num_groups), 0);
  for (int32_t g = 0; g < num_groups; ++g) {
    for (int32_t k = group_at[g]; k < group_at[g + 1]; ++k) {
      group_cost[g] += sequence_parallel_cost(plan, order[k], cost);
    }
    const int64_t node = key[order[group_at[g]]] >> 32;
    const bool same_prev = g > 0 && (key[order[group_at[g - 1]]] >> 32) == node;
    const bool same_next = g + 1 < num_groups && (key[order[group_at[g + 1]]] >> 32) == node;
    long_group[g] = same_prev || same_next;  // a node's groups are adjacent in KV order
  }

  // The long runs' groups, in KV order, are cut into world contiguous ranges: rank r's range
  // ends at the cut candidate nearest (r + 1) / world of their cost (ties to the earlier one),
  // so each rank reads one contiguous token range of every long run, the ranks in order.
  std::vector<int32_t> rank_of_group(size_t(num_groups), 0);
  std::vector<int64_t> load(size_t(world), 0);
  {
    std::vector<int32_t> longs;
    std::vector<int64_t> cost_before{0};
    for (int32_t g = 0; g < num_groups; ++g) {
      if (!long_group[g]) continue;
      longs.push_back(g);
      cost_before.push_back(cost_before.back() + group_cost[g]);
    }
    const int64_t total = cost_before.back();
    size_t begin = 0;
    for (int32_t r = 0; r < world; ++r) {
      size_t end = longs.size();
      if (r + 1 < world) {
        const double target = double(total) * double(r + 1) / double(world);
        const size_t c = size_t(std::lower_bound(cost_before.begin(), cost_before.end(), target) -
                                cost_before.begin());
        size_t best = std::min(c, cost_before.size() - 1);
        if (c > 0 && target - double(cost_before[c - 1]) <= double(cost_before[best]) - target) {
          best = c - 1;
        }
        end = std::max(begin, best);
      }
      for (size_t j = begin; j < end; ++j) rank_of_group[longs[j]] = r;
      load[r] = cost_before[end] - cost_before[begin];
      begin = end;
    }
  }
  // The short runs' groups, costliest first (KV order among equals), each to the rank with the
  // least cost so far (the lowest on ties): the branches of a few-shot tree, which all start
  // after the prompt, are spread over the ranks instead of all landing on the last.
  {
    std::vector<int32_t> shorts;
    for (int32_t g = 0; g < num_groups; ++g) {
      if (!long_group[g]) shorts.push_back(g);
    }
    std::stable_sort(shorts.begin(), shorts.end(),
                     [&](int32_t a, int32_t b) { return group_cost[a] > group_cost[b]; });
    for (int32_t g : shorts) {
      const int32_t r = int32_t(std::min_element(load.begin(), load.end()) - load.begin());
      rank_of_group[g] = r;
      load[r] += group_cost[g];
    }
  }
  std::vector<int32_t> rank_of(num_items);
  for (int32_t g = 0; g < num_groups; ++g) {
    for (int32_t k = group_at[g]; k < group_at[g + 1]; ++k) rank_of[order[k]] = rank_of_group[g];
  }

  // Each shard: its items in plan order, then the reduction map over every query.
  shards->resize(size_t(world));
  std::vector<int32_t> new_slot(plan.num_partials());
  for (int32_t r = 0; r < world; ++r) {
    AttentionPlan& s = (*shards)[r];
    clear_items(&s);
    s.gqa_group_size = plan.gqa_group_size;
    s.queries_per_tile = plan.queries_per_tile;
    s.page_size = plan.page_size;
    s.heads_first = plan.heads_first;
    // Items keep their plan order, so the plan's paired items (a suffix) stay a suffix of
    // every shard's: the shard pairs as the plan does, from its first item the plan paired.
    s.pair_heads = plan.pair_heads;
    s.paired_items_begin = 0;
    s.max_item_tokens = 0;
    s.page_table.assign(plan.page_table.begin(), plan.page_table.end());
    s.query_rows.assign(plan.query_rows.begin(), plan.query_rows.end());
    // Statistics describe the build the shard was cut from.
    s.num_groups = plan.num_groups;
    s.num_folded_edges = plan.num_folded_edges;
    s.num_packs = plan.num_packs;
    s.split_chunk_tokens = plan.split_chunk_tokens;
    s.decode_chunk_tokens = plan.decode_chunk_tokens;
    s.query_merge_begin.push_back(0);
  }
  std::vector<int32_t> partial_rank(plan.num_partials());
  for (int32_t i = 0; i < num_items; ++i) {
    const int32_t r = rank_of[i];
    if (plan.pair_heads > 1 && i < plan.paired_items_begin) ++(*shards)[r].paired_items_begin;
    append_item(plan, i, &(*shards)[r], &new_slot);
    for (int32_t p = plan.item_query_begin[i]; p < plan.item_query_end[i]; ++p) {
      partial_rank[p] = r;
    }
  }
  for (int32_t q = 0; q < plan.num_queries(); ++q) {
    for (int32_t m = plan.query_merge_begin[q]; m < plan.query_merge_begin[q + 1]; ++m) {
      const int32_t p = plan.merge_partials[m];
      (*shards)[partial_rank[p]].merge_partials.push_back(new_slot[p]);
    }
    for (AttentionPlan& s : *shards)
      s.query_merge_begin.push_back(int32_t(s.merge_partials.size()));
  }
  // A plan the builder left unpaired: each shard pairs its own decode-shaped items.
  if (plan.pair_heads <= 1 && pair_heads > 1) {
    for (AttentionPlan& s : *shards) {
      bool narrow = false;
      for (int32_t i = 0; i < s.num_items() && !narrow; ++i) {
        narrow = s.item_rows(i) <= kDecodeShapedRows;
      }
      if (narrow) pair_decode_items(&s, pair_heads, /*longest_first=*/true);
    }
  }
  return Status::Ok();
}

void plan_read_pages(const AttentionPlan& plan, std::vector<int32_t>* pages) {
  pages->clear();
  for (int32_t g = 0; g < plan.num_segments(); ++g) {
    const int32_t first = plan.seg_first_slot[g];
    const int32_t count = (first + plan.seg_num_tokens[g] + plan.page_size - 1) / plan.page_size;
    for (int32_t k = 0; k < count; ++k) {
      pages->push_back(plan.page_table[plan.seg_page_begin[g] + k]);
    }
  }
  std::sort(pages->begin(), pages->end());
  pages->erase(std::unique(pages->begin(), pages->end()), pages->end());
}

}  // namespace treeserve
