// KvCache: the facade the scheduler uses. Branches over the radix tree, the paged pool index,
// and the AttentionView each step's queries read.
//
// A branch is a locked path in the radix tree (its `base`, ending at position base_len) plus a
// private, growable tail of tokens [base_len, length) in pages only it writes.
//
// Page rule (why forks copy one page): the token at position p always sits in slot
// p % page_size, and every branch's pages form a plain per-sequence page table
// (branch_page_table): page index k holds valid KV for all of the branch's positions in
// [k * page_size, (k + 1) * page_size). Page-aligned shared KV is shared by reference count;
// when a new tail has to start inside a shared page (fork or match mid-page), it gets a fresh
// page and the engine copies the shared slots [0, position % page_size) into it (a
// PageCopy), because the slots after that position belong to another writer. That is at most
// one page per new branch, and never a page-aligned one.
//
// Tails enter the radix tree (commit) when they become shared or cached: fork at a position
// inside the tail, prune with retain_kv, finish. The tail's tokens are inserted under its
// base; parts the tree already holds are reused (the branch's duplicate pages are released)
// and the branch's base moves to the new node. The tail's partly filled last page is then
// listed by both the node and the tail, the tail remaining its only writer.
//
// Speculative token trees: append_token_tree(branch, tokens, parents) stores draft token i at
// the storage position length + i of the branch's pages; in the view each draft is a
// one-token run whose parent run is its parent draft (or the branch's last token), so it sees
// exactly its ancestors. accept(branch, path) keeps one root-to-node path as ordinary tail
// tokens and returns the slot moves that compact it; every other draft slot is released.
//
// Cache namespaces (vLLM's cache_salt): the radix tree has one root per namespace, and a
// branch lives in the namespace create_branch gave it; its forks, commits and prunes stay
// there. A prefix cached in one namespace is never matched, reused or reported
// (cached_tokens, match_prefix_length) in another, so nothing, pages included, is shared
// across namespaces and every used page belongs to exactly one. Namespace 0 is the default
// that calls without one use. Eviction is one LRU over all namespaces' unlocked leaves.
// namespace_stats reads a namespace's pages in O(1): locked (held by its live branches'
// paths and tails, each page once) and evictable (cached, no live branch holds it).
//
// Failure behaviour: a call that needs pages first evicts unlocked cached prefixes (LRU, in
// batches of up to 1/64 of the pool); if still short it returns RESOURCE_EXHAUSTED and
// changes nothing. A namespace with a page limit holds at most that many pages: a call that
// would take its locked pages past the limit returns RESOURCE_EXHAUSTED naming the usage and
// the limit, changing nothing; otherwise the namespace's own cache is evicted (LRU) as far
// as the limit requires before the pool is asked. Unknown ids are NOT_FOUND, ids of pruned
// branches FAILED_PRECONDITION, bad arguments INVALID_ARGUMENT naming the field.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "kernels/attention_view.h"
#include "kernels/kv_layout.h"
#include "kvcache/page_pool.h"
#include "kvcache/radix_tree.h"

