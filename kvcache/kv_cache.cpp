// KvCache: branch lifecycle (create, append, fork, truncate, prune), read-back, accounting.
// Cache namespaces live in kv_cache_namespace.cpp, the token trees in kv_cache_draft.cpp, the
// attention view in kv_cache_view.cpp.
#include "kvcache/kv_cache.h"

#include <algorithm>
#include <string>
#include <unordered_map>

namespace treeserve {
namespace {

int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

}  // namespace

StatusOr<KvCacheConfig> KvCacheConfig::from_budget(const KvLayout& model, int64_t budget_bytes) {
  StatusOr<int32_t> pages = PagePool::pages_for_budget(model, budget_bytes);
  if (!pages.ok()) return pages.status();
  KvCacheConfig config;
  config.page_size = model.page_size;
  config.num_pages = *pages;
  return config;
}

StatusOr<std::unique_ptr<KvCache>> KvCache::create(const KvCacheConfig& config) {
  if (config.page_size < 1 || config.page_size > PagePool::kMaxPageSize) {
    return InvalidArgument("page_size must be in [1, 256], got " +
                           std::to_string(config.page_size));
  }
  if (config.num_pages < 1) {
    return InvalidArgument("num_pages must be >= 1, got " + std::to_string(config.num_pages));
  }
  return std::unique_ptr<KvCache>(new KvCache(config));
}

KvCache::KvCache(const KvCacheConfig& config)
    : pool_(config.num_pages, config.page_size), tree_(&pool_) {
  namespaces_.push_back({kDefaultCacheNamespace, tree_.root(), 0, 0});
  namespace_slots_.emplace(kDefaultCacheNamespace, 0);
}

KvCache::~KvCache() = default;

StatusOr<KvCache::Branch*> KvCache::find(BranchId id) {
  StatusOr<const Branch*> b = static_cast<const KvCache*>(this)->find(id);
  if (!b.ok()) return b.status();
  return const_cast<Branch*>(*b);
}

StatusOr<const KvCache::Branch*> KvCache::find(BranchId id) const {
  const uint64_t bits = static_cast<uint64_t>(id);
  const uint32_t index = static_cast<uint32_t>(bits & 0xffffffffu);
  const uint32_t generation = static_cast<uint32_t>(bits >> 32);
  if (id < 0 || generation == 0 || index >= branches_.size() ||
      generation > branches_[index].generation) {
    return NotFound("branch " + std::to_string(id) + " does not exist");
  }
  const Branch& b = branches_[index];
  if (generation < b.generation || !b.live) {
    return FailedPrecondition("branch " + std::to_string(id) + " was pruned");
  }
  return &b;
}

BranchId KvCache::new_branch(RadixNode* base, int32_t ns_slot) {
  uint32_t index;
  if (!free_branch_slots_.empty()) {
    index = static_cast<uint32_t>(free_branch_slots_.back());
    free_branch_slots_.pop_back();
  } else {
    index = static_cast<uint32_t>(branches_.size());
    branches_.emplace_back();
  }
  Branch& b = branches_[index];
  ++b.generation;
  b.live = true;
  b.base = base;
  b.ns_slot = ns_slot;
  ++namespaces_[ns_slot].live_branches;
  ++live_branches_;
  return static_cast<BranchId>((static_cast<uint64_t>(b.generation) << 32) | index);
}

void KvCache::retire(BranchId id) {
  const uint32_t index = static_cast<uint32_t>(static_cast<uint64_t>(id) & 0xffffffffu);
  Branch& b = branches_[index];
  b.live = false;
  b.base = nullptr;
  // Swap out rather than clear so a retired slot does not pin a long branch's capacity.
  std::vector<int32_t>().swap(b.tail_tokens);
  std::vector<int32_t>().swap(b.tail_pages);
  std::vector<int32_t>().swap(b.draft_tokens);
  std::vector<int32_t>().swap(b.draft_parents);
  free_branch_slots_.push_back(static_cast<int32_t>(index));
  --namespaces_[b.ns_slot].live_branches;
  --live_branches_;
}

int32_t KvCache::take_page(int32_t ns_slot) {
  const int32_t page = pool_.allocate(ns_slot);
  assert(page >= 0 && "a tail page that was not reserved");
  pool_.add_locked(ns_slot, 1);  // fresh, so no node lists it
  return page;
}

int32_t KvCache::tail_locked(const Branch& b) {
  return static_cast<int32_t>(b.tail_pages.size()) - b.shares_first_page;
}

int32_t KvCache::release_tail(Branch& b) {
  pool_.add_locked(b.ns_slot, -tail_locked(b));
  int32_t freed = 0;
  for (int32_t page : b.tail_pages) freed += pool_.release(page);
  b.tail_pages.clear();
  b.shares_first_page = false;
  return freed;
}

Status KvCache::reserve(int32_t pages, const char* op, int32_t ns_slot) {
  if (ns_slot >= 0 && pages > 0 && namespaces_[ns_slot].page_limit > 0) {
    TS_RETURN_IF_ERROR(fit_namespace_limit(pages, op, ns_slot));
  }
  if (pages <= pool_.num_free()) return Status::Ok();
  // Each eviction pass scans the whole radix tree; a full cache (the steady state of a busy
  // server) would pay that scan on every page allocated. Evicting 1/64 of the pool per pass
  // (when that much is evictable) amortizes it at a negligible cost in hit rate.
  const int32_t batch = pool_.num_pages() / 64;
  if (tree_.evict(pages - pool_.num_free(), batch)) return Status::Ok();
  return ResourceExhausted(std::string(op) + ": needs " + std::to_string(pages) + " pages, " +
                           std::to_string(pool_.num_free()) +
                           " free and not enough evictable cached prefixes");
}

int32_t KvCache::tail_pages_for(const Branch& b, int32_t end) const {
  return ceil_div(end, pool_.page_size()) - b.base_len() / pool_.page_size();
}

KvSlot KvCache::slot_of(const Branch& b, int32_t position) const {
  const int32_t ps = pool_.page_size();
  return {b.tail_pages[position / ps - b.base_len() / ps], position % ps};
}

void KvCache::start_tail(Branch& b, std::vector<PageCopy>* copies) {
  const int32_t used = b.base_len() % pool_.page_size();
  if (used == 0) return;
  const int32_t page = take_page(b.ns_slot);
  b.tail_pages.push_back(page);
  copies->push_back({b.base->pages.back(), page, used});
}

int32_t KvCache::commit_tail(Branch& b, int32_t position) {
  const int32_t ps = pool_.page_size();
  const int32_t base_len = b.base_len();
  const int32_t count = position - base_len;
  pool_.add_locked(b.ns_slot, -tail_locked(b));
  RadixNode* node =
      tree_.insert(b.base, {b.tail_tokens.data(), static_cast<size_t>(count)}, b.tail_pages);
  tree_.lock(node);
  tree_.unlock(b.base);
  // Pages wholly before position's page now belong to the tree (or were duplicates of it).
  const int32_t drop = position / ps - base_len / ps;
  int32_t freed = 0;
  for (int32_t i = 0; i < drop; ++i) freed += pool_.release(b.tail_pages[i]);
  b.tail_pages.erase(b.tail_pages.begin(), b.tail_pages.begin() + drop);
  b.tail_tokens.erase(b.tail_tokens.begin(), b.tail_tokens.begin() + count);
  b.base = node;
  // The partly filled page the tail keeps is usually the new node's last page too. Not
  // always: insert may have reused another writer's node, and then an earlier node of this
  // branch's commits may still list it.
  b.shares_first_page =
      !b.tail_pages.empty() && tree_.page_on_path(node, b.base_len(), b.tail_pages.front());
  pool_.add_locked(b.ns_slot, tail_locked(b));
  return freed;
}

int32_t KvCache::shrink_tail(Branch& b, int32_t end) {
  // Keeps at least the first page whenever a node shares it (base_len is then mid-page).
  const int32_t keep = tail_pages_for(b, end);
  const int32_t size = static_cast<int32_t>(b.tail_pages.size());
  if (size <= keep) return 0;
  int32_t freed = 0;
  for (int32_t i = keep; i < size; ++i) freed += pool_.release(b.tail_pages[i]);
  b.tail_pages.resize(keep);
  pool_.add_locked(b.ns_slot, keep - size);
  return freed;
}

Status KvCache::commit(BranchId id) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  if (!b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " has a pending token tree");
  }
  if (!b.tail_tokens.empty()) commit_tail(b, b.length());
  return Status::Ok();
}

