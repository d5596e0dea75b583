// AttentionView: the KV that one step's queries read, as a tree of node runs over paged
// storage, with every shared run listed once (not once per query).
//
// Produced by kvcache/ (KvCache::build_attention_view), consumed by the attention plan
// builder (kernels/attention_plan.h). Plain C++: no CUDA, no kvcache types, so the plan and
// both executors (CPU and CUDA) can be tested from hand-built views.
//
// Visibility rule: a query sees every token of each ancestor run of its `leaf` run, and the
// first `leaf_tokens` tokens of `leaf` itself. That covers decode (leaf_tokens = the whole
// run), causal prefill of a chunk inside one run (query j sees leaf_tokens = j + 1 ...),
// and speculative token trees (each draft token is its own one-token run; the queries form
// a tree).
#pragma once

#include <cstdint>
#include <vector>

namespace treeserve {

struct KvNodeRun {
  int32_t parent = -1;       // index of the parent run in AttentionView::nodes; -1 = a root
  int32_t num_tokens = 0;    // tokens in this run, >= 1
  int32_t first_slot = 0;    // slot of the run's first token inside its first page, [0, page_size)
  int32_t page_begin = 0;    // index into AttentionView::pages of the run's first page
  int32_t page_count = 0;    // ceil((first_slot + num_tokens) / page_size)
  int32_t depth_tokens = 0;  // tokens in all ancestor runs = sequence position of the first token
  int32_t query_begin = 0;   // queries [query_begin, query_end) of AttentionView::queries see
  int32_t query_end = 0;     //   at least part of this run (those whose leaf is in its subtree)
  int64_t node_id = -1;      // kvcache's id of the radix node or branch tail (diagnostics only)
};

struct AttentionQuery {
  int32_t row = 0;          // the query's row in the engine's batch (its token index)
  int32_t leaf = 0;         // run that holds the query's own position
  int32_t leaf_tokens = 0;  // tokens of `leaf` this query sees, [1, nodes[leaf].num_tokens]
};

struct AttentionView {
  int32_t page_size = 16;
  // Parents before children, in DFS preorder, so each run's subtree is a contiguous range
  // of nodes and (because queries are sorted by their leaf's preorder index) each run's
  // queries are the contiguous range [query_begin, query_end).
  std::vector<KvNodeRun> nodes;
  std::vector<int32_t> pages;           // physical page ids; runs index into this
  std::vector<AttentionQuery> queries;  // sorted by leaf (preorder), then leaf_tokens

  // Token t (0-based within run n) lives at physical page
  //   pages[n.page_begin + (n.first_slot + t) / page_size], slot (n.first_slot + t) % page_size.
  void clear() {
    nodes.clear();
    pages.clear();
    queries.clear();
  }
};

}  // namespace treeserve
