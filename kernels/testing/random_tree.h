// Builders of AttentionViews for tests and benchmarks: a generic builder from a tree given in
// any parent-first order (it produces the contract's preorder, query order, query ranges and
// a shuffled page assignment), random trees mixing decode, causal prefill chunks and
// speculative token trees, and the benchmark workload shapes (FastTree N/C trees, few-shot
// prompting, Medusa-like speculative token trees over a long prefix).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/attention_view.h"

namespace treeserve::testing {

// A view plus what a test needs to allocate for it.
struct TreeCase {
  AttentionView view;
  int64_t num_pages = 0;  // pool pages the view's page ids fit in
  int32_t num_rows = 0;   // batch rows the queries' rows fit in
};

class TreeViewBuilder {
 public:
  explicit TreeViewBuilder(int32_t page_size) : page_size_(page_size) {}

  // Adds a run under parent (-1 = root; parent must already exist). Returns its handle.
  int32_t add_run(int32_t parent, int32_t num_tokens);
  // Adds a query at run; leaf_tokens <= 0 means the whole run (decode).
  void add_query(int32_t run, int32_t leaf_tokens = 0);
  int32_t num_runs() const { return int32_t(parents_.size()); }
  int32_t run_tokens(int32_t run) const { return tokens_[run]; }

  // Orders runs in DFS preorder (children in insertion order), sorts queries, fills query
  // ranges and depths. seed != 0: rows are a random permutation, runs start at random slots,
  // physical pages are shuffled with unused pages between them. seed == 0: rows in query
  // order, first_slot = 0, pages in order.
  TreeCase build(uint64_t seed) const;

 private:
  int32_t page_size_;
  std::vector<int32_t> parents_, tokens_;
  std::vector<std::vector<int32_t>> children_;
  std::vector<std::pair<int32_t, int32_t>> queries_;  // (run handle, leaf_tokens)
};

struct RandomTreeOptions {
  int32_t depth = 3;      // levels of runs (1 = a single root run)
  int32_t max_width = 4;  // children per internal run, drawn in [1, max_width]
  int32_t max_runs = 64;  // stop growing once the tree has this many runs
  int32_t min_run_tokens = 1;
  int32_t max_run_tokens = 64;
  int32_t root_tokens = 0;  // > 0: fixed length of the root run (a long shared prefix)
  int32_t page_size = 16;
  double prefill_prob = 0.0;      // leaf gets a causal prefill chunk (queries j see j + 1 ...)
  double speculative_prob = 0.0;  // leaf gets a token tree of one-token runs, one query each
  int32_t max_speculative_tokens = 12;
  double internal_query_prob = 0.0;  // internal run also has a query (partial visibility)
  double dead_leaf_prob = 0.0;       // leaf without queries (a run nobody reads this step)
};

TreeCase random_tree_case(uint64_t seed, const RandomTreeOptions& options);

// Re-lays a case's runs out as the server's KV cache does (kvcache/kv_cache_view.cpp): each
// run's first token at slot depth_tokens % page_size, so a page holds the same positions in
// every branch. Pages are reassigned as build() does with `seed` (shuffled, about one unused
// page per four used ones).
void place_runs_at_depth_slots(TreeCase* c, uint64_t seed);

// Reassigns a case's physical pages as a fresh server's page pool hands them out while the
// tree grows token by token from an empty pool: ids 0, 1, 2, ... in the order the pages'
// first tokens are written (their sequence position, then run preorder), so a prefilled
// prompt's pages are contiguous and branches decoded side by side interleave theirs. A run's
// first page, when it starts mid-page, is its own (the builders do not share boundary pages).
void place_pages_as_fresh_pool(TreeCase* c);

// FastTree kernel shapes: level i has nodes_per_level[i] runs of tokens_per_level[i] tokens,
// spread evenly under the previous level; one decode query per leaf.
TreeCase fasttree_case(const std::vector<int32_t>& nodes_per_level,
                       const std::vector<int32_t>& tokens_per_level, int32_t page_size,
                       uint64_t seed);

// Few-shot prompting (DeFT): a prompt_tokens prompt with `branches` branches of
// branch_tokens tokens each, one decode query per branch. branch_tokens 0: the `branches`
// queries sit at the prompt's end with no tokens of their own (a plan of query-tile pairs
// alone at 17+ queries and GQA 4, as a sequence-parallel rank's share of a prompt).
TreeCase few_shot_case(int32_t prompt_tokens, int32_t branches, int32_t branch_tokens,
                       int32_t page_size, uint64_t seed);

// Speculative verification: a prefix_tokens run, then one one-token run per token-tree
// candidate (paths as in the DeFT templates' Tree_Structure: child indices from the root,
// parents listed before children), one query per candidate seeing its path.
TreeCase speculative_case(int32_t prefix_tokens, const std::vector<std::vector<int32_t>>& paths,
                          int32_t page_size, uint64_t seed);

// Medusa-like token tree of `size` candidates (wide near the root, narrow deeper): the
// best-scoring paths when child rank r at depth i scores 0.8^i / (r + 1)^1.3.
std::vector<std::vector<int32_t>> medusa_like_paths(int32_t size);

}  // namespace treeserve::testing
