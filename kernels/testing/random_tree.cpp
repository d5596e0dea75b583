// Builders of AttentionViews for tests and benchmarks (see random_tree.h).
#include "kernels/testing/random_tree.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <queue>
#include <tuple>

namespace treeserve::testing {

int32_t TreeViewBuilder::add_run(int32_t parent, int32_t num_tokens) {
  const int32_t id = int32_t(parents_.size());
  parents_.push_back(parent);
  tokens_.push_back(num_tokens);
  children_.emplace_back();
  if (parent >= 0) children_[parent].push_back(id);
  return id;
}

void TreeViewBuilder::add_query(int32_t run, int32_t leaf_tokens) {
  queries_.emplace_back(run, leaf_tokens <= 0 ? tokens_[run] : leaf_tokens);
}

namespace {

// Given each run's first_slot: its page span (page_begin, page_count), then physical page ids
// for all of them from a pool with about one unused page per four used ones, shuffled by rng
// (null: ids in order, no unused pages). Returns the pool's size.
int64_t assign_pages(AttentionView* view, std::mt19937_64* rng) {
  const int32_t ps = view->page_size;
  int32_t total_pages = 0;
  for (KvNodeRun& node : view->nodes) {
    node.page_begin = total_pages;
    node.page_count = (node.first_slot + node.num_tokens + ps - 1) / ps;
    total_pages += node.page_count;
  }
  std::vector<int32_t> pool(total_pages + (rng == nullptr ? 0 : total_pages / 4 + 1));
  std::iota(pool.begin(), pool.end(), 0);
  if (rng != nullptr) std::shuffle(pool.begin(), pool.end(), *rng);
  view->pages.assign(pool.begin(), pool.begin() + total_pages);
  return int64_t(pool.size());
}

}  // namespace

TreeCase TreeViewBuilder::build(uint64_t seed) const {
  std::mt19937_64 rng(seed);
  const int32_t n = num_runs();
  // DFS preorder; children pushed in reverse so they pop in insertion order.
  std::vector<int32_t> order, index_of(n), stack;
  for (int32_t r = n - 1; r >= 0; --r) {
    if (parents_[r] < 0) stack.push_back(r);
  }
  while (!stack.empty()) {
    const int32_t r = stack.back();
    stack.pop_back();
    index_of[r] = int32_t(order.size());
    order.push_back(r);
    for (auto it = children_[r].rbegin(); it != children_[r].rend(); ++it) stack.push_back(*it);
  }

  TreeCase out;
  AttentionView& view = out.view;
  view.page_size = page_size_;
  view.nodes.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t r = order[i];
    KvNodeRun& node = view.nodes[i];
    node.parent = parents_[r] < 0 ? -1 : index_of[parents_[r]];
    node.num_tokens = tokens_[r];
    node.first_slot = seed == 0 ? 0 : int32_t(rng() % uint64_t(page_size_));
    node.depth_tokens =
        node.parent < 0 ? 0
                        : view.nodes[node.parent].depth_tokens + view.nodes[node.parent].num_tokens;
    node.node_id = r;
  }
  out.num_pages = assign_pages(&view, seed == 0 ? nullptr : &rng);

  for (const auto& [run, leaf_tokens] : queries_) {
    view.queries.push_back({0, index_of[run], leaf_tokens});
  }
  std::sort(view.queries.begin(), view.queries.end(), [](const auto& a, const auto& b) {
    return a.leaf != b.leaf ? a.leaf < b.leaf : a.leaf_tokens < b.leaf_tokens;
  });
  const int32_t nq = int32_t(view.queries.size());
  std::vector<int32_t> rows(nq);
  std::iota(rows.begin(), rows.end(), 0);
  if (seed != 0) std::shuffle(rows.begin(), rows.end(), rng);
  for (int32_t q = 0; q < nq; ++q) view.queries[q].row = rows[q];
  out.num_rows = nq;

