// Validation of an AttentionView against its contract (kernels/attention_view.h): runs in
// DFS preorder with parents first, consistent page spans, query ranges that match the
// queries' leaves. The plan builder relies on all of it; errors name the offending field.
// Also validate_attention_plan: the structural checks of a plan that did not come straight
// from the builder (a sequence-parallel shard), which the executors rely on.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/attention_plan.h"

namespace treeserve {
namespace {

std::string node_field(size_t i, const char* field) {
  return "nodes[" + std::to_string(i) + "]." + field;
}

std::string plan_field(const char* array, int64_t i) {
  return std::string("plan.") + array + "[" + std::to_string(i) + "]";
}

}  // namespace

Status validate_attention_view(const AttentionView& view, int64_t num_pages) {
  AttentionPlanScratch scratch;
  return validate_attention_view(view, num_pages, &scratch);
}

Status validate_attention_view(const AttentionView& view, int64_t num_pages,
                               AttentionPlanScratch* scratch) {
  const int32_t page_size = view.page_size;
  if (page_size <= 0) {
    return InvalidArgument("page_size = " + std::to_string(page_size) + " must be > 0");
  }
  const int32_t num_nodes = int32_t(view.nodes.size());
  const int32_t num_queries = int32_t(view.queries.size());
  const int32_t num_view_pages = int32_t(view.pages.size());

  // Preorder check with a stack of open ancestors: node i's parent must be on the stack.
  std::vector<int32_t>& stack = scratch->stack;
  stack.clear();
  for (int32_t i = 0; i < num_nodes; ++i) {
    const KvNodeRun& n = view.nodes[i];
    if (n.parent >= i) {
      return InvalidArgument(node_field(i, "parent") + " = " + std::to_string(n.parent) +
                             ": parent after child (nodes must be in DFS preorder)");
    }
    if (n.parent < -1) {
      return InvalidArgument(node_field(i, "parent") + " = " + std::to_string(n.parent) +
                             " is out of range");
    }
    while (!stack.empty() && stack.back() != n.parent) stack.pop_back();
    if (n.parent >= 0 && stack.empty()) {
      return InvalidArgument(node_field(i, "parent") + " = " + std::to_string(n.parent) +
                             ": subtree of the parent is not contiguous (not DFS preorder)");
    }
    stack.push_back(i);
    if (n.num_tokens < 1) {
      return InvalidArgument(node_field(i, "num_tokens") + " = " + std::to_string(n.num_tokens) +
                             " must be >= 1");
    }
    if (n.first_slot < 0 || n.first_slot >= page_size) {
      return InvalidArgument(node_field(i, "first_slot") + " = " + std::to_string(n.first_slot) +
                             " is outside [0, page_size)");
    }
    const int64_t want_pages = (int64_t(n.first_slot) + n.num_tokens + page_size - 1) / page_size;
    if (n.page_count != want_pages) {
      return InvalidArgument(node_field(i, "page_count") + " = " + std::to_string(n.page_count) +
                             ", expected " + std::to_string(want_pages));
    }
    if (n.page_begin < 0 || int64_t(n.page_begin) + n.page_count > num_view_pages) {
      return InvalidArgument(node_field(i, "page_begin") + " = " + std::to_string(n.page_begin) +
                             ": page index out of range of pages (size " +
                             std::to_string(num_view_pages) + ")");
    }
    const int32_t want_depth =
        n.parent < 0 ? n.depth_tokens
                     : view.nodes[n.parent].depth_tokens + view.nodes[n.parent].num_tokens;
    if (n.depth_tokens != want_depth || n.depth_tokens < 0) {
      return InvalidArgument(node_field(i, "depth_tokens") + " = " +
                             std::to_string(n.depth_tokens) + ", expected " +
                             std::to_string(want_depth));
    }
  }
  // The pages' range in one branch-free pass; the offending entry is looked up only on error.
  int32_t lowest = 0, highest = 0;
  for (int32_t p = 0; p < num_view_pages; ++p) {
    lowest = std::min(lowest, view.pages[p]);
    highest = std::max(highest, view.pages[p]);
  }
  if (lowest < 0 || (num_pages > 0 && highest >= num_pages)) {
    for (int32_t p = 0; p < num_view_pages; ++p) {
      const int32_t id = view.pages[p];
      if (id < 0 || (num_pages > 0 && id >= num_pages)) {
        return InvalidArgument("pages[" + std::to_string(p) + "] = " + std::to_string(id) +
                               ": page index out of range of the pool (" +
                               std::to_string(num_pages) + " pages)");
      }
    }
  }

  for (int32_t q = 0; q < num_queries; ++q) {
    const AttentionQuery& query = view.queries[q];
    // Built only for an error, not for every query of every valid view.
    auto name = [q] { return "queries[" + std::to_string(q) + "]"; };
    if (query.leaf < 0 || query.leaf >= num_nodes) {
      return InvalidArgument(name() + ".leaf = " + std::to_string(query.leaf) + " is out of range");
    }
    const int32_t leaf_len = view.nodes[query.leaf].num_tokens;
    if (query.leaf_tokens < 1 || query.leaf_tokens > leaf_len) {
      return InvalidArgument(name() + ".leaf_tokens = " + std::to_string(query.leaf_tokens) +
                             " is out of range [1, " + std::to_string(leaf_len) + "]");
    }
    if (query.row < 0) {
      return InvalidArgument(name() + ".row = " + std::to_string(query.row) + " must be >= 0");
    }
    if (q > 0) {
      const AttentionQuery& prev = view.queries[q - 1];
      if (prev.leaf > query.leaf ||
          (prev.leaf == query.leaf && prev.leaf_tokens > query.leaf_tokens)) {
        return InvalidArgument(name() + ": queries are not sorted by (leaf, leaf_tokens)");
      }
    }
  }

  // Query ranges: node i's queries are those whose leaf is in [i, subtree_end(i)).
  std::vector<int32_t>& subtree_end = scratch->subtree_end;
  subtree_end.resize(num_nodes);
  for (int32_t i = 0; i < num_nodes; ++i) subtree_end[i] = i + 1;
  for (int32_t i = num_nodes - 1; i >= 0; --i) {
    const int32_t p = view.nodes[i].parent;
    if (p >= 0 && subtree_end[i] > subtree_end[p]) subtree_end[p] = subtree_end[i];
  }
  // first_query[n] = index of the first query whose leaf >= n.
  std::vector<int32_t>& first_query = scratch->first_query;
  first_query.resize(num_nodes + 1);
  int32_t q = 0;
  for (int32_t n = 0; n <= num_nodes; ++n) {
    while (q < num_queries && view.queries[q].leaf < n) ++q;
    first_query[n] = q;
  }
  for (int32_t i = 0; i < num_nodes; ++i) {
    const KvNodeRun& n = view.nodes[i];
    const int32_t want_begin = first_query[i];
    const int32_t want_end = first_query[subtree_end[i]];
    if (n.query_begin != want_begin || n.query_end != want_end) {
      return InvalidArgument(node_field(i, "query_begin/query_end") + " = [" +
                             std::to_string(n.query_begin) + ", " + std::to_string(n.query_end) +
                             "): query ranges inconsistent with the queries' leaves, expected [" +
                             std::to_string(want_begin) + ", " + std::to_string(want_end) + ")");
    }
  }
  return Status::Ok();
}

Status validate_paired_items(const AttentionPlan& plan) {
  const int64_t num_items = plan.num_items();
  if (plan.paired_items_begin < 0 || plan.paired_items_begin > num_items) {
    return InvalidArgument("plan.paired_items_begin = " + std::to_string(plan.paired_items_begin) +
                           " is outside [0, " + std::to_string(num_items) + "]");
  }
  for (int64_t i = plan.paired_items_begin; i < num_items; ++i) {
    if (plan.item_rows(int32_t(i)) > kDecodeShapedRows) {
      return InvalidArgument(plan_field("item_query_end", i) + ": a paired item with more than " +
                             std::to_string(kDecodeShapedRows) + " query-tile rows");
    }
  }
  return Status::Ok();
}

Status validate_attention_plan(const AttentionPlan& plan, int64_t num_pages) {
  if (plan.gqa_group_size < 1 || plan.queries_per_tile < 1 || plan.page_size < 1) {
    return InvalidArgument("plan.gqa_group_size / queries_per_tile / page_size must be >= 1");
  }
  const int64_t num_items = plan.num_items();
  for (const std::vector<int32_t>* v :
       {&plan.item_segment_begin, &plan.item_segment_end, &plan.item_query_begin,
        &plan.item_query_end, &plan.item_mask_offset}) {
    if (int64_t(v->size()) != num_items) {
      return InvalidArgument("plan: per-item arrays differ in size (item_num_tokens has " +
                             std::to_string(num_items) + ")");
    }
  }
  if (plan.pair_heads > 1) TS_RETURN_IF_ERROR(validate_paired_items(plan));
  const int64_t num_segments = plan.num_segments();
  for (const std::vector<int32_t>* v :
       {&plan.seg_page_begin, &plan.seg_first_slot, &plan.seg_node, &plan.seg_token_begin}) {
    if (int64_t(v->size()) != num_segments) {
      return InvalidArgument("plan: per-segment arrays differ in size (seg_num_tokens has " +
                             std::to_string(num_segments) + ")");
    }
  }
  const int64_t num_view_pages = int64_t(plan.page_table.size());
  for (int64_t p = 0; p < num_view_pages; ++p) {
    const int32_t id = plan.page_table[p];
    if (id < 0 || (num_pages > 0 && id >= num_pages)) {
      return InvalidArgument(plan_field("page_table", p) + " = " + std::to_string(id) +
                             " is outside the pool");
    }
  }
  for (int64_t g = 0; g < num_segments; ++g) {
    const int32_t slot = plan.seg_first_slot[g];
    const int32_t tokens = plan.seg_num_tokens[g];
    if (tokens < 1 || slot < 0 || slot >= plan.page_size || plan.seg_page_begin[g] < 0 ||
        plan.seg_page_begin[g] + (int64_t(slot) + tokens + plan.page_size - 1) / plan.page_size >
            num_view_pages) {
      return InvalidArgument(plan_field("seg_num_tokens", g) +
                             ": empty segment, first slot outside the page, or pages outside "
                             "page_table");
    }
  }
  const int64_t num_partials = plan.num_partials();
  const int64_t num_queries = plan.num_queries();
  std::vector<int32_t> owner(size_t(num_partials), -1);  // item of each partial
  int32_t longest = 0;
  for (int64_t i = 0; i < num_items; ++i) {
    const int32_t seg_begin = plan.item_segment_begin[i], seg_end = plan.item_segment_end[i];
    if (seg_begin < 0 || seg_begin >= seg_end || seg_end > num_segments) {
      return InvalidArgument(plan_field("item_segment_begin", i) + ": segment range [" +
                             std::to_string(seg_begin) + ", " + std::to_string(seg_end) +
                             ") is empty or outside the segments");
    }
    int64_t tokens = 0;
    for (int32_t g = seg_begin; g < seg_end; ++g) tokens += plan.seg_num_tokens[g];
    if (tokens != plan.item_num_tokens[i]) {
      return InvalidArgument(plan_field("item_num_tokens", i) + " = " +
                             std::to_string(plan.item_num_tokens[i]) + ", its segments hold " +
                             std::to_string(tokens));
    }
    longest = std::max(longest, plan.item_num_tokens[i]);
    const int32_t q_begin = plan.item_query_begin[i], q_end = plan.item_query_end[i];
    if (q_begin < 0 || q_begin >= q_end || q_end > num_partials ||
        q_end - q_begin > plan.queries_per_tile) {
      return InvalidArgument(plan_field("item_query_begin", i) + ": partial range [" +
                             std::to_string(q_begin) + ", " + std::to_string(q_end) +
                             ") is empty, outside the partials or over queries_per_tile");
    }
    for (int32_t p = q_begin; p < q_end; ++p) {
      if (owner[size_t(p)] >= 0) {
        return InvalidArgument("plan: partial " + std::to_string(p) + " belongs to items " +
                               std::to_string(owner[size_t(p)]) + " and " + std::to_string(i));
      }
      owner[size_t(p)] = int32_t(i);
    }
    const int32_t mask = plan.item_mask_offset[i];
    const int64_t mask_words =
        int64_t(q_end - q_begin) * AttentionPlan::mask_words_per_row(plan.item_num_tokens[i]);
    if (mask < -1 || (mask >= 0 && mask + mask_words > int64_t(plan.mask_words.size()))) {
      return InvalidArgument(plan_field("item_mask_offset", i) + " = " + std::to_string(mask) +
                             ": mask outside mask_words");
    }
  }
  if (longest > plan.max_item_tokens) {
    return InvalidArgument("plan.max_item_tokens = " + std::to_string(plan.max_item_tokens) +
                           " is below the longest item's " + std::to_string(longest));
  }
  for (int64_t p = 0; p < num_partials; ++p) {
    if (owner[size_t(p)] < 0) {
      return InvalidArgument("plan: partial " + std::to_string(p) + " belongs to no item");
    }
    if (plan.item_queries[p] < 0 || plan.item_queries[p] >= num_queries) {
      return InvalidArgument(plan_field("item_queries", p) + " = " +
                             std::to_string(plan.item_queries[p]) + " is not a query");
    }
  }
  if (int64_t(plan.query_merge_begin.size()) != num_queries + 1 ||
      plan.query_merge_begin.front() != 0 || plan.query_merge_begin.back() != num_partials ||
      int64_t(plan.merge_partials.size()) != num_partials) {
    return InvalidArgument(
        "plan: query_merge_begin must have num_queries + 1 entries from 0 to num_partials, "
        "merge_partials num_partials");
  }
  std::vector<uint8_t> merged(size_t(num_partials), 0);
  for (int64_t q = 0; q < num_queries; ++q) {
    if (plan.query_rows[q] < 0) {
      return InvalidArgument(plan_field("query_rows", q) + " = " +
                             std::to_string(plan.query_rows[q]) + " must be >= 0");
    }
    const int32_t begin = plan.query_merge_begin[q], end = plan.query_merge_begin[q + 1];
    if (begin > end) {
      return InvalidArgument(plan_field("query_merge_begin", q) + ": decreasing offsets");
    }
    for (int32_t m = begin; m < end; ++m) {
      const int32_t p = plan.merge_partials[m];
      if (p < 0 || p >= num_partials || merged[size_t(p)] || plan.item_queries[p] != q) {
        return InvalidArgument(plan_field("merge_partials", m) + " = " + std::to_string(p) +
                               ": not a partial of query " + std::to_string(q) +
                               ", or merged twice");
      }
      merged[size_t(p)] = 1;
    }
  }
  return Status::Ok();
}

}  // namespace treeserve