StatusOr<NewBranch> KvCache::create_branch(std::span<const int32_t> tokens, CacheNamespace ns) {
  if (tokens.empty()) return InvalidArgument("tokens must not be empty");
  const int32_t ps = pool_.page_size();
  const int32_t size = static_cast<int32_t>(tokens.size());
  int32_t slot = find_namespace(ns);
  const bool new_namespace = slot < 0;
  if (new_namespace) slot = add_namespace(ns);
  const PrefixMatch match = tree_.match_prefix(tokens, size - 1, namespaces_[slot].root);
  // Lock the match before reserving so eviction cannot take it; undo on failure.
  tree_.lock(match.node);
  Status reserved = reserve(ceil_div(size, ps) - match.length / ps, "create_branch", slot);
  if (!reserved.ok()) {
    tree_.unlock(match.node, /*touch=*/false);
    if (new_namespace) forget_namespace(slot);
    return reserved;
  }
  RadixNode* base = tree_.node_at(match);
  if (base != match.node) tree_.unlock_node(match.node);  // split: the upper half stays locked
  tree_.touch(base);

  NewBranch out;
  out.cached_tokens = match.length;
  out.id = new_branch(base, slot);
  Branch& b = *find(out.id).value();
  start_tail(b, &out.copies);
  b.tail_tokens.assign(tokens.begin() + match.length, tokens.end());
  while (static_cast<int32_t>(b.tail_pages.size()) < tail_pages_for(b, size)) {
    b.tail_pages.push_back(take_page(slot));
  }
  out.slots.reserve(size - match.length);
  for (int32_t p = match.length; p < size; ++p) out.slots.push_back(slot_of(b, p));
  return out;
}

