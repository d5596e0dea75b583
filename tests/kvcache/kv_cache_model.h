// KvCacheModel: an operation interpreter over KvCache with a shadow model, shared by the
// randomized property test (bytes from a seeded generator) and the fuzz target (bytes from
// libFuzzer or a replayed corpus).
//
// The shadow keeps every live branch's token sequence and a fake pool memory: one 64-bit
// value per (page, slot), written at the slots the cache hands out and updated for PageCopy
// and SlotMove exactly as the engine does. The value written for position p is a hash of the
// branch's cache namespace and tokens [0, p] (real K/V depends on the whole prefix; the salt
// stands for a tenant's private prompt), so reading a live branch back through its page table
// proves the sharing right: a page shared with the wrong prefix or across namespaces, a slot
// overwritten by another writer, a missed copy or a freed-and-reused page all show up.
//
// Branches live in a few cache namespaces; after every operation the per-namespace counts
// (namespace_stats) must add up to the global stats, match the shadow's live branches, cover
// every page the namespace's branches read, and never share a page with another namespace.
//
// Every check returns an empty string or a message naming what broke; callers (gtest,
// libFuzzer) decide how to fail.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/attention_plan.h"
#include "kvcache/kv_cache.h"
#include "tests/kvcache/kv_cache_model_util.h"

namespace treeserve::testing {

class KvCacheModel {
 public:
  static constexpr int32_t kMaxLive = 40;
  static constexpr int32_t kMaxLength = 160;

  // page_size and num_pages from the first bytes: small pools so exhaustion and
  // eviction happen often, page sizes that make mid-page positions common.
  static KvCacheConfig config_from(ByteSource& in) {
    static constexpr int32_t kPageSizes[] = {1, 2, 3, 4, 4, 8, 16, 5};
    KvCacheConfig config;
    config.page_size = kPageSizes[in.below(8)];
    // Mostly 1..96 pages; a quarter of the time 64..319, where eviction goes in batches.
    const uint8_t b = in.byte();
    config.num_pages = b < 192 ? 1 + b % 96 : 64 + in.byte();
    return config;
  }

  explicit KvCacheModel(const KvCacheConfig& config)
      : cache_(KvCache::create(config).value()),
        ps_(config.page_size),
        num_pages_(config.num_pages),
        mem_(static_cast<size_t>(config.num_pages) * config.page_size, 0) {}

  KvCache& cache() { return *cache_; }
  const KvOpCounts& counts() const { return counts_; }
  int32_t live_branches() const { return static_cast<int32_t>(live_.size()); }

  // One operation decoded from `in`, then the full check.
  std::string step(ByteSource& in) {
    ++step_;
    const int op_byte = in.byte();
    // Weights out of 34: appends most, then create/prune, the rest a few each.
    static constexpr int kTable[34] = {
        kOpCreate,  kOpCreate,   kOpCreate,   kOpCreate,        kOpAppend,    kOpAppend,
        kOpAppend,  kOpAppend,   kOpAppend,   kOpAppend,        kOpFork,      kOpFork,
        kOpFork,    kOpTruncate, kOpTruncate, kOpPrune,         kOpPrune,     kOpPrune,
        kOpPrune,   kOpEvict,    kOpMatch,    kOpTokenTree,     kOpTokenTree, kOpTokenTree,
        kOpAccept,  kOpAccept,   kOpAccept,   kOpView,          kOpView,      kOpBadCall,
        kOpBadCall, kOpTruncate, kOpLimit,    kOpEvictNamespace};
    int op = kTable[op_byte % 34];
    if (live_.empty() && op != kOpEvict && op != kOpMatch && op != kOpBadCall && op != kOpLimit &&
        op != kOpEvictNamespace) {
      op = kOpCreate;
    }
    if (live_branches() >= kMaxLive && (op == kOpCreate || op == kOpFork)) op = kOpPrune;
    const NamespaceSnapshot ns_before = namespace_snapshot(*cache_);
    std::string err;
    switch (op) {
      case kOpCreate:
        err = do_create(in);
        break;
      case kOpAppend:
        err = do_append(in);
        break;
      case kOpFork:
        err = do_fork(in);
        break;
      case kOpTruncate:
        err = do_truncate(in);
        break;
      case kOpPrune:
        err = do_prune(in);
        break;
      case kOpEvict:
        err = do_evict(in);
        break;
      case kOpMatch:
        err = do_match(in);
        break;
      case kOpTokenTree:
        err = do_token_tree(in);
        break;
      case kOpAccept:
        err = do_accept(in);
        break;
      case kOpView:
        err = do_view(in);
        break;
      case kOpLimit:
        err = do_limit(in);
        break;
      case kOpEvictNamespace:
        err = do_evict_namespace(in);
        break;
      default:
        err = do_bad_call(in);
        break;
    }
    if (err.empty() && op == kOpBadCall) ++counts_.ok[kOpBadCall];
    // A namespace whose pages grew took them through the limit check: it ends within its limit.
    for (int n = 0; n < kNumModelNamespaces && err.empty(); ++n) {
      const NamespaceStats after = ns_stats(n);
      const int32_t used = after.pages_locked + after.pages_evictable;
      if (after.page_limit > 0 && used > ns_before[n].pages_locked + ns_before[n].pages_evictable &&
          used > after.page_limit) {
        err = "namespace " + std::to_string(n) + " grew to " + std::to_string(used) +
              " pages, past its limit " + std::to_string(after.page_limit);
      }
    }
    if (err.empty()) err = check();
    if (!err.empty())
      return "step " + std::to_string(step_) + " op " + std::to_string(op) + ": " + err;
    return {};
  }

