// PagePool: the index of the paged KV pool. Owns page ids, their reference counts and the
// free list; never the bytes (those are an engine buffer laid out per kernels/kv_layout.h).
// A page is free exactly when its reference count is 0. Every holder (a radix node, a
// branch tail) owns one reference per page it lists.
#pragma once

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
  int32_t num_pages() const { return static_cast<int32_t>(refs_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t num_used() const { return used_; }

  // One page with reference count 1, or -1 when none is free. O(1).
  int32_t allocate();
  // `n` pages appended to *out, all or nothing: RESOURCE_EXHAUSTED changes nothing.
  Status allocate(int32_t n, std::vector<int32_t>* out);
  // Adds a reference to a used page.
  void retain(int32_t page);
  // Drops a reference; returns true when that freed the page. O(1).
  bool release(int32_t page);
  int32_t ref_count(int32_t page) const { return refs_[page]; }

  // free + used == total; free pages have no references; the free list has no duplicates.
  Status check_invariants() const;

 private:
  int32_t page_size_;
  int32_t used_ = 0;
  std::vector<int32_t> refs_;       // [num_pages]
  std::vector<int32_t> free_list_;  // stack of free page ids
};

}  // namespace treeserve
