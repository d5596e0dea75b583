// PagePool: free list (a stack, so recently freed pages are reused first while they may
// still be warm in cache) and per-page reference counts.
#include "kvcache/page_pool.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

namespace treeserve {

StatusOr<int32_t> PagePool::pages_for_budget(const KvLayout& model, int64_t budget_bytes) {
  if (model.page_size < 1 || model.page_size > kMaxPageSize) {
    return InvalidArgument("page_size must be in [1, 256], got " + std::to_string(model.page_size));
  }
  // Each field on its own: two negative fields would multiply to a positive size.
  const std::pair<const char*, int32_t> fields[] = {{"num_layers", model.num_layers},
                                                    {"num_kv_heads", model.num_kv_heads},
                                                    {"head_dim", model.head_dim},
                                                    {"dtype_bytes", model.dtype_bytes}};
  for (const auto& [name, value] : fields) {
    if (value < 1) {
      return InvalidArgument(std::string(name) + " must be positive, got " + std::to_string(value));
    }
  }
  if (model.scale_bytes < 0) {
    return InvalidArgument("scale_bytes must be >= 0, got " + std::to_string(model.scale_bytes));
  }
  if (budget_bytes <= 0) return InvalidArgument("budget_bytes must be positive");
  // Bytes of one page across all layers, K and V: each (token, kv head) row of K or V is
  // head_dim * dtype_bytes values and scale_bytes of scale. Checked so absurd shapes cannot
  // overflow (the fields are int32, so the row's bytes fit in int64).
  const int64_t row_bytes = int64_t{model.head_dim} * model.dtype_bytes + model.scale_bytes;
  int64_t bytes_per_page = row_bytes;
  const std::pair<const char*, int64_t> factors[] = {{"page_size", int64_t{2} * model.page_size},
                                                     {"num_layers", model.num_layers},
                                                     {"num_kv_heads", model.num_kv_heads}};
  for (const auto& [name, value] : factors) {
    if (__builtin_mul_overflow(bytes_per_page, value, &bytes_per_page)) {
      return InvalidArgument("model shape is too large: bytes per page overflow at " +
                             std::string(name));
    }
  }
  const int64_t pages = budget_bytes / bytes_per_page;
  if (pages < 1) return InvalidArgument("budget_bytes holds no page");
  // Page ids are int32 (AttentionView::pages); clamp rather than overflow.
  return static_cast<int32_t>(std::min<int64_t>(pages, INT32_MAX));
}

PagePool::PagePool(int32_t num_pages, int32_t page_size)
    : page_size_(page_size), pages_(num_pages), owners_(1) {
  free_list_.reserve(num_pages);
  // Highest id at the bottom so allocation hands out 0, 1, 2, ... on a fresh pool.
  for (int32_t p = num_pages - 1; p >= 0; --p) free_list_.push_back(p);
}

int32_t PagePool::allocate(int32_t owner) {
  assert(owner >= 0);
  if (free_list_.empty()) return -1;
  const int32_t page = free_list_.back();
  free_list_.pop_back();
  pages_[page].refs = 1;
  ++used_;
  if (owner >= static_cast<int32_t>(owners_.size())) [[unlikely]] {
    owners_.resize(owner + 1);
  }
  pages_[page].owner = owner;
  ++owners_[owner].used;
  return page;
}

Status PagePool::allocate(int32_t n, std::vector<int32_t>* out, int32_t owner) {
  if (n < 0) return InvalidArgument("n must be >= 0");
  if (n > num_free()) {
    return ResourceExhausted("need " + std::to_string(n) + " pages, " + std::to_string(num_free()) +
                             " free");
  }
  for (int32_t i = 0; i < n; ++i) out->push_back(allocate(owner));
  return Status::Ok();
}

void PagePool::retain(int32_t page) {
  assert(pages_[page].refs > 0 && "retain of a free page");
  ++pages_[page].refs;
}

bool PagePool::release(int32_t page) {
  assert(pages_[page].refs > 0 && "release of a free page");
  if (--pages_[page].refs > 0) return false;
  free_list_.push_back(page);
  --used_;
  --owners_[pages_[page].owner].used;
  return true;
}

Status PagePool::check_invariants() const {
  if (num_free() + used_ != num_pages()) {
    return Internal("free " + std::to_string(num_free()) + " + used " + std::to_string(used_) +
                    " != total " + std::to_string(num_pages()));
  }
  std::vector<uint8_t> in_free(pages_.size(), 0);
  for (int32_t page : free_list_) {
    if (page < 0 || page >= num_pages()) return Internal("free list holds bad page id");
    if (in_free[page]) return Internal("page " + std::to_string(page) + " freed twice");
    if (pages_[page].refs != 0) {
      return Internal("page " + std::to_string(page) + " is free and referenced");
    }
    in_free[page] = 1;
  }
  int32_t used = 0;
  std::vector<int32_t> owner_used(owners_.size(), 0);
  for (size_t p = 0; p < pages_.size(); ++p) {
    if (pages_[p].refs < 0) return Internal("negative ref count on page " + std::to_string(p));
    if (pages_[p].refs == 0 && !in_free[p]) {
      return Internal("page " + std::to_string(p) + " leaked (no refs, not free)");
    }
    if (pages_[p].refs == 0) continue;
    if (pages_[p].owner < 0 || pages_[p].owner >= static_cast<int32_t>(owners_.size())) {
      return Internal("page " + std::to_string(p) + " has a bad owner");
    }
    ++used;
    ++owner_used[pages_[p].owner];
  }
  if (used != used_) return Internal("used counter out of sync");
  int32_t locked = 0;
  for (size_t o = 0; o < owners_.size(); ++o) {
    if (owner_used[o] != owners_[o].used) {
      return Internal("used count of owner " + std::to_string(o) + " out of sync");
    }
    if (owners_[o].locked < 0 || owners_[o].locked > owners_[o].used) {
      return Internal("locked count of owner " + std::to_string(o) + " out of range");
    }
    locked += owners_[o].locked;
  }
  if (locked != locked_) return Internal("locked counter out of sync");
  return Status::Ok();
}

}  // namespace treeserve