  // Prunes every live branch (retain_kv as given), checks that nothing is locked, evicts all
  // and checks that every page is free.
  std::string drain(bool retain) {
    while (!live_.empty()) {
      StatusOr<PruneResult> r = cache_->prune(live_.back().id, retain);
      if (!r.ok()) return "drain prune: " + r.status().ToString();
      dead_.push_back(live_.back().id);
      live_.pop_back();
      if (std::string err = check(); !err.empty()) return "drain: " + err;
    }
    KvCacheStats s = cache_->stats();
    if (s.pages_locked != 0)
      return "idle cache has " + std::to_string(s.pages_locked) + " locked pages";
    if (s.live_branches != 0) return "idle cache has live branches";
    cache_->evict_all();
    s = cache_->stats();
    if (s.pages_free != s.pages_total || s.pages_used != 0) {
      return "after evict_all " + std::to_string(s.pages_free) + " of " +
             std::to_string(s.pages_total) + " pages free";
    }
    if (s.radix_nodes != 0 || s.radix_cached_tokens != 0 || s.pages_evictable != 0) {
      return "after evict_all the radix tree is not empty";
    }
    for (int n = 0; n < kNumModelNamespaces; ++n) {
      const NamespaceStats ns = ns_stats(n);
      if (ns.pages_locked != 0 || ns.pages_evictable != 0 || ns.live_branches != 0) {
        return "after evict_all namespace " + std::to_string(n) + " still holds pages";
      }
    }
    return check();
  }

  // Invariants, accounting, and every live branch read back (tokens, page table, KV).
  std::string check() {
    if (Status st = cache_->check_invariants(); !st.ok()) return "invariants: " + st.ToString();
    const KvCacheStats s = cache_->stats();
    if (s.pages_free + s.pages_used != s.pages_total) return "free + used != total";
    // A used page is held by a live branch (path or tail) or only by unlocked cached nodes.
    if (s.pages_locked + s.pages_evictable != s.pages_used) return "locked + evictable != used";
    if (s.live_branches != live_branches()) return "live branch count differs from the shadow";
    if (std::string err = check_namespaces(s); !err.empty()) return err;
    const PagePool& pool = cache_->pool();
    std::vector<int32_t> tokens, table;
    for (const ShadowBranch& b : live_) {
      const std::string who = "branch " + std::to_string(b.id);
      if (Status st = cache_->branch_tokens(b.id, &tokens); !st.ok())
        return who + ": " + st.ToString();
      if (tokens != b.tokens) return who + ": tokens read back differ from the shadow";
      StatusOr<int32_t> len = cache_->branch_length(b.id);
      if (!len.ok() || *len != static_cast<int32_t>(b.tokens.size())) return who + ": bad length";
      if (Status st = cache_->branch_page_table(b.id, &table); !st.ok())
        return who + ": " + st.ToString();
      const int32_t n = static_cast<int32_t>(b.tokens.size());
      if (static_cast<int32_t>(table.size()) != (n + ps_ - 1) / ps_)
        return who + ": page table size";
      for (int32_t k = 0; k < static_cast<int32_t>(table.size()); ++k) {
        if (table[k] < 0 || table[k] >= pool.num_pages() || pool.ref_count(table[k]) <= 0) {
          return who + ": page table lists a free or bad page at index " + std::to_string(k);
        }
      }
      for (int32_t p = 0; p < n; ++p) {
        if (mem_[slot_index(table[p / ps_], p % ps_)] != b.kv[p]) {
          return who + ": KV at position " + std::to_string(p) + " (page " +
                 std::to_string(table[p / ps_]) + ") is not this branch's";
        }
      }
    }
    return {};
  }