namespace treeserve {

using BranchId = int64_t;

// A partition of the prefix cache (a tenant, or a client's cache salt). 0 is the default.
using CacheNamespace = uint32_t;
inline constexpr CacheNamespace kDefaultCacheNamespace = 0;

struct KvSlot {
  int32_t page = 0;
  int32_t slot = 0;  // [0, page_size)
  bool operator==(const KvSlot&) const = default;
};

// The engine copies slots [0, num_slots) of src_page to dst_page (every layer, K and V) before
// the new branch's next step writes into dst_page.
struct PageCopy {
  int32_t src_page = 0;
  int32_t dst_page = 0;
  int32_t num_slots = 0;
  bool operator==(const PageCopy&) const = default;
};

// One token's K/V moved from src to dst (speculative accept); perform in the order given.
struct SlotMove {
  KvSlot src;
  KvSlot dst;
};

struct KvCacheConfig {
  int32_t page_size = 16;  // tokens per page, [1, 256]
  int32_t num_pages = 0;   // pool capacity
  // Capacity from a byte budget and the model's shape (model.page_size is used).
  static StatusOr<KvCacheConfig> from_budget(const KvLayout& model, int64_t budget_bytes);
};

struct NewBranch {
  BranchId id = 0;
  int32_t cached_tokens = 0;     // prompt tokens whose KV was reused from the radix tree
  std::vector<KvSlot> slots;     // where tokens [cached_tokens, size) must be written
  std::vector<PageCopy> copies;  // perform before writing (match ended inside a page)
};

struct ForkResult {
  std::vector<BranchId> branches;
  std::vector<PageCopy> copies;  // at most one per new branch
};

struct TruncateResult {
  int32_t freed_pages = 0;
  std::vector<PageCopy> copies;  // only when rewinding into a shared page
};

struct PruneResult {
  int32_t freed_pages = 0;      // pages returned to the free list by this call
  int32_t released_tokens = 0;  // private tokens whose KV was dropped
  int32_t cached_tokens = 0;    // private tokens kept as evictable radix prefixes
};

// The last `num_tokens` tokens of `branch` are queries this step (1 for decode, L for a
// prefill chunk of L tokens, causal among themselves), followed by all its draft tokens.
struct ViewQuery {
  BranchId branch = 0;
  int32_t num_tokens = 1;
};

struct KvCacheStats {
  int32_t pages_total = 0;
  int32_t pages_free = 0;
  int32_t pages_used = 0;
  int32_t pages_locked = 0;     // referenced by a live branch (its path or its tail)
  int32_t pages_evictable = 0;  // freed if every unlocked cached prefix were evicted
  int64_t radix_cached_tokens = 0;
  int64_t radix_nodes = 0;
  int32_t live_branches = 0;
};

// One namespace's share of the pool (KvCache::namespace_stats, O(1)).
struct NamespaceStats {
  int32_t pages_locked = 0;     // held by its live branches (paths and tails), each page once
  int32_t pages_evictable = 0;  // its cached pages that no live branch holds
  int32_t live_branches = 0;
  int32_t page_limit = 0;  // 0 = none
};

class KvCache {
 public:
  static StatusOr<std::unique_ptr<KvCache>> create(const KvCacheConfig& config);
  ~KvCache();

  // New branch for a prompt in namespace `ns`: reuses (and locks) the longest prefix cached in
  // `ns`, at most tokens.size() - 1 tokens so the engine always computes the last one's logits.
  StatusOr<NewBranch> create_branch(std::span<const int32_t> tokens,
                                    CacheNamespace ns = kDefaultCacheNamespace);
  // Appends tokens; their slots are appended to *slots.
  Status append(BranchId branch, std::span<const int32_t> tokens, std::vector<KvSlot>* slots);
  // n new branches equal to the first `at_length` tokens of `branch` (0 = all of it).
  StatusOr<ForkResult> fork(BranchId branch, int32_t n, int32_t at_length = 0);
  // Drops tokens [new_length, length), releasing their KV; 1 <= new_length <= length.
  StatusOr<TruncateResult> truncate(BranchId branch, int32_t new_length);
  // Puts the branch's private tail into the radix tree without ending the branch, so any
  // later create_branch (of any tree) can reuse it: e.g. a prompt, once prefilled. The branch
  // stays the only writer of its partly filled last page. FAILED_PRECONDITION with drafts.
  Status commit(BranchId branch);
  // Ends the branch. Pages nothing else references are freed, or with retain_kv kept as
  // evictable cached prefixes. Pending drafts are always dropped.
  StatusOr<PruneResult> prune(BranchId branch, bool retain_kv);
  StatusOr<PruneResult> finish(BranchId branch) { return prune(branch, /*retain_kv=*/true); }