Status KvCache::append(BranchId id, std::span<const int32_t> tokens, std::vector<KvSlot>* slots) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  if (tokens.empty()) return InvalidArgument("tokens must not be empty");
  if (!b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " has a pending token tree");
  }
  const int32_t length = b.length();
  const int32_t new_length = length + static_cast<int32_t>(tokens.size());
  const int32_t need = tail_pages_for(b, new_length) - static_cast<int32_t>(b.tail_pages.size());
  if (need > 0) {
    TS_RETURN_IF_ERROR(reserve(need, "append", b.ns_slot));
    for (int32_t i = 0; i < need; ++i) b.tail_pages.push_back(take_page(b.ns_slot));
  }
  b.tail_tokens.insert(b.tail_tokens.end(), tokens.begin(), tokens.end());
  for (int32_t p = length; p < new_length; ++p) slots->push_back(slot_of(b, p));
  return Status::Ok();
}

StatusOr<ForkResult> KvCache::fork(BranchId id, int32_t n, int32_t at_length) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  if (n < 1) return InvalidArgument("n must be >= 1, got " + std::to_string(n));
  const int32_t length = b.length();
  if (at_length < 0 || at_length > length) {
    return InvalidArgument("at_length must be in [0, " + std::to_string(length) + "], got " +
                           std::to_string(at_length));
  }
  if (!b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " has a pending token tree");
  }
  const int32_t at = at_length == 0 ? length : at_length;
  const int32_t slot = b.ns_slot;
  TS_RETURN_IF_ERROR(reserve(at % pool_.page_size() != 0 ? n : 0, "fork", slot));
  RadixNode* node;
  if (at > b.base_len()) {
    commit_tail(b, at);
    node = b.base;
  } else {
    node = tree_.node_on_path(b.base, at);
  }
  ForkResult out;
  out.branches.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    const BranchId child = new_branch(node, slot);  // may move branches_: `b` is not used below
    tree_.lock(node);
    start_tail(*find(child).value(), &out.copies);
    out.branches.push_back(child);
  }
  return out;
}

