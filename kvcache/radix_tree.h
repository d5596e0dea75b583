// RadixTree: the prefix cache over token ids (SGLang radix_cache style), shared by all trees
// and requests. Each node is a run of tokens at sequence positions [start, end) and lists the
// pages that hold them: pages[i] holds page index start / page_size + i, and the token at
// position p sits in slot p % page_size. A split in the middle of a page leaves both halves
// listing that page (one reference each), each using its own slots.
//
// The tree has one root per cache namespace (root(), the default namespace's, always exists;
// add_root / remove_root manage the others). A root has no parent, tokens or pages; nothing
// below one root is ever matched from another, so namespaces share no node and no page.
//
// Nodes on a live branch's path are locked (lock_ref > 0: a lock counts on the node and all
// its ancestors). A node's lock changing between 0 and 1 adds or removes its pages from its
// owner's locked count in the pool (O(1): a page two nodes list counts once, through the
// upper one). Unlocked leaves of all roots are evicted least recently used first, on one clock.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kvcache/page_pool.h"

namespace treeserve {

struct RadixNode {
  RadixNode* parent = nullptr;
  std::unordered_map<int32_t, std::unique_ptr<RadixNode>> children;  // keyed by first token
  std::vector<int32_t> tokens;                                       // the run's token ids
  std::vector<int32_t> pages;  // page ids for page indices start/ps .. (end-1)/ps
  int32_t start = 0;           // sequence position of tokens[0]
  int32_t lock_ref = 0;        // live branches whose path passes through this node
  uint64_t last_access = 0;    // LRU clock
  int64_t id = 0;              // stable id for diagnostics (AttentionView::node_id)
  int32_t owner = 0;           // the pool owner (cache namespace) of its root and pages
  // pages.front() is also listed by an ancestor (a split or a commit inside a page): locked
  // pages count it once, through the ancestor.
  bool shares_first_page = false;
  // Scratch owned by KvCache::build_attention_view (a stamp avoids clearing per build).
  uint64_t view_stamp = 0;
  int32_t view_index = -1;

  int32_t end() const { return start + static_cast<int32_t>(tokens.size()); }
};

// The longest cached prefix: `node` is the deepest node touched (root when nothing matched),
// of which the first `node_tokens` tokens matched; `length` tokens matched in all.
struct PrefixMatch {
  RadixNode* node = nullptr;
  int32_t node_tokens = 0;
  int32_t length = 0;
};

class RadixTree {
 public:
  explicit RadixTree(PagePool* pool);
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  // The default namespace's root.
  RadixNode* root() { return roots_[0].get(); }
  const RadixNode* root() const { return roots_[0].get(); }
  // A new, empty root (another namespace's tree; its nodes' pages belong to `owner`), and its
  // removal once it has no children.
  RadixNode* add_root(int32_t owner);
  void remove_root(RadixNode* root);
  int32_t root_count() const { return static_cast<int32_t>(roots_.size()); }

  // Longest cached prefix of tokens[0, max_length) under `root` (nullptr: the default root).
  // Changes nothing.
  PrefixMatch match_prefix(std::span<const int32_t> tokens, int32_t max_length,
                           const RadixNode* root = nullptr) const;
  // A node ending exactly at the match (splitting the matched node if the match ends inside).
  RadixNode* node_at(const PrefixMatch& match);
  // The node on the path root..`node` that ends exactly at `position` (splitting if needed);
  // requires 0 <= position <= node->end(). Position 0 is the path's root.
  RadixNode* node_on_path(RadixNode* node, int32_t position);
  // Splits `node` after its first k tokens (0 < k < size); returns the new upper half, which
  // takes the node's place under its parent. `node` keeps its identity as the lower half.
  RadixNode* split(RadixNode* node, int32_t k);

  // Inserts tokens that continue `parent` (they start at parent->end()); `pages` are the
  // caller's pages for page indices parent->end()/ps onwards. Existing nodes are reused
  // (splitting where the tokens diverge); new nodes retain the caller's pages they cover.
  // Returns the node ending at parent->end() + tokens.size().
  RadixNode* insert(RadixNode* parent, std::span<const int32_t> tokens,
                    std::span<const int32_t> pages);

  void lock(RadixNode* node);
  // touch=false restores the LRU clock too (used to undo a lock when a call fails).
  void unlock(RadixNode* node, bool touch = true);
  // Drops one lock of `node` alone, not of its ancestors (after node_at split a locked match,
  // the lock belongs to the upper half).
  void unlock_node(RadixNode* node);
  void touch(RadixNode* node);

  // Frees at least `pages_needed` more pages by evicting unlocked leaves, least recently
  // used first, going on up to `pages_wanted` when that many are evictable (every call scans
  // the whole tree, so callers under steady memory pressure evict in batches). All or
  // nothing: returns false and evicts nothing when `pages_needed` is impossible. `within`
  // limits it to one root's tree (nullptr: all roots, one LRU order).
  bool evict(int32_t pages_needed, int32_t pages_wanted = 0, const RadixNode* within = nullptr);
  // Evicts every unlocked node (of `within`'s tree, or of all); returns the pages freed.
  int32_t evict_all(const RadixNode* within = nullptr);

  int64_t cached_tokens() const { return cached_tokens_; }
  int64_t node_count() const { return node_count_; }
  // Calls fn(const RadixNode&) for every node but the roots (of `within`'s tree, or of all).
  template <typename Fn>
  void for_each_node(Fn&& fn, const RadixNode* within = nullptr) const {
    std::vector<const RadixNode*> stack;
    push_roots(within, &stack);
    while (!stack.empty()) {
      const RadixNode* n = stack.back();
      stack.pop_back();
      if (n->parent != nullptr) fn(*n);
      for (const auto& [token, child] : n->children) stack.push_back(child.get());
    }
  }
  // Whether a node on the path root..`node` (which ends at `position`) lists `page` as the
  // page holding `position`: the nodes ending inside that page are checked (none when
  // `position` is page-aligned). O(nodes ending in that page).
  bool page_on_path(const RadixNode* node, int32_t position, int32_t page) const;

  // Keys, positions, page counts, owners, shares_first_page and lock_ref >= sum of
  // children's lock_ref.
  Status check_invariants() const;

 private:
  int32_t pages_spanned(int32_t start, int32_t end) const;
  static int32_t locked_pages(const RadixNode& n) {
    return static_cast<int32_t>(n.pages.size()) - n.shares_first_page;
  }
  void remove_leaf(RadixNode* leaf);
  template <typename Node>
  void push_roots(const RadixNode* within, std::vector<Node*>* stack) const {
    if (within != nullptr) {
      stack->push_back(const_cast<Node*>(within));
      return;
    }
    for (const auto& r : roots_) stack->push_back(r.get());
  }

  PagePool* pool_;
  std::vector<std::unique_ptr<RadixNode>> roots_;  // [0]: the default namespace's root
  uint64_t clock_ = 0;
  int64_t next_id_ = 1;
  int64_t cached_tokens_ = 0;
  int64_t node_count_ = 0;
  std::vector<int32_t> scratch_refs_;  // eviction dry run: references dropped per page
};

}  // namespace treeserve
