// build_baseline_plan (tree_attention.h): the schedule of a prefix-unaware sequence server as
// an AttentionPlan. Every query reads its own root-to-leaf path (shared runs once per query),
// split into even KV chunks (flash-decoding's split-KV) so that small batches still fill the
// SMs; one query per item, no masks. Also the byte counts benchmarks put next to timings.
#include <algorithm>
#include <string>

#include "kernels/detail/tree_attention_launch.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Path of query q as (run, visible tokens), root first.
void query_path(const AttentionView& view, int32_t q,
                std::vector<std::pair<int32_t, int32_t>>* path) {
  path->clear();
  const AttentionQuery& query = view.queries[q];
  int32_t visible = query.leaf_tokens;
  for (int32_t n = query.leaf; n >= 0; n = view.nodes[n].parent) {
    path->push_back({n, visible});
    if (view.nodes[n].parent >= 0) visible = view.nodes[view.nodes[n].parent].num_tokens;
  }
  std::reverse(path->begin(), path->end());
}

int64_t path_tokens(const std::vector<std::pair<int32_t, int32_t>>& path) {
  int64_t total = 0;
  for (const auto& [run, visible] : path) total += visible;
  return total;
}

}  // namespace

AttentionPlanConfig tree_attention_plan_config(int32_t num_q_heads, int32_t num_kv_heads,
                                               int32_t head_dim, int32_t num_sms) {
  AttentionPlanConfig c;
  c.query_tile_rows = kTreeAttentionTileRows;
  c.kv_tile_tokens = 64;
  c.kv_chunk_tokens = 512;
  c.gqa_group_size = std::max(1, num_q_heads / std::max(1, num_kv_heads));
  c.head_dim = head_dim;
  c.num_sms = std::max(1, 2 * num_sms / std::max(1, num_kv_heads));
  c.min_split_tokens = 128;
  c.max_chunk_tokens = 4 * c.kv_chunk_tokens;  // chunk growth (AttentionPlanConfig)
  c.balance_query_tiles = true;
  // Head pairing where the kv heads come in whole groups of the kernel's pairing, at GQA >= 4,
  // where it pays. At GQA 1 neither a simple rule (pair where the decode-shaped blocks
  // outnumber the slots the wide ones leave) nor the simulation's choice (bench_tree_attention
  // --pair-all) pays: few-shot and tree-of-thought trees run slower paired
  // (docs/tree-attention.md).
  if (num_kv_heads % kTreeAttentionPairHeads == 0 && c.gqa_group_size >= 4) {
    c.pair_heads = kTreeAttentionPairHeads;
  }
  return c;
}