StatusOr<TruncateResult> KvCache::truncate(BranchId id, int32_t new_length) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  const int32_t length = b.length();
  if (new_length < 1 || new_length > length) {
    return InvalidArgument("new_length must be in [1, " + std::to_string(length) + "], got " +
                           std::to_string(new_length));
  }
  if (!b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " has a pending token tree");
  }
  TruncateResult out;
  if (new_length >= b.base_len()) {
    b.tail_tokens.resize(new_length - b.base_len());
    out.freed_pages = shrink_tail(b, new_length);
    return out;
  }
  // Rewind into the shared path: the branch is re-based on the node ending at new_length.
  // A mid-page rewind needs one fresh page; the tail's private pages are released first, so
  // shortening a branch only has to evict (or fail) when none of them frees a page.
  if (new_length % pool_.page_size() != 0) {
    int32_t freeable = 0;
    for (int32_t page : b.tail_pages) freeable += pool_.ref_count(page) == 1;
    if (freeable == 0) TS_RETURN_IF_ERROR(reserve(1, "truncate", b.ns_slot));
  }
  RadixNode* node = tree_.node_on_path(b.base, new_length);
  tree_.lock(node);
  tree_.unlock(b.base);
  out.freed_pages += release_tail(b);
  b.tail_tokens.clear();
  b.base = node;
  start_tail(b, &out.copies);
  return out;
}

StatusOr<PruneResult> KvCache::prune(BranchId id, bool retain_kv) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  PruneResult out;
  b.draft_tokens.clear();
  b.draft_parents.clear();
  const int32_t tail = static_cast<int32_t>(b.tail_tokens.size());
  if (retain_kv && tail > 0) {
    out.freed_pages += commit_tail(b, b.length());
    out.cached_tokens = tail;
  } else {
    out.released_tokens = tail;
  }
  out.freed_pages += release_tail(b);
  tree_.unlock(b.base);
  retire(id);
  return out;
}

StatusOr<int32_t> KvCache::branch_length(BranchId id) const {
  StatusOr<const Branch*> b = find(id);
  if (!b.ok()) return b.status();
  return (*b)->length();
}

Status KvCache::branch_tokens(BranchId id, std::vector<int32_t>* out) const {
  StatusOr<const Branch*> found = find(id);
  if (!found.ok()) return found.status();
  const Branch& b = **found;
  out->resize(b.length());
  std::copy(b.tail_tokens.begin(), b.tail_tokens.end(), out->begin() + b.base_len());
  for (const RadixNode* n = b.base; n->parent != nullptr; n = n->parent) {
    std::copy(n->tokens.begin(), n->tokens.end(), out->begin() + n->start);
  }
  return Status::Ok();
}

Status KvCache::branch_page_table(BranchId id, std::vector<int32_t>* out) const {
  StatusOr<const Branch*> found = find(id);
  if (!found.ok()) return found.status();
  const Branch& b = **found;
  const int32_t ps = pool_.page_size();
  const int32_t base_page = b.base_len() / ps;
  out->assign(ceil_div(b.length(), ps), -1);
  for (int32_t k = base_page; k < static_cast<int32_t>(out->size()); ++k) {
    (*out)[k] = b.tail_pages[k - base_page];
  }
  // Deepest node first: where a split shares a page index, the deeper node's page also holds
  // valid copies of the earlier slots (the page rule), so it serves the whole page.
  for (const RadixNode* n = b.base; n->parent != nullptr; n = n->parent) {
    for (int32_t k = n->start / ps; k <= (n->end() - 1) / ps; ++k) {
      if ((*out)[k] < 0) (*out)[k] = n->pages[k - n->start / ps];
    }
  }
  return Status::Ok();
}