 private:
  struct ShadowBranch {
    BranchId id = 0;
    int ns = 0;  // index into kModelNamespaces
    std::vector<int32_t> tokens;
    std::vector<uint64_t> kv;  // kv[p] = hash of tokens [0, p]
    std::vector<int32_t> draft_tokens, draft_parents;
    std::vector<uint64_t> draft_kv;
  };

  size_t slot_index(int32_t page, int32_t slot) const {
    return static_cast<size_t>(page) * ps_ + slot;
  }
  size_t slot_index(const KvSlot& s) const { return slot_index(s.page, s.slot); }

  int32_t token(ByteSource& in) {
    // Mostly a 3-letter alphabet so prompts share prefixes and split radix nodes.
    const uint8_t b = in.byte();
    return b < 224 ? b % 3 : 3 + b % 29;
  }
  static void extend_kv(ShadowBranch& b) {
    while (b.kv.size() < b.tokens.size()) {
      const uint64_t prev =
          b.kv.empty() ? kv_hash(0x51ed27ull, static_cast<int32_t>(b.ns)) : b.kv.back();
      b.kv.push_back(kv_hash(prev, b.tokens[b.kv.size()]));
    }
  }
  int32_t pick(ByteSource& in) { return static_cast<int32_t>(in.below(live_.size())); }
  NamespaceStats ns_stats(int n) const { return cache_->namespace_stats(kModelNamespaces[n]); }
  // `like` three times in four, else any namespace.
  int pick_namespace(ByteSource& in, int like) {
    return in.below(4) != 0 ? like : static_cast<int>(in.below(kNumModelNamespaces));
  }
  std::string check_namespaces(const KvCacheStats& s) {
    std::vector<std::pair<BranchId, int>> live;
    for (const ShadowBranch& b : live_) live.emplace_back(b.id, b.ns);
    return check_namespace_counts(*cache_, s, live);
  }