  // Speculative token tree hanging off the branch's last token: parents[i] in [-1, i), -1 =
  // the branch's last token. Draft slots are appended to *slots. One tree at a time.
  Status append_token_tree(BranchId branch, std::span<const int32_t> tokens,
                           std::span<const int32_t> parents, std::vector<KvSlot>* slots);
  // Keeps the drafts `path` (a chain from a root draft down; may be empty) as tail tokens;
  // the moves compacting their KV are appended to *moves.
  Status accept(BranchId branch, std::span<const int32_t> path, std::vector<SlotMove>* moves);

  StatusOr<int32_t> branch_length(BranchId branch) const;
  Status branch_tokens(BranchId branch, std::vector<int32_t>* out) const;
  // Physical page of every page index of the branch (see the page rule above).
  Status branch_page_table(BranchId branch, std::vector<int32_t>* out) const;
  // Of the branch's page table, the pages another reader may also read: whole pages of its
  // radix path (the cache holds them for any branch or prompt that matches) and pages listed
  // elsewhere too (a tail's first page shared with its node).
  StatusOr<int32_t> branch_shared_pages(BranchId branch) const;
  // Length of the cached prefix create_branch(tokens, ns) would reuse. Changes nothing.
  int32_t match_prefix_length(std::span<const int32_t> tokens,
                              CacheNamespace ns = kDefaultCacheNamespace) const;
  StatusOr<CacheNamespace> branch_namespace(BranchId branch) const;

  // Evicts unlocked cached prefixes (LRU) until `pages` more are free; all or nothing.
  bool evict(int32_t pages) { return tree_.evict(pages); }
  int32_t evict_all() { return tree_.evict_all(); }

  // Namespaces.
  // O(1); zeros for a namespace never used (or forgotten).
  NamespaceStats namespace_stats(CacheNamespace ns) const;
  // At most `pages` pages for `ns` (0 = no limit). Evicts the namespace's cache down to the
  // limit where it can; locked pages above a lowered limit stay, and the namespace's next
  // allocation is refused until they go. INVALID_ARGUMENT for pages < 0.
  Status set_namespace_page_limit(CacheNamespace ns, int32_t pages);
  // Makes `pages` pages allocatable to `ns` now, the check every allocating call makes:
  // evicts the namespace's own cache down to its limit, then (LRU, all namespaces) what the
  // pool lacks. RESOURCE_EXHAUSTED, changing nothing, when the namespace's locked pages would
  // pass its limit or the pool cannot supply them.
  Status reserve_pages(CacheNamespace ns, int32_t pages);
  // Evicts every unlocked cached prefix of `ns` (e.g. when its tenant is removed); returns
  // the pages freed. A namespace then holding nothing, with no page limit, is forgotten.
  int32_t evict_namespace(CacheNamespace ns);
  // Namespaces with state (the default one included).
  int32_t namespace_count() const {
    return static_cast<int32_t>(namespaces_.size() - free_namespace_slots_.size());
  }

  // Fills *out (its vectors are reused: no allocation in steady state). Rows are assigned in
  // the order of `queries`, each branch's tokens oldest first, then its drafts in order.
  Status build_attention_view(std::span<const ViewQuery> queries, AttentionView* out);

  int32_t page_size() const { return pool_.page_size(); }
  // Read-only view of the pool's reference counts, for diagnostics and tests.
  const PagePool& pool() const { return pool_; }
  KvCacheStats stats() const;
  // Pool and tree invariants, that every page's reference count equals the number of radix
  // nodes and branch tails listing it, and the namespaces: each branch and page in its
  // namespace's tree, and the per-namespace counts against a scan.
  Status check_invariants() const;