Status build_baseline_plan(const AttentionView& view, const AttentionPlanConfig& config,
                           AttentionPlan* out) {
  if (out == nullptr) return InvalidArgument("build_baseline_plan: out is null");
  if (config.kv_tile_tokens < 1 || config.kv_chunk_tokens < config.kv_tile_tokens) {
    return InvalidArgument("AttentionPlanConfig: need 1 <= kv_tile_tokens <= kv_chunk_tokens");
  }
  TS_RETURN_IF_ERROR(validate_attention_view(view, config.num_pages));
  AttentionPlan& p = *out;
  p = AttentionPlan{};
  p.gqa_group_size = config.gqa_group_size;
  p.queries_per_tile = 1;
  p.heads_first = false;  // see AttentionPlan::heads_first: keeps a chunk's queries together
  p.page_size = view.page_size;
  p.page_table.assign(view.pages.begin(), view.pages.end());
  const int32_t nq = int32_t(view.queries.size());

  // Split-KV: the largest chunk (in KV tiles) that still gives num_sms items, as a decode
  // kernel picks its number of splits from the batch size.
  std::vector<std::pair<int32_t, int32_t>> path;
  std::vector<int64_t> lengths(nq);
  for (int32_t q = 0; q < nq; ++q) {
    query_path(view, q, &path);
    lengths[q] = path_tokens(path);
  }
  const int32_t tile = config.kv_tile_tokens;
  const int32_t min_tiles =
      std::max<int32_t>(1, int32_t(ceil_div(std::max(1, config.min_split_tokens), tile)));
  int32_t tiles = config.kv_chunk_tokens / tile;
  auto count_items = [&](int32_t chunk_tiles) {
    int64_t n = 0;
    for (int64_t len : lengths) n += ceil_div(len, int64_t(chunk_tiles) * tile);
    return n;
  };
  while (tiles > min_tiles && count_items(tiles) < config.num_sms)
    tiles = std::max(min_tiles, tiles / 2);
  const int64_t chunk = int64_t(tiles) * tile;
  p.split_chunk_tokens = int32_t(chunk);
  p.decode_chunk_tokens = int32_t(chunk);

  for (int32_t q = 0; q < nq; ++q) {
    query_path(view, q, &path);
    const int64_t total = lengths[q];
    const int64_t num_chunks = ceil_div(total, chunk);
    const int64_t per = ceil_div(ceil_div(total, num_chunks), tile) * tile;
    size_t run = 0;
    int32_t run_offset = 0;
    for (int64_t begin = 0; begin < total; begin += per) {
      const int32_t chunk_tokens = int32_t(std::min<int64_t>(per, total - begin));
      p.item_segment_begin.push_back(p.num_segments());
      for (int32_t need = chunk_tokens; need > 0;) {
        const auto [n, visible] = path[run];
        const KvNodeRun& node = view.nodes[n];
        const int32_t take = std::min(need, visible - run_offset);
        const int32_t slot = node.first_slot + run_offset;
        p.seg_page_begin.push_back(node.page_begin + slot / view.page_size);
        p.seg_first_slot.push_back(slot % view.page_size);
        p.seg_num_tokens.push_back(take);
        p.seg_node.push_back(n);
        p.seg_token_begin.push_back(run_offset);
        need -= take;
        run_offset += take;
        if (run_offset == visible) {
          ++run;
          run_offset = 0;
        }
      }
      p.item_segment_end.push_back(p.num_segments());
      p.item_query_begin.push_back(p.num_partials());
      p.item_queries.push_back(q);
      p.item_query_end.push_back(p.num_partials());
      p.item_num_tokens.push_back(chunk_tokens);
      p.item_mask_offset.push_back(-1);
      p.max_item_tokens = std::max(p.max_item_tokens, chunk_tokens);
    }
  }
  // Items are in query order, so each query's partials are contiguous.
  p.query_merge_begin.assign(nq + 1, 0);
  for (int32_t q : p.item_queries) ++p.query_merge_begin[q + 1];
  for (int32_t q = 0; q < nq; ++q) p.query_merge_begin[q + 1] += p.query_merge_begin[q];
  p.merge_partials.resize(p.item_queries.size());
  for (int32_t i = 0; i < p.num_partials(); ++i) p.merge_partials[i] = i;
  p.query_rows.resize(nq);
  for (int32_t q = 0; q < nq; ++q) p.query_rows[q] = view.queries[q].row;
  p.num_groups = nq;
  return Status::Ok();
}

int64_t plan_kv_bytes(const AttentionPlan& plan, int32_t num_kv_heads, int32_t head_dim,
                      int32_t dtype_bytes) {
  int64_t tokens = 0;
  for (int32_t n : plan.item_num_tokens) tokens += n;
  return tokens * num_kv_heads * head_dim * 2 * dtype_bytes;
}

int64_t view_unique_kv_bytes(const AttentionView& view, int32_t num_kv_heads, int32_t head_dim,
                             int32_t dtype_bytes) {
  // A run token is read if some query sees it: all of a run with queries below it, except
  // that a leaf run's tail past its longest leaf_tokens is read by nobody.
  std::vector<int32_t> needed(view.nodes.size(), 0);
  for (const AttentionQuery& q : view.queries) {
    needed[q.leaf] = std::max(needed[q.leaf], q.leaf_tokens);
  }
  for (int32_t n = int32_t(view.nodes.size()) - 1; n >= 0; --n) {
    const int32_t parent = view.nodes[n].parent;
    if (parent >= 0 && needed[n] > 0) needed[parent] = view.nodes[parent].num_tokens;
  }
  int64_t tokens = 0;
  for (int32_t n : needed) tokens += n;
  return tokens * num_kv_heads * head_dim * 2 * dtype_bytes;
}

}  // namespace treeserve
