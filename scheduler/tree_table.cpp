// A tree's tables and lease (loop thread): ids, adding and ending branches, removing trees,
// GetTree's pages, and the idle leases the loop expires.
//
// Only live branches are in a tree's tables. When a branch ends it leaves them at once, so a
// tree that has seen a million forks and prunes costs what its live branches cost. A branch
// only ends with live children when a beam search drops a beam whose continuations were
// forked earlier; those children then hang off the ended beam's parent, sharing with it the
// prefix the two had in common (the smaller fork offset). So a live branch's parent is always
// live, and each live branch owns the tokens [fork_offset, length) of the tree.
//
// Ended branches and removed trees are not freed at once: the step or command that ended them
// may still hold their pointers (a step's entries, a beam list). free_ended() frees them at
// the top of the next loop iteration, when nothing does.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <unordered_set>

#include "common/metrics.h"
#include "common/random_id.h"
#include "common/route_key.h"
#include "scheduler/detail/scheduler_impl.h"

namespace treeserve {

using Clock = std::chrono::steady_clock;

Status resolve_tree_id_options(SchedulerOptions* options) {
  if (options->replica_id.empty()) options->replica_id = kDefaultReplicaId;
  TS_RETURN_IF_ERROR(check_replica_id(options->replica_id, "replica_id"));
  if (options->incarnation.empty()) options->incarnation = new_incarnation();
  if (!parse_tree_id(make_tree_id("k", options->replica_id, options->incarnation))) {
    return InvalidArgument("incarnation: must be 8 lowercase hex digits");
  }
  return Status::Ok();
}

Tree* Scheduler::Impl::add_tree(bool one_shot, int64_t lease_ms, TenantState* owner,
                                const std::string& route) {
  auto tree = std::make_unique<Tree>();
  do {
    tree->id = make_tree_id(route, options_.replica_id, options_.incarnation);
  } while (trees_.count(tree->id));
  tree->owner = owner;
  tree->one_shot = one_shot;
  tree->counted = !one_shot;
  if (tree->counted) ++owner->live_trees;
  tree->seq = owner->next_tree_seq++;
  tree->created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  tree->lease = std::chrono::milliseconds(lease_ms);
  Tree* t = tree.get();
  trees_[t->id] = std::move(tree);
  touch(t);
  return t;
}

StatusOr<Tree*> Scheduler::Impl::find_tree(const std::string& id, const std::string& tenant) {
  auto it = trees_.find(id);
  // Another tenant's tree: the same answer as for an id never issued, after the same lookup.
  if (it == trees_.end() || it->second->owner->limits.tenant != tenant) {
    return NotFound("tree_id: unknown tree '" + id + "'");
  }
  touch(it->second.get());
  return it->second.get();
}

StatusOr<SchedBranch*> Scheduler::Impl::find_branch(Tree* tree, const std::string& id) {
  auto it = tree->by_id.find(id);
  if (it == tree->by_id.end()) {
    return NotFound("branch_id: unknown branch '" + id + "' in tree " + tree->id +
                    " (never created, or pruned)");
  }
  return it->second;
}

SchedBranch* Scheduler::Impl::add_branch(Tree* tree, SchedBranch* parent, int32_t fork_offset) {
  auto b = std::make_unique<SchedBranch>();
  b->index = tree->next_index++;
  do {
    b->id = random_id("b_");
  } while (tree->by_id.count(b->id));
  if (parent) {
    b->parent = parent->id;
    ++parent->children;
  }
  b->fork_offset = fork_offset;
  b->tree = tree;
  ++tree->owner->live_branches;
  SchedBranch* raw = b.get();
  tree->by_id[raw->id] = raw;
  tree->branches.emplace(raw->index, std::move(b));
  return raw;
}

// Ends the branch for good: its stream (if generating) learns why, pending work fails, its KV
// pages go back to the pool (or stay as evictable cache with retain_kv), and it leaves the
// tree's tables.
int64_t Scheduler::Impl::end_branch(SchedBranch* b, bool retain_kv, FinishReason reason) {
  if (!b->live) return 0;
  if (b->job) {
    GenerateJob* job = b->job;
    for (GenerateBranchState& st : job->branches) {
      if (st.branch == b && !st.finished) finish_job_branch(job, st, reason, nullptr);
    }
  }
  if (b->beam_job) {
    for (Beam& beam : b->beam_job->beams) {
      if (beam.branch == b) beam.branch = nullptr;
    }
    b->beam_job = nullptr;
  }
  if (b->verify) {
    VerifyJob* v = b->verify;
    v->done(FailedPrecondition("branch_id: branch " + b->id + " was pruned during Verify"));
    v->done = nullptr;
    v->branch = nullptr;
    b->verify = nullptr;
  }
  if (b->prefill) {
    PrefillJob* p = b->prefill;
    p->done(Cancelled("tree creation was cancelled"));
    p->done = nullptr;
    p->branch = nullptr;
    b->prefill = nullptr;
  }
  int64_t freed = static_cast<int64_t>(b->pending.size());
  if (b->kv) {
    StatusOr<PruneResult> r = kv_->prune(*b->kv, retain_kv);
    if (r.ok()) {
      freed += r->released_tokens + r->cached_tokens;
    } else {
      spdlog::error("tree={} branch={}: kv prune failed: {}", b->tree->id, b->id,
                    r.status().message());
    }
  }
  b->kv.reset();
  b->pending.clear();
  b->kv_len = 0;
  b->live = false;
  b->activity = Activity::kIdle;
  b->job = nullptr;

  Tree* t = b->tree;
  SchedBranch* parent = nullptr;
  if (!b->parent.empty()) {
    auto p = t->by_id.find(b->parent);
    if (p != t->by_id.end()) parent = p->second;
  }
  if (parent) --parent->children;
  if (b->children > 0) {
    // Only a dropped beam gets here (Prune ends descendants first): its children move up.
    for (auto& [index, c] : t->branches) {
      if (c->parent != b->id) continue;
      c->parent = b->parent;
      c->fork_offset = std::min(c->fork_offset, b->fork_offset);
      if (parent) ++parent->children;
    }
    b->children = 0;
  }
  t->by_id.erase(b->id);
  --t->owner->live_branches;
  auto it = t->branches.find(b->index);
  ended_branches_.push_back(std::move(it->second));
  t->branches.erase(it);
  if (metrics_) metrics_->prune_total->inc();
  return freed;
}

void Scheduler::Impl::remove_tree(Tree* tree, bool retain_kv, int64_t* freed) {
  // Newest first: children end before their parents, so nothing has to move up.
  std::vector<SchedBranch*> all;
  for (auto it = tree->branches.rbegin(); it != tree->branches.rend(); ++it) {
    all.push_back(it->second.get());
  }
  for (SchedBranch* b : all) *freed += end_branch(b, retain_kv, FinishReason::kPruned);
  // end_branch may have finished jobs of this tree; they close at their next step check,
  // but their branch pointers must not outlive the tree: detach them now.
  for (auto& job : jobs_) {
    if (job->tree == tree) {
      for (GenerateBranchState& st : job->branches) st.branch = nullptr;
      job->tree = nullptr;
      job->one_shot = false;
    }
  }
  if (tree->counted) --tree->owner->live_trees;
  tree->counted = false;
  auto it = trees_.find(tree->id);
  ended_trees_.push_back(std::move(it->second));
  trees_.erase(it);
  drop_dead_copies();
}

void Scheduler::Impl::drop_dead_copies() {
  // A fork's page copy waits for the next step; if the branch ended first, its page is free
  // and the copy is moot. Without this, forks and prunes with no step between them (an idle
  // tree being explored) would queue copies without bound.
  const PagePool& pool = kv_->pool();
  std::erase_if(deferred_copies_,
                [&](const StepPageCopy& c) { return pool.ref_count(c.dst_page) == 0; });
}

void Scheduler::Impl::free_ended() {
  entries_.clear();  // the last step's entries point at branches that may be freed here
  ended_branches_.clear();
  ended_trees_.clear();
}

void Scheduler::Impl::touch(Tree* tree) {
  if (tree->lease.count() <= 0) return;
  tree->expires = Clock::now() + tree->lease;
  next_lease_check_ = std::min(next_lease_check_, tree->expires);
}

void Scheduler::Impl::expire_leases() {
  const Clock::time_point now = Clock::now();
  if (now < next_lease_check_) return;
  // Trees with a call in flight do not expire: their lease restarts instead.
  std::unordered_set<const Tree*> busy;
  for (auto& j : jobs_) {
    if (j->tree) busy.insert(j->tree);
  }
  for (auto& p : prefills_) {
    if (p->done && p->branch) busy.insert(p->branch->tree);
  }
  for (auto& v : verifies_) {
    if (v->done && v->branch) busy.insert(v->branch->tree);
  }
  next_lease_check_ = Clock::time_point::max();
  std::vector<Tree*> expired;
  for (auto& [id, t] : trees_) {
    if (t->lease.count() <= 0) continue;
    if (t->expires <= now) {
      if (t->holds == 0 && !busy.count(t.get())) {
        expired.push_back(t.get());
        continue;
      }
      t->expires = now + t->lease;
    }
    next_lease_check_ = std::min(next_lease_check_, t->expires);
  }
  for (Tree* t : expired) {
    int64_t freed = 0;
    const std::string id = t->id;
    const int32_t branches = t->live_branches();
    const int64_t lease_ms = t->lease.count();
    // Its KV stays as evictable cache, as DeleteTree leaves it.
    remove_tree(t, options_.prefix_sharing, &freed);
    if (metrics_) metrics_->tree_leases_expired_total->inc();
    spdlog::info("tree={} lease of {} ms expired: deleted ({} branches, {} tokens)", id, lease_ms,
                 branches, freed);
  }
  if (!expired.empty()) update_gauges();
}

// A tree's totals: tokens (each live branch owns [fork_offset, length): its parent, live,
// holds the prefix), distinct KV pages, and its lease's expiry.
void Scheduler::Impl::tree_totals(const Tree& tree, TreeListing* out) {
  out->tree_id = tree.id;
  out->live_branches = tree.live_branches();
  std::vector<int32_t> pages, table;
  for (auto& [index, b] : tree.branches) {
    out->total_tokens += std::max(0, b->length() - b->fork_offset);
    if (b->kv && kv_->branch_page_table(*b->kv, &table).ok()) {
      pages.insert(pages.end(), table.begin(), table.end());
    }
  }
  std::sort(pages.begin(), pages.end());
  out->kv_pages = std::unique(pages.begin(), pages.end()) - pages.begin();
  if (tree.lease.count() > 0) {
    out->lease_ms = tree.lease.count();
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(tree.expires - Clock::now());
    const auto at = std::chrono::system_clock::now().time_since_epoch() + left;
    out->expires_at_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(at).count();
  }
  out->created_at_unix_ms = tree.created_unix_ms;
}

void Scheduler::Impl::describe_branch(const SchedBranch& b, BranchSummary* out,
                                      std::vector<int32_t>* ids) const {
  out->fork_offset = b.fork_offset;
  switch (b.activity) {
    case Activity::kIdle:
      out->state = BranchState::kIdle;
      break;
    case Activity::kPrefill:
      out->state = BranchState::kPrefill;
      break;
    case Activity::kGenerate:
      out->state = BranchState::kGenerating;
      break;
    case Activity::kVerify:
      out->state = BranchState::kVerifying;
      break;
    case Activity::kBeam:
      out->state = BranchState::kBeam;
      break;
  }
  out->finish_reason = b.last_finish;
  ids->clear();
  if (b.kv) {
    std::vector<int32_t> table;
    if (kv_->branch_page_table(*b.kv, &table).ok()) out->kv_pages = int32_t(table.size());
    StatusOr<int32_t> shared = kv_->branch_shared_pages(*b.kv);
    if (shared.ok()) out->shared_pages = *shared;
    (void)kv_->branch_tokens(*b.kv, ids);
  }
  ids->insert(ids->end(), b.pending.begin(), b.pending.end());
  const size_t from = std::min(ids->size(), size_t(std::max(0, b.fork_offset)));
  ids->erase(ids->begin(), ids->begin() + ptrdiff_t(from));
}

StatusOr<TreeSummary> Scheduler::Impl::cmd_get_tree(const std::string& tree_id,
                                                    const TreePage& page, const std::string& tenant,
                                                    std::vector<std::vector<int32_t>>* detail_ids) {
  StatusOr<Tree*> found = find_tree(tree_id, tenant);
  if (!found.ok()) return found.status();
  Tree* tree = *found;
  if (page.page_size < 0) return InvalidArgument("page_size: must be >= 0");
  // A page token is the creation index of the next branch to list.
  int32_t from = 0;
  if (!page.page_token.empty()) {
    const std::string& tok = page.page_token;
    auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), from);
    if (ec != std::errc() || end != tok.data() + tok.size() || from < 0 ||
        from > tree->next_index) {
      return InvalidArgument("page_token: '" + tok + "' is not a page token of tree " + tree->id);
    }
  }
  TreeSummary out;
  out.tree_id = tree->id;
  out.live_branches = tree->live_branches();
  auto it = tree->branches.lower_bound(from);
  for (; it != tree->branches.end(); ++it) {
    if (page.page_size > 0 && int32_t(out.branches.size()) >= page.page_size) break;
    const SchedBranch& b = *it->second;
    out.branches.push_back({b.id, b.parent, b.length(), true});
    if (page.detail && detail_ids != nullptr) {
      detail_ids->emplace_back();
      describe_branch(b, &out.branches.back(), &detail_ids->back());
    }
  }
  if (it != tree->branches.end()) out.next_page_token = std::to_string(it->first);
  TreeListing totals;
  tree_totals(*tree, &totals);
  out.total_tokens = totals.total_tokens;
  out.kv_pages = totals.kv_pages;
  out.lease_ms = totals.lease_ms;
  out.expires_at_unix_ms = totals.expires_at_unix_ms;
  return out;
}

Status Scheduler::Impl::cmd_hold_tree(const std::string& tree_id, int32_t delta,
                                      const std::string& tenant) {
  StatusOr<Tree*> tree = find_tree(tree_id, tenant);
  if (!tree.ok()) return tree.status();
  (*tree)->holds = std::max(0, (*tree)->holds + delta);
  return Status::Ok();
}

}  // namespace treeserve