StatusOr<int32_t> KvCache::branch_shared_pages(BranchId id) const {
  StatusOr<const Branch*> found = find(id);
  if (!found.ok()) return found.status();
  std::vector<int32_t> table;
  TS_RETURN_IF_ERROR(branch_page_table(id, &table));
  // Page indices below base_len / ps are whole pages of radix nodes; the page holding
  // base_len is the tail's own unless the node lists it too (then its count is above 1).
  const int32_t whole_path_pages = (*found)->base_len() / pool_.page_size();
  int32_t shared = 0;
  for (int32_t k = 0; k < static_cast<int32_t>(table.size()); ++k) {
    if (k < whole_path_pages || pool_.ref_count(table[k]) > 1) ++shared;
  }
  return shared;
}

int32_t KvCache::match_prefix_length(std::span<const int32_t> tokens, CacheNamespace ns) const {
  const int32_t slot = find_namespace(ns);
  if (slot < 0) return 0;
  return tree_.match_prefix(tokens, static_cast<int32_t>(tokens.size()) - 1, namespaces_[slot].root)
      .length;
}

KvCacheStats KvCache::stats() const {
  KvCacheStats s;
  s.pages_total = pool_.num_pages();
  s.pages_free = pool_.num_free();
  s.pages_used = pool_.num_used();
  s.radix_cached_tokens = tree_.cached_tokens();
  s.radix_nodes = tree_.node_count();
  s.live_branches = live_branches_;
  std::vector<uint8_t> locked(pool_.num_pages(), 0);
  std::vector<int32_t> unlocked_refs(pool_.num_pages(), 0);
  tree_.for_each_node([&](const RadixNode& n) {
    for (int32_t page : n.pages) {
      if (n.lock_ref > 0) {
        locked[page] = 1;
      } else {
        ++unlocked_refs[page];
      }
    }
  });
  for (const Branch& b : branches_) {
    if (!b.live) continue;
    for (int32_t page : b.tail_pages) locked[page] = 1;
  }
  for (int32_t p = 0; p < pool_.num_pages(); ++p) {
    s.pages_locked += locked[p];
    s.pages_evictable += unlocked_refs[p] > 0 && unlocked_refs[p] == pool_.ref_count(p);
  }
  return s;
}

Status KvCache::check_invariants() const {
  TS_RETURN_IF_ERROR(pool_.check_invariants());
  TS_RETURN_IF_ERROR(tree_.check_invariants());
  std::vector<int32_t> expected_refs(pool_.num_pages(), 0);
  std::unordered_map<const RadixNode*, int32_t> direct_locks;
  int32_t live = 0;
  for (const Branch& b : branches_) {
    if (!b.live) continue;
    ++live;
    const int32_t end = b.length() + static_cast<int32_t>(b.draft_tokens.size());
    if (static_cast<int32_t>(b.tail_pages.size()) != tail_pages_for(b, end)) {
      return Internal("a branch tail lists the wrong number of pages");
    }
    if (b.draft_tokens.size() != b.draft_parents.size()) return Internal("draft arrays differ");
    for (int32_t page : b.tail_pages) ++expected_refs[page];
    ++direct_locks[b.base];
  }
  if (live != live_branches_) return Internal("live branch counter out of sync");
  Status status = Status::Ok();
  tree_.for_each_node([&](const RadixNode& n) {
    for (int32_t page : n.pages) ++expected_refs[page];
    int32_t locks = direct_locks.count(&n) ? direct_locks[&n] : 0;
    for (const auto& [token, child] : n.children) locks += child->lock_ref;
    if (locks != n.lock_ref && status.ok()) {
      status = Internal("radix node " + std::to_string(n.id) + " lock_ref " +
                        std::to_string(n.lock_ref) + " != " + std::to_string(locks));
    }
  });
  TS_RETURN_IF_ERROR(status);
  for (int32_t p = 0; p < pool_.num_pages(); ++p) {
    if (expected_refs[p] != pool_.ref_count(p)) {
      return Internal("page " + std::to_string(p) + " has " + std::to_string(pool_.ref_count(p)) +
                      " references, holders list " + std::to_string(expected_refs[p]));
    }
  }
  return check_namespaces();
}

}  // namespace treeserve