  std::string apply_copies(const std::vector<PageCopy>& copies) {
    for (const PageCopy& c : copies) {
      if (c.num_slots < 1 || c.num_slots >= ps_) return "PageCopy of a page-aligned or empty run";
      for (int32_t s = 0; s < c.num_slots; ++s)
        mem_[slot_index(c.dst_page, s)] = mem_[slot_index(c.src_page, s)];
      ++counts_.copies;
    }
    return {};
  }
  std::string write(const ShadowBranch& b, int32_t first, const std::vector<KvSlot>& slots) {
    if (first + slots.size() != b.kv.size()) return "wrong number of slots returned";
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].slot != (first + static_cast<int32_t>(i)) % ps_)
        return "slot breaks p % page_size";
      mem_[slot_index(slots[i])] = b.kv[first + i];
    }
    return {};
  }
  // RESOURCE_EXHAUSTED must change nothing and be honest: `need` pages were not available
  // even after evicting every unlocked prefix, or they would take namespace `ns`'s locked
  // pages past its limit. need < 0 skips the honesty check.
  std::string exhausted(const Status& st, const KvCacheStats& before, int32_t need, int ns = -1,
                        const NamespaceStats* ns_before = nullptr) {
    if (st.code() != StatusCode::kResourceExhausted) return "unexpected error " + st.ToString();
    if (!same_stats(before, cache_->stats())) return "RESOURCE_EXHAUSTED changed the stats";
    if (ns_before != nullptr && !same_ns_stats(*ns_before, ns_stats(ns))) {
      return "RESOURCE_EXHAUSTED changed the namespace's counts";
    }
    const bool over_limit = ns_before != nullptr && ns_before->page_limit > 0 && need >= 0 &&
                            ns_before->pages_locked + need > ns_before->page_limit;
    if (over_limit) {
      if (st.message().find("limit") == std::string::npos) {
        return "a refusal at the page limit does not name it: " + st.ToString();
      }
      ++counts_.limit_refusals;
    } else if (need >= 0 && need <= before.pages_free + before.pages_evictable) {
      return "RESOURCE_EXHAUSTED although " + std::to_string(need) + " <= free " +
             std::to_string(before.pages_free) + " + evictable " +
             std::to_string(before.pages_evictable) + ": " + st.ToString();
    }
    ++counts_.exhausted;
    return {};
  }
  int32_t pages_between(int32_t from, int32_t to) const {
    return (to + ps_ - 1) / ps_ - (from + ps_ - 1) / ps_;
  }

  std::string do_create(ByteSource& in) {
    std::vector<int32_t> prompt;
    const int source = in.below(4);
    int ns = static_cast<int>(in.below(kNumModelNamespaces));
    if (source < 2 && !live_.empty()) {
      const ShadowBranch& b = live_[pick(in)];
      prompt.assign(b.tokens.begin(), b.tokens.begin() + in.in(0, b.tokens.size()));
      ns = pick_namespace(in, b.ns);
    } else if (source == 2 && !history_.empty()) {
      const auto& [h_ns, h] = history_[in.below(history_.size())];
      prompt.assign(h.begin(), h.begin() + in.in(0, h.size()));
      ns = pick_namespace(in, h_ns);
    }
    const int32_t extra = in.in(1, 2 * ps_ + 3);
    for (int32_t i = 0; i < extra && static_cast<int32_t>(prompt.size()) < kMaxLength; ++i) {
      prompt.push_back(token(in));
    }
    if (prompt.empty()) prompt.push_back(token(in));
    const CacheNamespace id = kModelNamespaces[ns];
    const int32_t predicted = cache_->match_prefix_length(prompt, id);
    const KvCacheStats before = cache_->stats();
    const NamespaceStats ns_before = ns_stats(ns);
    const int32_t namespaces = cache_->namespace_count();
    StatusOr<NewBranch> r = cache_->create_branch(prompt, id);
    if (!r.ok()) {
      if (cache_->namespace_count() != namespaces) return "a refused create left a namespace";
      return exhausted(r.status(), before, -1, ns, &ns_before);
    }
    if (r->cached_tokens != predicted) return "cached_tokens != match_prefix_length";
    if (r->copies.size() > 1) return "create_branch copied more than one page";
    if (StatusOr<CacheNamespace> got = cache_->branch_namespace(r->id); !got.ok() || *got != id) {
      return "create_branch put the branch in the wrong namespace";
    }
    ShadowBranch b;
    b.id = r->id;
    b.ns = ns;
    b.tokens = prompt;
    extend_kv(b);
    if (std::string e = apply_copies(r->copies); !e.empty()) return e;
    if (std::string e = write(b, r->cached_tokens, r->slots); !e.empty()) return e;
    live_.push_back(std::move(b));
    counts_.cached_tokens += r->cached_tokens;
    ++counts_.ok[kOpCreate];
    return {};
  }

  std::string do_append(ByteSource& in) {
    ShadowBranch& b = live_[pick(in)];
    const int32_t len = static_cast<int32_t>(b.tokens.size());
    std::vector<int32_t> tokens(in.in(1, ps_ + 2));
    for (int32_t& t : tokens) t = token(in);
    if (len + static_cast<int32_t>(tokens.size()) > kMaxLength) return do_truncate(in);
    const KvCacheStats before = cache_->stats();
    const NamespaceStats ns_before = ns_stats(b.ns);
    std::vector<KvSlot> slots;
    Status st = cache_->append(b.id, tokens, &slots);
    if (!b.draft_tokens.empty()) return expect_code(st, StatusCode::kFailedPrecondition, before);
    if (!st.ok()) {
      return exhausted(st, before, pages_between(len, len + static_cast<int32_t>(tokens.size())),
                       b.ns, &ns_before);
    }
    b.tokens.insert(b.tokens.end(), tokens.begin(), tokens.end());
    extend_kv(b);
    ++counts_.ok[kOpAppend];
    return write(b, len, slots);
  }

  std::string do_fork(ByteSource& in) {
    const int32_t i = pick(in);
    const int32_t len = static_cast<int32_t>(live_[i].tokens.size());
    const int32_t n = in.in(1, 4);
    const int32_t at_length = in.below(3) == 0 ? 0 : in.in(1, len);
    const int32_t at = at_length == 0 ? len : at_length;
    const KvCacheStats before = cache_->stats();
    const int ns = live_[i].ns;
    const NamespaceStats ns_before = ns_stats(ns);
    StatusOr<ForkResult> r = cache_->fork(live_[i].id, n, at_length);
    if (!live_[i].draft_tokens.empty()) {
      return expect_code(r.ok() ? Status::Ok() : r.status(), StatusCode::kFailedPrecondition,
                         before);
    }
    if (!r.ok()) return exhausted(r.status(), before, at % ps_ != 0 ? n : 0, ns, &ns_before);
    if (static_cast<int32_t>(r->branches.size()) != n) return "fork returned the wrong count";
    const size_t want_copies = at % ps_ != 0 ? n : 0;
    if (r->copies.size() != want_copies) return "fork returned the wrong number of copies";
    for (const PageCopy& c : r->copies) {
      if (c.num_slots != at % ps_) return "fork copy num_slots != at % page_size";
    }
    if (cache_->stats().pages_used - before.pages_used > static_cast<int32_t>(want_copies)) {
      return "fork allocated more than one page per new branch";
    }
    if (std::string e = apply_copies(r->copies); !e.empty()) return e;
    for (BranchId id : r->branches) {
      if (StatusOr<CacheNamespace> got = cache_->branch_namespace(id);
          !got.ok() || *got != kModelNamespaces[ns]) {
        return "a fork left its parent's namespace";
      }
      ShadowBranch c;
      c.id = id;
      c.ns = ns;
      c.tokens.assign(live_[i].tokens.begin(), live_[i].tokens.begin() + at);
      c.kv.assign(live_[i].kv.begin(), live_[i].kv.begin() + at);
      live_.push_back(std::move(c));
    }
    ++counts_.ok[kOpFork];
    return {};
  }

  std::string do_truncate(ByteSource& in) {
    ShadowBranch& b = live_[pick(in)];
    const int32_t len = static_cast<int32_t>(b.tokens.size());
    const int32_t new_length = in.in(1, len);
    const KvCacheStats before = cache_->stats();
    const NamespaceStats ns_before = ns_stats(b.ns);
    StatusOr<TruncateResult> r = cache_->truncate(b.id, new_length);
    if (!b.draft_tokens.empty()) {
      return expect_code(r.ok() ? Status::Ok() : r.status(), StatusCode::kFailedPrecondition,
                         before);
    }
    if (!r.ok()) return exhausted(r.status(), before, 1, b.ns, &ns_before);
    if (r->copies.size() > 1) return "truncate copied more than one page";
    if (std::string e = apply_copies(r->copies); !e.empty()) return e;
    b.tokens.resize(new_length);
    b.kv.resize(new_length);
    ++counts_.ok[kOpTruncate];
    return {};
  }

  std::string do_prune(ByteSource& in) {
    const int32_t i = pick(in);
    const bool retain = in.below(2) == 0;
    const KvCacheStats before = cache_->stats();
    StatusOr<PruneResult> r = cache_->prune(live_[i].id, retain);
    if (!r.ok()) return "prune failed: " + r.status().ToString();
    const KvCacheStats after = cache_->stats();
    if (after.pages_free - before.pages_free != r->freed_pages) return "prune freed_pages is wrong";
    std::vector<int32_t> tokens = std::move(live_[i].tokens);
    const int ns = live_[i].ns;
    dead_.push_back(live_[i].id);
    live_.erase(live_.begin() + i);
    if (retain) {
      // Everything the branch computed is now a cached prefix of its namespace.
      tokens.push_back(1 << 30);
      if (cache_->match_prefix_length(tokens, kModelNamespaces[ns]) !=
          static_cast<int32_t>(tokens.size()) - 1) {
        return "retain_kv prune did not cache the branch's tokens";
      }
      tokens.pop_back();
      history_.emplace_back(ns, std::move(tokens));
      if (history_.size() > 16) history_.erase(history_.begin());
    }
    ++counts_.ok[kOpPrune];
    return {};
  }

  std::string do_evict(ByteSource& in) {
    const KvCacheStats before = cache_->stats();
    if (in.below(4) == 0) {
      const int32_t freed = cache_->evict_all();
      if (freed != before.pages_evictable) return "evict_all freed != pages_evictable";
      if (cache_->stats().pages_evictable != 0) return "evictable pages left after evict_all";
    } else {
      const int32_t want = in.in(0, before.pages_evictable + 2);
      const bool ok = cache_->evict(want);
      const KvCacheStats after = cache_->stats();
      if (ok != (want <= before.pages_evictable)) return "evict result disagrees with evictable";
      if (ok && after.pages_free - before.pages_free < want) return "evict freed too few pages";
      if (!ok && !same_stats(before, after)) return "failed evict changed the cache";
    }
    ++counts_.ok[kOpEvict];
    return {};
  }

  std::string do_match(ByteSource& in) {
    // A live branch's tokens are at least cached up to its locked base; nothing is changed.
    const KvCacheStats before = cache_->stats();
    std::vector<int32_t> tokens;
    if (!live_.empty() && in.below(2) == 0) tokens = live_[pick(in)].tokens;
    const int32_t extra = in.in(0, 6);
    for (int32_t i = 0; i < extra; ++i) tokens.push_back(token(in));
    const int32_t namespaces = cache_->namespace_count();
    const int32_t m =
        cache_->match_prefix_length(tokens, kModelNamespaces[in.below(kNumModelNamespaces)]);
    if (m < 0 || m > std::max<int32_t>(0, static_cast<int32_t>(tokens.size()) - 1)) {
      return "match_prefix_length out of range";
    }
    if (!same_stats(before, cache_->stats()) || cache_->namespace_count() != namespaces) {
      return "match_prefix_length changed the cache";
    }
    ++counts_.ok[kOpMatch];
    return {};
  }

  std::string do_token_tree(ByteSource& in) {
    ShadowBranch& b = live_[pick(in)];
    const int32_t len = static_cast<int32_t>(b.tokens.size());
    const int32_t t = in.in(1, 2 * ps_ + 2);
    std::vector<int32_t> tokens(t), parents(t);
    for (int32_t i = 0; i < t; ++i) {
      tokens[i] = token(in);
      parents[i] = i == 0 ? -1 : in.in(-1, i - 1);
    }
    const KvCacheStats before = cache_->stats();
    const NamespaceStats ns_before = ns_stats(b.ns);
    std::vector<KvSlot> slots;
    Status st = cache_->append_token_tree(b.id, tokens, parents, &slots);
    if (!b.draft_tokens.empty()) return expect_code(st, StatusCode::kFailedPrecondition, before);
    if (!st.ok()) return exhausted(st, before, pages_between(len, len + t), b.ns, &ns_before);
    if (static_cast<int32_t>(slots.size()) != t) return "token tree: wrong number of slots";
    b.draft_tokens = tokens;
    b.draft_parents = parents;
    b.draft_kv.resize(t);
    for (int32_t i = 0; i < t; ++i) {
      const uint64_t prev = parents[i] < 0 ? b.kv.back() : b.draft_kv[parents[i]];
      b.draft_kv[i] = kv_hash(prev, tokens[i]);
      if (slots[i].slot != (len + i) % ps_) return "draft slot breaks (length + i) % page_size";
      mem_[slot_index(slots[i])] = b.draft_kv[i];
    }
    ++counts_.ok[kOpTokenTree];
    return {};
  }

  std::string do_accept(ByteSource& in) {
    ShadowBranch& b = live_[pick(in)];
    const KvCacheStats before = cache_->stats();
    std::vector<int32_t> path;
    if (!b.draft_tokens.empty() && in.below(5) != 0) {
      for (int32_t d = in.below(b.draft_tokens.size()); d >= 0; d = b.draft_parents[d])
        path.push_back(d);
      std::reverse(path.begin(), path.end());
      if (in.below(8) == 0) path.resize(in.below(path.size() + 1));  // a prefix is a chain too
    }
    std::vector<SlotMove> moves;
    Status st = cache_->accept(b.id, path, &moves);
    if (b.draft_tokens.empty()) return expect_code(st, StatusCode::kFailedPrecondition, before);
    if (!st.ok()) return "accept failed: " + st.ToString();
    for (const SlotMove& m : moves) {
      mem_[slot_index(m.dst)] = mem_[slot_index(m.src)];
      ++counts_.moves;
    }
    for (int32_t d : path) {
      b.tokens.push_back(b.draft_tokens[d]);
      b.kv.push_back(b.draft_kv[d]);
    }
    b.draft_tokens.clear();
    b.draft_parents.clear();
    b.draft_kv.clear();
    if (cache_->stats().pages_used > before.pages_used) return "accept allocated pages";
    ++counts_.ok[kOpAccept];
    return {};
  }

  std::string do_view(ByteSource& in) {
    // A random subset of live branches, each with a few query tokens (or none, with drafts).
    std::vector<ViewQuery> queries;
    std::vector<int32_t> who;
    for (int32_t i = 0; i < live_branches(); ++i) {
      if (in.below(3) == 0) continue;
      const ShadowBranch& b = live_[i];
      const int32_t len = static_cast<int32_t>(b.tokens.size());
      int32_t n = in.below(4) == 0 ? in.in(1, len) : std::min(len, 1);
      if (!b.draft_tokens.empty() && in.below(3) == 0) n = 0;
      queries.push_back({b.id, n});
      who.push_back(i);
    }
    Status st = cache_->build_attention_view(queries, &view_);
    if (!st.ok()) return "build_attention_view: " + st.ToString();
    if (Status v = validate_attention_view(view_, cache_->pool().num_pages()); !v.ok()) {
      return "validate_attention_view: " + v.ToString();
    }
    // Expected KV of each row, in row order: a branch's query tokens, then its drafts.
    std::vector<std::vector<uint64_t>> expected;
    for (size_t q = 0; q < queries.size(); ++q) {
      const ShadowBranch& b = live_[who[q]];
      const int32_t len = static_cast<int32_t>(b.tokens.size());
      for (int32_t p = len - queries[q].num_tokens; p < len; ++p) {
        expected.emplace_back(b.kv.begin(), b.kv.begin() + p + 1);
      }
      for (size_t d = 0; d < b.draft_tokens.size(); ++d) {
        std::vector<uint64_t> chain;
        for (int32_t x = static_cast<int32_t>(d); x >= 0; x = b.draft_parents[x])
          chain.push_back(b.draft_kv[x]);
        std::vector<uint64_t> seen(b.kv.begin(), b.kv.end());
        seen.insert(seen.end(), chain.rbegin(), chain.rend());
        expected.push_back(std::move(seen));
      }
    }
    if (view_.queries.size() != expected.size()) return "view has the wrong number of queries";
    std::vector<uint8_t> row_seen(expected.size(), 0);
    std::vector<int64_t> ids;
    for (const KvNodeRun& n : view_.nodes) {
      if (n.node_id >= 0) ids.push_back(n.node_id);
    }
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) return "view lists a run twice";
    std::vector<uint64_t> seen;
    for (const AttentionQuery& q : view_.queries) {
      if (q.row < 0 || q.row >= static_cast<int32_t>(expected.size()) || row_seen[q.row]++) {
        return "view query rows are not a permutation";
      }
      // Visible KV: the leaf's first leaf_tokens tokens and all of every ancestor run.
      seen.clear();
      for (int32_t n = q.leaf, count = q.leaf_tokens; n >= 0; n = view_.nodes[n].parent) {
        const KvNodeRun& run = view_.nodes[n];
        if (n != q.leaf) count = run.num_tokens;
        for (int32_t t = count - 1; t >= 0; --t) {
          const int32_t s = run.first_slot + t;
          seen.push_back(mem_[slot_index(view_.pages[run.page_begin + s / ps_], s % ps_)]);
        }
      }
      std::reverse(seen.begin(), seen.end());
      if (seen != expected[q.row])
        return "view row " + std::to_string(q.row) + " sees the wrong KV";
    }
    ++counts_.ok[kOpView];
    return {};
  }

  // A page limit for a namespace (0 a third of the time: none), or a reservation against it.
  std::string do_limit(ByteSource& in) {
    const int ns = static_cast<int>(in.below(kNumModelNamespaces));
    const CacheNamespace id = kModelNamespaces[ns];
    const KvCacheStats before = cache_->stats();
    const NamespaceSnapshot all_before = namespace_snapshot(*cache_);
    const NamespaceStats& mine = all_before[ns];
    if (in.below(3) == 0) {
      const int32_t pages = in.in(0, num_pages_ / 2 + 2);
      Status st = cache_->reserve_pages(id, pages);
      if (!st.ok()) return exhausted(st, before, pages, ns, &mine);
      const NamespaceStats after = ns_stats(ns);
      if (cache_->stats().pages_free < pages) return "reserve_pages left too few free pages";
      if (after.page_limit > 0 && pages > 0 &&
          after.pages_locked + after.pages_evictable + pages > after.page_limit) {
        return "reserve_pages left no room under the namespace's limit";
      }
      ++counts_.ok[kOpLimit];
      return {};
    }
    const int32_t limit = in.below(3) == 0 ? 0 : in.in(1, num_pages_);
    if (Status st = cache_->set_namespace_page_limit(id, limit); !st.ok()) {
      return "set_namespace_page_limit: " + st.ToString();
    }
    const NamespaceStats after = ns_stats(ns);
    if (after.page_limit != limit) return "page_limit not set";
    if (after.pages_locked != mine.pages_locked || after.live_branches != mine.live_branches) {
      return "set_namespace_page_limit changed locked pages or branches";
    }
    // The namespace's cache shrinks to the limit where it can, and only its cache.
    const int32_t used = after.pages_locked + after.pages_evictable;
    if (limit > 0 && after.pages_evictable > 0 && used > limit) {
      return "set_namespace_page_limit left cache above the limit";
    }
    if (limit == 0 && after.pages_evictable != mine.pages_evictable) {
      return "removing a limit evicted cache";
    }
    if (std::string e = others_unchanged(*cache_, all_before, ns, "set_namespace_page_limit");
        !e.empty()) {
      return e;
    }
    ++counts_.ok[kOpLimit];
    return {};
  }

  // Drops one namespace's cache: exactly its evictable pages, nothing of the others.
  std::string do_evict_namespace(ByteSource& in) {
    const int ns = static_cast<int>(in.below(kNumModelNamespaces));
    const KvCacheStats before = cache_->stats();
    const NamespaceSnapshot all_before = namespace_snapshot(*cache_);
    const int32_t freed = cache_->evict_namespace(kModelNamespaces[ns]);
    const NamespaceStats after = ns_stats(ns);
    if (freed != all_before[ns].pages_evictable) return "evict_namespace freed != its evictable";
    if (cache_->stats().pages_free - before.pages_free != freed) return "evict_namespace count";
    if (after.pages_evictable != 0 || after.pages_locked != all_before[ns].pages_locked ||
        after.live_branches != all_before[ns].live_branches) {
      return "evict_namespace left cache or changed live pages";
    }
    if (std::string e = others_unchanged(*cache_, all_before, ns, "evict_namespace"); !e.empty())
      return e;
    ++counts_.ok[kOpEvictNamespace];
    return {};
  }

  std::string expect_code(const Status& st, StatusCode code, const KvCacheStats& before) {
    if (st.code() != code) {
      return std::string("expected ") + StatusCodeName(code) + ", got " + st.ToString();
    }
    if (!same_stats(before, cache_->stats())) return "a refused call changed the cache";
    if (cache_->namespace_count() > kNumModelNamespaces) return "a refused call made a namespace";
    ++counts_.rejected;
    return {};
  }

  std::string do_bad_call(ByteSource& in) {
    const KvCacheStats before = cache_->stats();
    std::vector<KvSlot> slots;
    const std::vector<int32_t> one{7};
    const int kind = in.below(7);
    if (kind == 6) {  // negative page counts, any namespace
      const CacheNamespace ns = kModelNamespaces[in.below(kNumModelNamespaces)];
      Status st = in.below(2) ? cache_->set_namespace_page_limit(ns, -1 - in.in(0, 3))
                              : cache_->reserve_pages(ns, -1);
      return expect_code(st, StatusCode::kInvalidArgument, before);
    }
    if (kind == 0) {  // ids never handed out
      const BranchId bogus[] = {0, -5, (BranchId{0x7fff0000} << 32) | 1,
                                (BranchId{1} << 32) | 100000};
      return expect_code(cache_->append(bogus[in.below(4)], one, &slots), StatusCode::kNotFound,
                         before);
    }
    if (kind == 1) {
      if (dead_.empty()) return {};
      const BranchId id = dead_[in.below(dead_.size())];
      Status st = in.below(2) ? cache_->append(id, one, &slots) : cache_->prune(id, true).status();
      return expect_code(st, StatusCode::kFailedPrecondition, before);
    }
    if (kind == 2) {
      return expect_code(cache_->create_branch({}).status(), StatusCode::kInvalidArgument, before);
    }
    if (live_.empty()) return {};
    const ShadowBranch& b = live_[pick(in)];
    const int32_t len = static_cast<int32_t>(b.tokens.size());
    if (kind == 3) {
      Status st =
          in.below(2) ? cache_->fork(b.id, 0).status() : cache_->fork(b.id, 1, len + 1).status();
      return expect_code(st, StatusCode::kInvalidArgument, before);
    }
    if (kind == 4) {
      Status st = cache_->truncate(b.id, in.below(2) ? 0 : len + 1).status();
      return expect_code(st, StatusCode::kInvalidArgument, before);
    }
    const std::vector<int32_t> parents{0};  // a draft cannot be its own parent
    return expect_code(cache_->append_token_tree(b.id, one, parents, &slots),
                       StatusCode::kInvalidArgument, before);
  }

  std::unique_ptr<KvCache> cache_;
  int32_t ps_;
  int32_t num_pages_;
  std::vector<uint64_t> mem_;  // [num_pages * page_size] fake pool memory
  std::vector<ShadowBranch> live_;
  std::vector<BranchId> dead_;
  // Sequences cached by retain_kv prunes, with their namespace.
  std::vector<std::pair<int, std::vector<int32_t>>> history_;
  AttentionView view_;
  KvOpCounts counts_;
  int64_t step_ = 0;
};

// Interprets a whole byte string: config, up to max_ops operations, then a drain. Returns an
// empty string or the first broken property.
inline std::string run_kv_cache_program(std::span<const uint8_t> bytes, int64_t max_ops,
                                        KvOpCounts* counts = nullptr) {
  ByteSource in(bytes);
  const KvCacheConfig config = KvCacheModel::config_from(in);
  KvCacheModel model(config);
  std::string err;
  for (int64_t i = 0; i < max_ops && !in.empty() && err.empty(); ++i) err = model.step(in);
  if (err.empty()) err = model.drain(/*retain=*/in.below(2) == 0);
  if (counts != nullptr) {
    const KvOpCounts& c = model.counts();
    for (int op = 0; op < kNumKvOps; ++op) counts->ok[op] += c.ok[op];
    counts->exhausted += c.exhausted;
    counts->rejected += c.rejected;
    counts->copies += c.copies;
    counts->moves += c.moves;
    counts->cached_tokens += c.cached_tokens;
    counts->limit_refusals += c.limit_refusals;
  }
  if (!err.empty()) {
    std::ostringstream os;
    os << "page_size " << config.page_size << " num_pages " << config.num_pages << ": " << err;
    return os.str();
  }
  return {};
}

}  // namespace treeserve::testing