 private:
  // A namespace's state; its slot is the pool's owner index of its pages.
  struct Namespace {
    CacheNamespace id = 0;
    RadixNode* root = nullptr;  // nullptr: a free slot
    int32_t live_branches = 0;
    int32_t page_limit = 0;
  };
  struct Branch {
    uint32_t generation = 0;  // id = generation << 32 | index
    bool live = false;
    int32_t ns_slot = 0;                // namespaces_ index
    bool shares_first_page = false;     // tail_pages[0] is listed by a node on the path too
    RadixNode* base = nullptr;          // locked; the root when nothing is shared
    std::vector<int32_t> tail_tokens;   // positions [base_len, length)
    std::vector<int32_t> tail_pages;    // page indices base_len / ps .., drafts included
    std::vector<int32_t> draft_tokens;  // stored at positions length + i
    std::vector<int32_t> draft_parents;
    uint64_t view_stamp = 0;
    int32_t base_len() const { return base->end(); }
    int32_t length() const { return base_len() + static_cast<int32_t>(tail_tokens.size()); }
  };
  // Scratch of build_attention_view: one entry per run before preorder numbering.
  struct ViewRun {
    const RadixNode* node = nullptr;  // radix run, or
    const Branch* branch = nullptr;   // the branch's tail (draft < 0) or its draft `draft`
    BranchId branch_id = 0;
    int32_t draft = -1;
    int32_t depth = 0;  // drafts: depth in the token tree
    int32_t parent = -1, first_child = -1, last_child = -1, next_sibling = -1;
    int32_t preorder = -1;
  };
  struct ViewToken {
    int32_t row, run, leaf_tokens;
  };

  explicit KvCache(const KvCacheConfig& config);
  StatusOr<Branch*> find(BranchId id);
  StatusOr<const Branch*> find(BranchId id) const;
  BranchId new_branch(RadixNode* base, int32_t ns_slot);
  void retire(BranchId id);
  // Slot of `ns`, or -1 when it has no state.
  int32_t find_namespace(CacheNamespace ns) const;
  int32_t add_namespace(CacheNamespace ns);
  void forget_namespace(int32_t slot);
  // Makes `pages` pages allocatable for namespace slot `ns_slot` (-1: no namespace limit).
  Status reserve(int32_t pages, const char* op, int32_t ns_slot);
  Status fit_namespace_limit(int32_t pages, const char* op, int32_t ns_slot);
  Status check_namespaces() const;
  // A fresh tail page of namespace slot `ns_slot` (reserved beforehand), counted as locked.
  int32_t take_page(int32_t ns_slot);
  // Locked pages the tail adds to its namespace: its pages, less the first one when a radix
  // node on its path lists it too.
  static int32_t tail_locked(const Branch& b);
  // Releases every tail page; returns the pages freed.
  int32_t release_tail(Branch& b);
  // Pages the tail needs to cover positions up to `end` (exclusive).
  int32_t tail_pages_for(const Branch& b, int32_t end) const;
  KvSlot slot_of(const Branch& b, int32_t position) const;
  // Inserts tail tokens [base_len, position) into the tree and rebases the branch there;
  // returns the pages freed (tail pages duplicating KV the tree already held).
  int32_t commit_tail(Branch& b, int32_t position);
  // Releases tail pages beyond those covering positions up to `end`; returns pages freed.
  int32_t shrink_tail(Branch& b, int32_t end);
  // Gives a branch based at `node` its private copy of the node's last page if needed.
  void start_tail(Branch& b, std::vector<PageCopy>* copies);
  int32_t add_view_path(RadixNode* node);
  int32_t add_view_run(ViewRun run, int32_t parent);

  PagePool pool_;
  RadixTree tree_;
  std::vector<Namespace> namespaces_;  // by slot; slot 0: the default namespace
  std::unordered_map<CacheNamespace, int32_t> namespace_slots_;  // every namespace with state
  std::vector<int32_t> free_namespace_slots_;
  std::vector<Branch> branches_;
  std::vector<int32_t> free_branch_slots_;
  int32_t live_branches_ = 0;
  // build_attention_view scratch, reused across calls.
  uint64_t view_stamp_ = 0;
  std::vector<ViewRun> view_runs_;
  std::vector<ViewToken> view_tokens_;
  std::vector<RadixNode*> view_path_;
  std::vector<int32_t> view_counts_;
  std::vector<int32_t> view_subtree_end_;
  int32_t view_root_first_ = -1, view_root_last_ = -1;
};

}  // namespace treeserve
