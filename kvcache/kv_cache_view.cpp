// KvCache::build_attention_view: the tree of KV runs one step's queries read.
//
// Runs are radix nodes (shared, listed once however many queries see them), branch tails and
// draft tokens. They are collected per query branch (walking up to the first radix node
// already collected), linked into child lists, numbered in DFS preorder, and the query tokens
// are bucket-sorted by their leaf's preorder index so each run's queries are contiguous.
// The view is a forest: the top-level runs under every cache namespace's root the queries
// come from are its roots, so one step mixes namespaces and no run is shared between them.
// All scratch lives in members and the output's vectors are reused.
#include <algorithm>
#include <string>

#include "kvcache/kv_cache.h"

namespace treeserve {

int32_t KvCache::add_view_run(ViewRun run, int32_t parent) {
  const int32_t index = static_cast<int32_t>(view_runs_.size());
  run.parent = parent;
  view_runs_.push_back(run);
  int32_t& last = parent < 0 ? view_root_last_ : view_runs_[parent].last_child;
  if (last < 0) {
    (parent < 0 ? view_root_first_ : view_runs_[parent].first_child) = index;
  } else {
    view_runs_[last].next_sibling = index;
  }
  last = index;
  return index;
}

int32_t KvCache::add_view_path(RadixNode* node) {
  view_path_.clear();
  for (RadixNode* n = node; n->parent != nullptr && n->view_stamp != view_stamp_; n = n->parent) {
    view_path_.push_back(n);
  }
  for (auto it = view_path_.rbegin(); it != view_path_.rend(); ++it) {
    RadixNode* n = *it;
    ViewRun run;
    run.node = n;
    n->view_index = add_view_run(run, n->parent->parent == nullptr ? -1 : n->parent->view_index);
    n->view_stamp = view_stamp_;
  }
  return node->parent == nullptr ? -1 : node->view_index;
}

Status KvCache::build_attention_view(std::span<const ViewQuery> queries, AttentionView* out) {
  const int32_t ps = pool_.page_size();
  out->clear();
  out->page_size = ps;
  ++view_stamp_;
  for (size_t q = 0; q < queries.size(); ++q) {
    StatusOr<Branch*> found = find(queries[q].branch);
    if (!found.ok()) return found.status();
    Branch& b = **found;
    const int32_t n = queries[q].num_tokens;
    if (n < 0 || n > b.length() || n + static_cast<int32_t>(b.draft_tokens.size()) < 1) {
      return InvalidArgument("queries[" + std::to_string(q) + "].num_tokens must be in [" +
                             (b.draft_tokens.empty() ? "1" : "0") + ", " +
                             std::to_string(b.length()) + "], got " + std::to_string(n));
    }
    if (b.view_stamp == view_stamp_) {
      return InvalidArgument("queries[" + std::to_string(q) + "].branch is listed twice");
    }
    b.view_stamp = view_stamp_;
  }

  view_runs_.clear();
  view_tokens_.clear();
  view_root_first_ = view_root_last_ = -1;
  int32_t row = 0;
  for (const ViewQuery& q : queries) {
    Branch& b = *find(q.branch).value();
    const int32_t length = b.length();
    const int32_t base_len = b.base_len();
    int32_t last_run = add_view_path(b.base);  // run holding the branch's last token
    if (length > base_len) {
      ViewRun tail;
      tail.branch = &b;
      tail.branch_id = q.branch;
      last_run = add_view_run(tail, last_run);
    }
    for (int32_t p = length - q.num_tokens; p < length; ++p) {
      if (p >= base_len) {
        view_tokens_.push_back({row++, last_run, p - base_len + 1});
      } else {  // a query inside the shared path (e.g. a fork's last token)
        const RadixNode* n = b.base;
        while (n->start > p) n = n->parent;
        view_tokens_.push_back({row++, n->view_index, p - n->start + 1});
      }
    }
    const int32_t first_draft = static_cast<int32_t>(view_runs_.size());
    for (size_t i = 0; i < b.draft_tokens.size(); ++i) {
      const int32_t parent = b.draft_parents[i];
      ViewRun draft;
      draft.branch = &b;
      draft.branch_id = q.branch;
      draft.draft = static_cast<int32_t>(i);
      draft.depth = parent < 0 ? 0 : view_runs_[first_draft + parent].depth + 1;
      const int32_t run = add_view_run(draft, parent < 0 ? last_run : first_draft + parent);
      view_tokens_.push_back({row++, run, 1});
    }
  }

  // DFS preorder over the child lists, without a stack: climb to the next sibling when done.
  for (int32_t cur = view_root_first_; cur >= 0;) {
    ViewRun& r = view_runs_[cur];
    r.preorder = static_cast<int32_t>(out->nodes.size());
    KvNodeRun run;
    run.parent = r.parent >= 0 ? view_runs_[r.parent].preorder : -1;
    run.page_begin = static_cast<int32_t>(out->pages.size());
    if (r.node != nullptr) {
      run.num_tokens = static_cast<int32_t>(r.node->tokens.size());
      run.depth_tokens = r.node->start;
      run.node_id = r.node->id;
      out->pages.insert(out->pages.end(), r.node->pages.begin(), r.node->pages.end());
    } else if (r.draft < 0) {
      const Branch& b = *r.branch;
      run.num_tokens = b.length() - b.base_len();
      run.depth_tokens = b.base_len();
      run.node_id = r.branch_id;
      const int32_t count = tail_pages_for(b, b.length());
      out->pages.insert(out->pages.end(), b.tail_pages.begin(), b.tail_pages.begin() + count);
    } else {
      const Branch& b = *r.branch;
      const int32_t stored = b.length() + r.draft;
      run.num_tokens = 1;
      run.depth_tokens = b.length() + r.depth;
      run.node_id = -1 - r.draft;
      out->pages.push_back(slot_of(b, stored).page);
      run.first_slot = stored % ps;
    }
    if (r.node != nullptr || r.draft < 0) run.first_slot = run.depth_tokens % ps;
    run.page_count = static_cast<int32_t>(out->pages.size()) - run.page_begin;
    out->nodes.push_back(run);
    if (r.first_child >= 0) {
      cur = r.first_child;
      continue;
    }
    while (cur >= 0 && view_runs_[cur].next_sibling < 0) cur = view_runs_[cur].parent;
    if (cur >= 0) cur = view_runs_[cur].next_sibling;
  }

  // Bucket sort of query tokens by leaf preorder; view_counts_[i] ends as the end of bucket i.
  const int32_t num_nodes = static_cast<int32_t>(out->nodes.size());
  const int32_t num_queries = static_cast<int32_t>(view_tokens_.size());
  view_counts_.assign(num_nodes + 1, 0);
  for (const ViewToken& t : view_tokens_) ++view_counts_[view_runs_[t.run].preorder + 1];
  for (int32_t i = 0; i < num_nodes; ++i) view_counts_[i + 1] += view_counts_[i];
  out->queries.resize(num_queries);
  for (const ViewToken& t : view_tokens_) {
    const int32_t leaf = view_runs_[t.run].preorder;
    out->queries[view_counts_[leaf]++] = {t.row, leaf, t.leaf_tokens};
  }
  auto bucket_begin = [&](int32_t i) { return i == 0 ? 0 : view_counts_[i - 1]; };
  auto by_position = [](const AttentionQuery& a, const AttentionQuery& b) {
    return a.leaf_tokens != b.leaf_tokens ? a.leaf_tokens < b.leaf_tokens : a.row < b.row;
  };
  for (int32_t i = 0; i < num_nodes; ++i) {
    auto first = out->queries.begin() + bucket_begin(i);
    auto last = out->queries.begin() + view_counts_[i];
    if (!std::is_sorted(first, last, by_position)) std::sort(first, last, by_position);
  }

  // Subtree of node i = preorder range [i, subtree_end[i]); its queries are contiguous.
  view_subtree_end_.resize(num_nodes);
  for (int32_t i = 0; i < num_nodes; ++i) view_subtree_end_[i] = i + 1;
  for (int32_t i = num_nodes - 1; i >= 0; --i) {
    const int32_t parent = out->nodes[i].parent;
    if (parent >= 0) {
      view_subtree_end_[parent] = std::max(view_subtree_end_[parent], view_subtree_end_[i]);
    }
  }
  for (int32_t i = 0; i < num_nodes; ++i) {
    out->nodes[i].query_begin = bucket_begin(i);
    out->nodes[i].query_end = bucket_begin(view_subtree_end_[i]);
  }
  return Status::Ok();
}

}  // namespace treeserve
