// PagePool: the index of the paged KV pool. Owns page ids, their reference counts and the
// free list; never the bytes (those are an engine buffer laid out per kernels/kv_layout.h).
// A page is free exactly when its reference count is 0. Every holder (a radix node, a
// branch tail) owns one reference per page it lists.
//
// For per-namespace quotas each used page also has an owner (a small dense index; KvCache
// gives one to each cache namespace), and the pool keeps two counts per owner, read in O(1):
// used pages (kept here, on allocate and free) and locked pages, those a live branch holds
// (reported by the holders, which know when a page they list becomes locked: RadixTree for
// locked nodes, KvCache for branch tails; KvCache::check_invariants verifies them by a scan).
#pragma once

#include <cassert>
#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/kv_layout.h"

namespace treeserve {

class PagePool {
 public:
  static constexpr int32_t kMaxPageSize = 256;

  // Pages that `budget_bytes` of KV memory hold for `model`'s shape and page size.
  static StatusOr<int32_t> pages_for_budget(const KvLayout& model, int64_t budget_bytes);

  // Requires 1 <= page_size <= kMaxPageSize and num_pages >= 1 (KvCache validates).
  PagePool(int32_t num_pages, int32_t page_size);

  int32_t page_size() const { return page_size_; }
  int32_t num_pages() const { return static_cast<int32_t>(pages_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t num_used() const { return used_; }

  // One page with reference count 1, owned by `owner` (>= 0), or -1 when none is free. O(1).
  int32_t allocate(int32_t owner = 0);
  // `n` pages appended to *out, all or nothing: RESOURCE_EXHAUSTED changes nothing.
  Status allocate(int32_t n, std::vector<int32_t>* out, int32_t owner = 0);
  // Adds a reference to a used page.
  void retain(int32_t page);
  // Drops a reference; returns true when that freed the page. O(1).
  bool release(int32_t page);
  int32_t ref_count(int32_t page) const { return pages_[page].refs; }

  int32_t owner(int32_t page) const { return pages_[page].owner; }
  int32_t owner_used(int32_t owner) const {
    return owner >= 0 && owner < static_cast<int32_t>(owners_.size()) ? owners_[owner].used : 0;
  }
  // `delta` more (or fewer) of the owner's pages are held by live branches. O(1). The owner
  // has allocated pages (the holder lists them), so its counts exist.
  void add_locked(int32_t owner, int32_t delta) {
    assert(owner >= 0 && owner < static_cast<int32_t>(owners_.size()));
    owners_[owner].locked += delta;
    locked_ += delta;
  }
  int32_t owner_locked(int32_t owner) const {
    return owner >= 0 && owner < static_cast<int32_t>(owners_.size()) ? owners_[owner].locked : 0;
  }
  int32_t num_locked() const { return locked_; }

  // free + used == total; free pages have no references; the free list has no duplicates;
  // the used counts per owner match the pages; locked counts lie in [0, used].
  Status check_invariants() const;

 private:
  struct OwnerCounts {
    int32_t used = 0;
    int32_t locked = 0;
  };

  int32_t page_size_;
  int32_t used_ = 0;
  int32_t locked_ = 0;
  // Reference count and owner side by side: allocation and release touch both.
  struct PageState {
    int32_t refs = 0;
    int32_t owner = 0;  // meaningful while the page is used
  };
  std::vector<PageState> pages_;     // [num_pages]
  std::vector<int32_t> free_list_;   // stack of free page ids
  std::vector<OwnerCounts> owners_;  // by owner index, grown on first use
};

}  // namespace treeserve
