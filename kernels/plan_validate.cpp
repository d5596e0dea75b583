// Validation of an AttentionView against its contract (kernels/attention_view.h): runs in
// DFS preorder with parents first, consistent page spans, query ranges that match the
// queries' leaves. The plan builder relies on all of it; errors name the offending field.
#include <string>

#include "kernels/attention_plan.h"

namespace treeserve {
namespace {

std::string node_field(size_t i, const char* field) {
  return "nodes[" + std::to_string(i) + "]." + field;
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
  for (int32_t p = 0; p < num_view_pages; ++p) {
    const int32_t id = view.pages[p];
    if (id < 0 || (num_pages > 0 && id >= num_pages)) {
      return InvalidArgument("pages[" + std::to_string(p) + "] = " + std::to_string(id) +
                             ": page index out of range of the pool (" + std::to_string(num_pages) +
                             " pages)");
    }
  }

  for (int32_t q = 0; q < num_queries; ++q) {
    const AttentionQuery& query = view.queries[q];
    const std::string name = "queries[" + std::to_string(q) + "]";
    if (query.leaf < 0 || query.leaf >= num_nodes) {
      return InvalidArgument(name + ".leaf = " + std::to_string(query.leaf) + " is out of range");
    }
    const int32_t leaf_len = view.nodes[query.leaf].num_tokens;
    if (query.leaf_tokens < 1 || query.leaf_tokens > leaf_len) {
      return InvalidArgument(name + ".leaf_tokens = " + std::to_string(query.leaf_tokens) +
                             " is out of range [1, " + std::to_string(leaf_len) + "]");
    }
    if (query.row < 0) {
      return InvalidArgument(name + ".row = " + std::to_string(query.row) + " must be >= 0");
    }
    if (q > 0) {
      const AttentionQuery& prev = view.queries[q - 1];
      if (prev.leaf > query.leaf ||
          (prev.leaf == query.leaf && prev.leaf_tokens > query.leaf_tokens)) {
        return InvalidArgument(name + ": queries are not sorted by (leaf, leaf_tokens)");
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

}  // namespace treeserve
