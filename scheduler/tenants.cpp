// Tenants on the loop thread: their cache namespaces (salts interned to namespace ids), their
// quotas (live trees, live branches, the KV pages of their namespace) and ListTrees.
//
// KV pages. A tenant's namespace has a page limit in the KV cache (kvcache/kv_cache.h): its
// live branches' pages and its own evictable cache together stay within it, and at the limit
// the namespace recycles its own cache (LRU) before it takes a page from the pool, so one
// tenant's cache never pushes out another's beyond the limits. Work that would pass the limit
// with nothing of the tenant's own running (so nothing of its own will free a page) is refused
// at the next step with the quota named (step.cpp); a request that could never fit its quota is
// refused at once. With limits that add up to at most the pool, every tenant can always reach
// its own; where they oversubscribe the pool, work short of pool pages waits as any work does.
#include <algorithm>
#include <charconv>
#include <cmath>

#include "scheduler/detail/scheduler_impl.h"

namespace treeserve {

CacheNamespace CacheSaltTable::intern(std::unordered_map<std::string, CacheNamespace>* table,
                                      const std::string& key) {
  auto [it, added] = table->emplace(key, next_);
  if (added) ++next_;
  return it->second;
}

CacheNamespace CacheSaltTable::salt(const std::string& salt) { return intern(&salts_, salt); }

CacheNamespace CacheSaltTable::private_to(const std::string& tenant) {
  return intern(&tenants_, tenant);
}

bool is_tenant_quota_refusal(const Status& status) {
  return status.code() == StatusCode::kResourceExhausted &&
         status.message().rfind("tenant", 0) == 0;
}

Status Scheduler::Impl::configure_tenants(const std::vector<TenantLimits>& tenants) {
  const int32_t pool = kv_->pool().num_pages();
  for (size_t i = 0; i < tenants.size(); ++i) {
    const TenantLimits& t = tenants[i];
    const std::string at = "tenants[" + std::to_string(i) + "]";
    if (t.tenant.empty()) return InvalidArgument(at + ".tenant: must not be empty");
    if (tenants_.count(t.tenant)) {
      return InvalidArgument(at + ".tenant: '" + t.tenant + "' is listed twice");
    }
    for (auto [field, value] : {std::pair<const char*, int32_t>{"max_live_trees", t.max_live_trees},
                                {"max_live_branches", t.max_live_branches},
                                {"kv_pages", t.kv_pages}}) {
      if (value < 0) return InvalidArgument(at + "." + field + ": must be >= 0 (0 = no limit)");
    }
    if (!(t.kv_share >= 0 && t.kv_share <= 1)) {
      return InvalidArgument(at + ".kv_share: must be in [0, 1] (0 = no limit)");
    }
    auto state = std::make_unique<TenantState>();
    state->limits = t;
    if (t.kv_pages == 0 && t.kv_share > 0) {
      state->limits.kv_pages = std::max<int32_t>(1, int32_t(std::floor(t.kv_share * pool)));
    }
    state->ns = t.cache_salt.empty() ? salts_.private_to(t.tenant) : salts_.salt(t.cache_salt);
    tenants_.emplace(t.tenant, std::move(state));
  }
  // A namespace's limit: the sum of its tenants' (tenants sharing a salt share the pages),
  // none when one of them has none.
  std::unordered_map<CacheNamespace, int64_t> limits;
  for (auto& [name, t] : tenants_) {
    auto [it, added] = limits.emplace(t->ns, t->limits.kv_pages);
    if (!added)
      it->second = it->second > 0 && t->limits.kv_pages > 0 ? it->second + t->limits.kv_pages : 0;
  }
  for (auto [ns, pages] : limits) {
    TS_RETURN_IF_ERROR(kv_->set_namespace_page_limit(ns, int32_t(std::min<int64_t>(pages, pool))));
  }
  return Status::Ok();
}

TenantState* Scheduler::Impl::tenant_state(const std::string& tenant) {
  auto it = tenants_.find(tenant);
  if (it != tenants_.end()) return it->second.get();
  auto state = std::make_unique<TenantState>();
  state->limits.tenant = tenant;
  return tenants_.emplace(tenant, std::move(state)).first->second.get();
}

Status Scheduler::Impl::check_tree_quota(const TenantState& t) const {
  const int32_t max = t.limits.max_live_trees;
  if (max <= 0 || t.live_trees < max) return Status::Ok();
  return ResourceExhausted("tenant '" + t.limits.tenant + "': live trees " +
                           std::to_string(t.live_trees) + " of " + std::to_string(max) +
                           " (quota max_live_trees); delete trees you no longer need");
}

Status Scheduler::Impl::check_branch_quota(const TenantState& t, int64_t more) const {
  const int32_t max = t.limits.max_live_branches;
  if (max <= 0 || t.live_branches + more <= max) return Status::Ok();
  return ResourceExhausted("tenant '" + t.limits.tenant + "': live branches " +
                           std::to_string(t.live_branches) + " of " + std::to_string(max) +
                           " (quota max_live_branches), " + std::to_string(more) +
                           " more needed; prune branches or delete trees");
}

// The names of the tenants of namespace `ns`, for messages: "tenant 'a'", or
// "tenants 'a', 'b' (one cache salt)".
static std::string namespace_tenants(
    const std::unordered_map<std::string, std::unique_ptr<TenantState>>& tenants,
    CacheNamespace ns) {
  std::vector<std::string> names;
  for (const auto& [name, t] : tenants) {
    if (t->ns == ns) names.push_back("'" + name + "'");
  }
  std::sort(names.begin(), names.end());
  if (names.size() == 1) return "tenant " + names.front();
  std::string out = "tenants ";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out + " (one cache salt)";
}

Status Scheduler::Impl::check_page_quota(const TenantState& t, int64_t pages,
                                         const std::string& what) const {
  const int32_t limit = kv_->namespace_stats(t.ns).page_limit;
  if (limit <= 0 || pages <= limit) return Status::Ok();
  return ResourceExhausted(namespace_tenants(tenants_, t.ns) + ": " + what + " needs " +
                           std::to_string(pages) + " KV pages, more than the quota of " +
                           std::to_string(limit) + " (quota kv_pages)");
}

Status Scheduler::Impl::namespace_limit_refusal(CacheNamespace ns) const {
  const NamespaceStats st = kv_->namespace_stats(ns);
  if (st.page_limit <= 0) return Status::Ok();
  // The limit is what stops the namespace when the pool could give it every page up to the
  // limit (free pages and any namespace's evictable cache); otherwise the pool is short.
  const PagePool& pool = kv_->pool();
  const int64_t supply = int64_t(pool.num_free()) + pool.num_used() - pool.num_locked();
  if (supply < int64_t(st.page_limit) - st.pages_locked) return Status::Ok();
  return ResourceExhausted(namespace_tenants(tenants_, ns) + ": KV pages " +
                           std::to_string(st.pages_locked) + " of " +
                           std::to_string(st.page_limit) +
                           " (quota kv_pages) held by live branches, and more needed; prune "
                           "branches or delete trees");
}

StatusOr<TreeList> Scheduler::Impl::cmd_list_trees(const std::string& tenant,
                                                   const TreePage& page) {
  // A page token is the creation number (among the tenant's trees) of the next tree to list.
  const uint64_t issued = tenant_state(tenant)->next_tree_seq;
  uint64_t from = 0;
  if (!page.page_token.empty()) {
    const std::string& tok = page.page_token;
    auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), from);
    if (ec != std::errc() || end != tok.data() + tok.size() || from > issued) {
      return InvalidArgument("page_token: '" + tok + "' is not a ListTrees page token");
    }
  }
  std::vector<const Tree*> mine;
  for (const auto& [id, t] : trees_) {
    if (t->counted && t->owner->limits.tenant == tenant && t->seq >= from) mine.push_back(t.get());
  }
  std::sort(mine.begin(), mine.end(), [](const Tree* a, const Tree* b) { return a->seq < b->seq; });
  TreeList out;
  for (const Tree* t : mine) {
    if (page.page_size > 0 && int32_t(out.trees.size()) >= page.page_size) {
      out.next_page_token = std::to_string(t->seq);
      break;
    }
    TreeListing listing;
    tree_totals(*t, &listing);
    out.trees.push_back(std::move(listing));
  }
  return out;
}

}  // namespace treeserve
