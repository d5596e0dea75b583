// KvCache's cache namespaces: the registry (namespace id -> slot, one radix root each), the
// per-namespace page limit that reserve applies, stats, eviction and their invariants. See the
// header comment of kv_cache.h.
#include <algorithm>
#include <string>
#include <vector>

#include "kvcache/kv_cache.h"

namespace treeserve {

int32_t KvCache::find_namespace(CacheNamespace ns) const {
  if (ns == kDefaultCacheNamespace) return 0;
  auto it = namespace_slots_.find(ns);
  return it == namespace_slots_.end() ? -1 : it->second;
}

int32_t KvCache::add_namespace(CacheNamespace ns) {
  int32_t slot;
  if (!free_namespace_slots_.empty()) {
    slot = free_namespace_slots_.back();
    free_namespace_slots_.pop_back();
  } else {
    slot = static_cast<int32_t>(namespaces_.size());
    namespaces_.emplace_back();
  }
  namespaces_[slot] = {ns, tree_.add_root(slot), 0, 0};
  namespace_slots_.emplace(ns, slot);
  return slot;
}

void KvCache::forget_namespace(int32_t slot) {
  Namespace& ns = namespaces_[slot];
  assert(slot != 0 && ns.live_branches == 0 && pool_.owner_used(slot) == 0);
  tree_.remove_root(ns.root);
  namespace_slots_.erase(ns.id);
  ns = Namespace{};
  free_namespace_slots_.push_back(slot);
}

// A namespace's pages stay within its limit: its locked pages plus the new ones must fit, and
// its own cache makes room first (LRU within the namespace), so a namespace at its limit
// recycles its own cache instead of evicting others'. Nothing is evicted unless the pool can
// then supply all `pages`, so a refusal changes nothing.
Status KvCache::fit_namespace_limit(int32_t pages, const char* op, int32_t ns_slot) {
  const Namespace& ns = namespaces_[ns_slot];
  const int32_t locked = pool_.owner_locked(ns_slot);
  if (locked + pages > ns.page_limit) {
    return ResourceExhausted(
        std::string(op) + ": cache namespace " + std::to_string(ns.id) + " page limit " +
        std::to_string(ns.page_limit) + " reached: " + std::to_string(locked) +
        " pages locked by its live branches, " + std::to_string(pages) + " more needed");
  }
  const int32_t over = pool_.owner_used(ns_slot) + pages - ns.page_limit;
  if (over <= 0) return Status::Ok();
  if (pages - pool_.num_free() > pool_.num_used() - pool_.num_locked()) {
    return ResourceExhausted(std::string(op) + ": needs " + std::to_string(pages) + " pages, " +
                             std::to_string(pool_.num_free()) +
                             " free and not enough evictable cached prefixes");
  }
  // Always possible: the namespace's evictable pages (used - locked) are at least `over`.
  const bool evicted = tree_.evict(over, ns.page_limit / 64, ns.root);
  assert(evicted);
  (void)evicted;
  return Status::Ok();
}

StatusOr<CacheNamespace> KvCache::branch_namespace(BranchId id) const {
  StatusOr<const Branch*> b = find(id);
  if (!b.ok()) return b.status();
  return namespaces_[(*b)->ns_slot].id;
}

NamespaceStats KvCache::namespace_stats(CacheNamespace ns) const {
  NamespaceStats s;
  const int32_t slot = find_namespace(ns);
  if (slot < 0) return s;
  s.pages_locked = pool_.owner_locked(slot);
  s.pages_evictable = pool_.owner_used(slot) - s.pages_locked;
  s.live_branches = namespaces_[slot].live_branches;
  s.page_limit = namespaces_[slot].page_limit;
  return s;
}

Status KvCache::set_namespace_page_limit(CacheNamespace ns, int32_t pages) {
  if (pages < 0) return InvalidArgument("pages must be >= 0, got " + std::to_string(pages));
  int32_t slot = find_namespace(ns);
  if (slot < 0) {
    if (pages == 0) return Status::Ok();
    slot = add_namespace(ns);
  }
  namespaces_[slot].page_limit = pages;
  if (pages > 0) {
    const int32_t used = pool_.owner_used(slot);
    const int32_t over = std::min(used - pages, used - pool_.owner_locked(slot));
    if (over > 0) tree_.evict(over, 0, namespaces_[slot].root);
  }
  return Status::Ok();
}

Status KvCache::reserve_pages(CacheNamespace ns, int32_t pages) {
  if (pages < 0) return InvalidArgument("pages must be >= 0, got " + std::to_string(pages));
  return reserve(pages, "reserve_pages", find_namespace(ns));
}

int32_t KvCache::evict_namespace(CacheNamespace ns) {
  const int32_t slot = find_namespace(ns);
  if (slot < 0) return 0;
  const int32_t freed = tree_.evict_all(namespaces_[slot].root);
  const Namespace& n = namespaces_[slot];
  if (slot != 0 && n.live_branches == 0 && n.page_limit == 0) forget_namespace(slot);
  return freed;
}

// Every branch and page lies in its namespace's tree, the registry is consistent, and each
// namespace's locked pages (counted by the tree and the tails as locks change) match a scan:
// a page is locked when a locked node or a live tail lists it. The pool checks the used counts.
Status KvCache::check_namespaces() const {
  const int32_t slots = static_cast<int32_t>(namespaces_.size());
  if (slots == 0 || namespaces_[0].id != kDefaultCacheNamespace ||
      namespaces_[0].root != tree_.root()) {
    return Internal("the default namespace is not slot 0");
  }
  std::vector<uint8_t> locked(pool_.num_pages(), 0);
  std::vector<int32_t> live(slots, 0);
  for (const Branch& b : branches_) {
    if (!b.live) continue;
    if (b.ns_slot < 0 || b.ns_slot >= slots || namespaces_[b.ns_slot].root == nullptr) {
      return Internal("a live branch has no namespace");
    }
    const RadixNode* root = b.base;
    while (root->parent != nullptr) root = root->parent;
    if (root != namespaces_[b.ns_slot].root) {
      return Internal("a branch of namespace " + std::to_string(namespaces_[b.ns_slot].id) +
                      " is based in another namespace's tree");
    }
    for (int32_t page : b.tail_pages) {
      locked[page] = 1;
      if (pool_.owner(page) != b.ns_slot) return Internal("a tail page has another owner");
    }
    const bool shared =
        !b.tail_pages.empty() && tree_.page_on_path(b.base, b.base_len(), b.tail_pages.front());
    if (b.shares_first_page != shared) return Internal("a tail's shares_first_page is wrong");
    ++live[b.ns_slot];
  }
  int32_t in_use = 0;
  int64_t nodes = 0;
  Status status = Status::Ok();
  for (int32_t slot = 0; slot < slots; ++slot) {
    const Namespace& ns = namespaces_[slot];
    if (ns.root == nullptr) continue;
    ++in_use;
    const std::string who = "namespace " + std::to_string(ns.id);
    if (find_namespace(ns.id) != slot) return Internal(who + " is not registered at its slot");
    if (ns.root->owner != slot) return Internal(who + "'s root has the wrong owner");
    if (ns.live_branches != live[slot]) return Internal(who + " live branch count out of sync");
    if (ns.page_limit < 0) return Internal(who + " has a negative page limit");
    tree_.for_each_node(
        [&](const RadixNode& n) {
          ++nodes;
          for (int32_t page : n.pages) {
            if (n.lock_ref > 0) locked[page] = 1;
            if (pool_.owner(page) != slot && status.ok()) {
              status = Internal(who + ": radix node " + std::to_string(n.id) +
                                " lists a page of another namespace");
            }
          }
        },
        ns.root);
  }
  TS_RETURN_IF_ERROR(status);
  if (in_use != tree_.root_count() || nodes != tree_.node_count()) {
    return Internal("radix roots and namespaces differ");
  }
  if (in_use != static_cast<int32_t>(namespace_slots_.size()) ||
      in_use + static_cast<int32_t>(free_namespace_slots_.size()) != slots) {
    return Internal("namespace registry out of sync");
  }
  std::vector<int32_t> locked_in(slots, 0);
  for (int32_t p = 0; p < pool_.num_pages(); ++p) locked_in[pool_.owner(p)] += locked[p];
  for (int32_t slot = 0; slot < slots; ++slot) {
    if (locked_in[slot] != pool_.owner_locked(slot)) {
      return Internal("namespace " + std::to_string(namespaces_[slot].id) + " counts " +
                      std::to_string(pool_.owner_locked(slot)) + " locked pages, holders list " +
                      std::to_string(locked_in[slot]));
    }
  }
  return Status::Ok();
}

}  // namespace treeserve