  // Query ranges: subtree of i is [i, subtree_end) in preorder.
  std::vector<int32_t> subtree_end(n);
  for (int32_t i = 0; i < n; ++i) subtree_end[i] = i + 1;
  for (int32_t i = n - 1; i >= 0; --i) {
    const int32_t p = view.nodes[i].parent;
    if (p >= 0) subtree_end[p] = std::max(subtree_end[p], subtree_end[i]);
  }
  auto first_query_at_or_after = [&](int32_t node) {
    return int32_t(std::lower_bound(view.queries.begin(), view.queries.end(), node,
                                    [](const AttentionQuery& q, int32_t v) { return q.leaf < v; }) -
                   view.queries.begin());
  };
  for (int32_t i = 0; i < n; ++i) {
    view.nodes[i].query_begin = first_query_at_or_after(i);
    view.nodes[i].query_end = first_query_at_or_after(subtree_end[i]);
  }
  return out;
}

void place_runs_at_depth_slots(TreeCase* c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (KvNodeRun& node : c->view.nodes) node.first_slot = node.depth_tokens % c->view.page_size;
  c->num_pages = assign_pages(&c->view, &rng);
}

void place_pages_as_fresh_pool(TreeCase* c) {
  AttentionView& view = c->view;
  const int32_t ps = view.page_size;
  // (position of the page's first token, run, page index in the run) for every logical page.
  std::vector<std::tuple<int64_t, int32_t, int32_t>> order;
  order.reserve(view.pages.size());
  for (int32_t n = 0; n < int32_t(view.nodes.size()); ++n) {
    const KvNodeRun& run = view.nodes[n];
    for (int32_t k = 0; k < run.page_count; ++k) {
      const int64_t first_token = k == 0 ? 0 : int64_t(k) * ps - run.first_slot;
      order.emplace_back(run.depth_tokens + first_token, n, k);
    }
  }
  std::sort(order.begin(), order.end());
  int32_t next = 0;
  for (const auto& [position, n, k] : order) view.pages[view.nodes[n].page_begin + k] = next++;
  c->num_pages = next;
}

TreeCase random_tree_case(uint64_t seed, const RandomTreeOptions& o) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](int32_t lo, int32_t hi) {
    return lo + int32_t(rng() % uint64_t(std::max(1, hi - lo + 1)));
  };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  TreeViewBuilder b(o.page_size);
  const int32_t root_len =
      o.root_tokens > 0 ? o.root_tokens : uniform(o.min_run_tokens, o.max_run_tokens);
  std::vector<int32_t> level{b.add_run(-1, root_len)};
  std::vector<int32_t> leaves, internal;
  for (int32_t d = 1; d < o.depth && !level.empty(); ++d) {
    std::vector<int32_t> next;
    for (int32_t r : level) {
      const int32_t width = b.num_runs() >= o.max_runs ? 0 : uniform(1, o.max_width);
      if (width == 0) leaves.push_back(r);
      for (int32_t c = 0; c < width && b.num_runs() < o.max_runs; ++c) {
        next.push_back(b.add_run(r, uniform(o.min_run_tokens, o.max_run_tokens)));
      }
      if (width > 0) internal.push_back(r);
    }
    level = std::move(next);
  }
  leaves.insert(leaves.end(), level.begin(), level.end());
  for (int32_t r : internal) {
    if (chance(o.internal_query_prob)) b.add_query(r, uniform(1, b.run_tokens(r)));
  }
  for (int32_t leaf : leaves) {
    if (chance(o.dead_leaf_prob) && leaf != 0) continue;
    if (chance(o.prefill_prob)) {
      // The last `chunk` tokens of the leaf are being prefilled: query j sees up to itself.
      const int32_t len = b.run_tokens(leaf);
      const int32_t chunk = uniform(1, std::min(len, 24));
      for (int32_t j = 0; j < chunk; ++j) b.add_query(leaf, len - chunk + j + 1);
    } else if (chance(o.speculative_prob)) {
      b.add_query(leaf);
      const int32_t size = uniform(1, o.max_speculative_tokens);
      std::vector<int32_t> nodes{leaf};
      for (int32_t t = 0; t < size; ++t) {
        // Earlier candidates are likelier parents: wide near the root, narrow deeper.
        const int32_t parent = nodes[uniform(0, int32_t(nodes.size()) - 1) / 2];
        const int32_t run = b.add_run(parent, 1);
        b.add_query(run);
        nodes.push_back(run);
      }
    } else {
      b.add_query(leaf);
    }
  }
  return b.build(seed);
}

