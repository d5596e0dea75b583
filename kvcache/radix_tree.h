// RadixTree: the global prefix cache over token ids (SGLang radix_cache style), shared by all
// trees and requests. Each node is a run of tokens at sequence positions [start, end) and
// lists the pages that hold them: pages[i] holds page index start / page_size + i, and the
// token at position p sits in slot p % page_size. A split in the middle of a page leaves both
// halves listing that page (one reference each), each using its own slots.
//
// Nodes on a live branch's path are locked (lock_ref > 0: a lock counts on the node and all
// its ancestors); unlocked leaves are evicted least recently used first.
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

  RadixNode* root() { return &root_; }
  const RadixNode* root() const { return &root_; }

  // Longest cached prefix of tokens[0, max_length). Changes nothing.
  PrefixMatch match_prefix(std::span<const int32_t> tokens, int32_t max_length) const;
  // A node ending exactly at the match (splitting the matched node if the match ends inside).
  RadixNode* node_at(const PrefixMatch& match);
  // The node on the path root..`node` that ends exactly at `position` (splitting if needed);
  // requires 0 <= position <= node->end(). Position 0 is the root.
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
  void touch(RadixNode* node);

  // Frees at least `pages_needed` more pages by evicting unlocked leaves, least recently
  // used first, going on up to `pages_wanted` when that many are evictable (every call scans
  // the whole tree, so callers under steady memory pressure evict in batches). All or
  // nothing: returns false and evicts nothing when `pages_needed` is impossible.
  bool evict(int32_t pages_needed, int32_t pages_wanted = 0);
  // Evicts every unlocked node; returns the pages freed.
  int32_t evict_all();

  int64_t cached_tokens() const { return cached_tokens_; }
  int64_t node_count() const { return node_count_; }
  // Calls fn(const RadixNode&) for every node but the root.
  template <typename Fn>
  void for_each_node(Fn&& fn) const {
    std::vector<const RadixNode*> stack{&root_};
    while (!stack.empty()) {
      const RadixNode* n = stack.back();
      stack.pop_back();
      if (n != &root_) fn(*n);
      for (const auto& [token, child] : n->children) stack.push_back(child.get());
    }
  }
  // Keys, positions, page counts and lock_ref >= sum of children's lock_ref.
  Status check_invariants() const;

 private:
  int32_t pages_spanned(int32_t start, int32_t end) const;
  void remove_leaf(RadixNode* leaf);

  PagePool* pool_;
  RadixNode root_;
  uint64_t clock_ = 0;
  int64_t next_id_ = 1;
  int64_t cached_tokens_ = 0;
  int64_t node_count_ = 0;
  std::vector<int32_t> scratch_refs_;  // eviction dry run: references dropped per page
};

}  // namespace treeserve