TreeCase fasttree_case(const std::vector<int32_t>& nodes_per_level,
                       const std::vector<int32_t>& tokens_per_level, int32_t page_size,
                       uint64_t seed) {
  TreeViewBuilder b(page_size);
  std::vector<int32_t> level;
  for (size_t l = 0; l < nodes_per_level.size(); ++l) {
    std::vector<int32_t> next;
    for (int32_t i = 0; i < nodes_per_level[l]; ++i) {
      // Node i of this level hangs under node i * |prev| / |this| of the previous one.
      const int32_t parent =
          level.empty() ? -1 : level[size_t(i) * level.size() / size_t(nodes_per_level[l])];
      next.push_back(b.add_run(parent, tokens_per_level[l]));
    }
    level = std::move(next);
  }
  for (int32_t leaf : level) b.add_query(leaf);
  return b.build(seed);
}

TreeCase few_shot_case(int32_t prompt_tokens, int32_t branches, int32_t branch_tokens,
                       int32_t page_size, uint64_t seed) {
  if (branch_tokens > 0) {
    return fasttree_case({1, branches}, {prompt_tokens, branch_tokens}, page_size, seed);
  }
  TreeViewBuilder b(page_size);
  const int32_t prompt = b.add_run(-1, prompt_tokens);
  for (int32_t q = 0; q < branches; ++q) b.add_query(prompt);
  return b.build(seed);
}

TreeCase speculative_case(int32_t prefix_tokens, const std::vector<std::vector<int32_t>>& paths,
                          int32_t page_size, uint64_t seed) {
  TreeViewBuilder b(page_size);
  const int32_t prefix = b.add_run(-1, prefix_tokens);
  b.add_query(prefix);  // the last accepted token, verified with the candidates
  std::map<std::vector<int32_t>, int32_t> run_of;
  for (const auto& path : paths) {
    std::vector<int32_t> parent_path(path.begin(), path.end() - 1);
    const int32_t parent = parent_path.empty() ? prefix : run_of.at(parent_path);
    const int32_t run = b.add_run(parent, 1);
    run_of[path] = run;
    b.add_query(run);
  }
  return b.build(seed);
}

std::vector<std::vector<int32_t>> medusa_like_paths(int32_t size) {
  constexpr int32_t kTopK = 10, kMaxDepth = 5;
  auto child_score = [](size_t depth, int32_t rank) {
    return std::pow(0.8, double(depth)) / std::pow(double(rank + 1), 1.3);
  };
  // Best-first over paths; a path scores below its prefix, so the chosen set is a tree.
  using Entry = std::pair<double, std::vector<int32_t>>;
  auto worse = [](const Entry& a, const Entry& b) {
    return a.first != b.first ? a.first < b.first : a.second > b.second;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(worse)> frontier(worse);
  frontier.push({child_score(0, 0), {0}});
  std::vector<std::vector<int32_t>> paths;
  while (int32_t(paths.size()) < size && !frontier.empty()) {
    auto [score, path] = frontier.top();
    frontier.pop();
    paths.push_back(path);
    if (path.back() + 1 < kTopK) {  // next sibling
      std::vector<int32_t> sibling = path;
      ++sibling.back();
      frontier.push({score / child_score(path.size() - 1, path.back()) *
                         child_score(path.size() - 1, sibling.back()),
                     sibling});
    }
    if (int32_t(path.size()) < kMaxDepth) {  // first child
      std::vector<int32_t> child = path;
      child.push_back(0);
      frontier.push({score * child_score(path.size(), 0), child});
    }
  }
  // Parents first (shorter paths first, then lexicographic), as the DeFT templates list them.
  std::sort(paths.begin(), paths.end(), [](const auto& a, const auto& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  return paths;
}

}  // namespace treeserve::testing
