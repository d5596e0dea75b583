// Scheduler commands: the tree and branch operations, run on the loop thread between steps.
// The step itself (batching, forward, sampling, stop conditions) is in step.cpp.
#include "scheduler/scheduler.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <future>
#include <set>
#include <unordered_set>

#include "common/metrics.h"
#include "common/route_key.h"
#include "models/tokenizer.h"
#include "scheduler/detail/scheduler_impl.h"

namespace treeserve {

// ---------------------------------------------------------------- GenerateStream

GenerateStream::Wait GenerateStream::next(TokenEvent* event, Status* final_status,
                                          std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty() || closed_; })) {
    return Wait::kTimeout;
  }
  if (!events_.empty()) {
    *event = std::move(events_.front());
    events_.pop_front();
    return Wait::kEvent;
  }
  *final_status = final_;
  return Wait::kEnd;
}

void GenerateStream::cancel() {
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    fn = std::move(on_cancel_);
    on_cancel_ = nullptr;
  }
  if (fn) fn();
}

void GenerateStream::push(TokenEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

void GenerateStream::close(Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    final_ = std::move(status);
    on_cancel_ = nullptr;
  }
  cv_.notify_all();
}

// ---------------------------------------------------------------- Impl plumbing

Scheduler::Impl::Impl(Backend* backend, const Tokenizer* tokenizer, const SchedulerOptions& options,
                      ServerMetrics* metrics, std::unique_ptr<KvCache> kv)
    : backend_(backend),
      tokenizer_(tokenizer),
      options_(options),
      metrics_(metrics),
      kv_(std::move(kv)) {
  const ModelConfig& mc = backend_->model_config();
  // Tokens the tokenizer cannot decode are never sampled: a model's vocab_size may be padded
  // past the tokenizer's vocabulary (or a random-weights model given a small tokenizer).
  vocab_ = mc.vocab_size;
  if (tokenizer_ && tokenizer_->vocab_size() > 0) {
    vocab_ = std::min<int64_t>(vocab_, tokenizer_->vocab_size());
  }
  if (tokenizer_) detok_vocab_ = std::make_unique<DetokenizerVocab>(*tokenizer_);
  for (int64_t id : mc.eos_token_ids) eos_ids_.push_back(static_cast<int32_t>(id));
  if (eos_ids_.empty() && tokenizer_ && tokenizer_->eos_id() >= 0) {
    eos_ids_.push_back(tokenizer_->eos_id());
  }
  thread_ = std::thread([this] { loop(); });
}

Scheduler::Impl::~Impl() { stop(); }

void Scheduler::Impl::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    commands_.push_back(std::move(fn));
  }
  cv_.notify_one();
}

template <typename T>
StatusOr<std::future<StatusOr<T>>> Scheduler::Impl::submit(
    std::function<void(std::function<void(StatusOr<T>)>)> fn) {
  auto promise = std::make_shared<std::promise<StatusOr<T>>>();
  std::future<StatusOr<T>> result = promise->get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Unavailable("the server is shutting down");
    commands_.push_back([fn = std::move(fn), promise] {
      fn([promise](StatusOr<T> r) { promise->set_value(std::move(r)); });
    });
  }
  cv_.notify_one();
  return result;
}

template <typename T>
StatusOr<T> Scheduler::Impl::call(std::function<void(std::function<void(StatusOr<T>)>)> fn) {
  StatusOr<std::future<StatusOr<T>>> result = submit<T>(std::move(fn));
  if (!result.ok()) return result.status();
  return result->get();
}

void Scheduler::Impl::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int32_t Scheduler::Impl::pages_for(int64_t tokens) const {
  const int64_t ps = kv_->page_size();
  return static_cast<int32_t>((tokens + ps - 1) / ps);
}

void Scheduler::Impl::update_gauges() {
  if (!metrics_) return;
  // Cheap pool counters only: KvCache::stats() walks the whole pool (GetServerInfo uses it).
  const PagePool& pool = kv_->pool();
  metrics_->kv_cache_usage_perc->set(
      pool.num_pages() ? double(pool.num_pages() - pool.num_free()) / pool.num_pages() : 0.0);
  int64_t live = 0;
  for (auto& [id, t] : trees_) live += t->live_branches();
  metrics_->live_branches->set(static_cast<double>(live));
  metrics_->num_requests_running->set(static_cast<double>(jobs_.size() + verifies_.size()));
  metrics_->num_requests_waiting->set(static_cast<double>(prefills_.size()));
}

void Scheduler::Impl::finish_job_branch(GenerateJob* job, GenerateBranchState& st,
                                        FinishReason reason, const TokenEvent* last) {
  if (st.finished) return;
  st.finished = true;
  --job->unfinished;
  TokenEvent ev;
  if (last) {
    ev = *last;
  } else {
    ev.branch_id = st.branch_id;
    ev.token_id = -1;
  }
  ev.finish = reason;
  if (st.detok && reason != FinishReason::kStop) {
    StatusOr<std::string> rest = st.detok->flush();
    if (rest.ok()) ev.text += *rest;
  }
  job->stream->push(std::move(ev));
  if (st.branch) st.branch->last_finish = reason;
  if (st.branch && st.branch->job == job) {
    st.branch->job = nullptr;
    if (st.branch->activity == Activity::kGenerate) st.branch->activity = Activity::kIdle;
  }
  st.branch = nullptr;
}

void Scheduler::Impl::maybe_close_job(GenerateJob* job, Status status) {
  if (job->unfinished > 0 && status.ok()) return;
  if (job->beam_width > 0 && !job->beams.empty()) {
    // A beam search ends through finish_beam_search (which detaches its beams from the
    // job first, and comes back here).
    finish_beam_search(job, status);
    return;
  }
  for (GenerateBranchState& st : job->branches) {
    if (!st.finished) finish_job_branch(job, st, FinishReason::kCancelled, nullptr);
  }
  job->stream->close(status);
  if (metrics_) {
    metrics_->e2e_request_latency_seconds->observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job->start).count());
  }
  Tree* tree = job->tree;
  const bool one_shot = job->one_shot;
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](auto& j) { return j.get() == job; });
  if (it != jobs_.end()) jobs_.erase(it);
  if (tree && one_shot) {
    int64_t freed = 0;
    remove_tree(tree, options_.prefix_sharing, &freed);
  } else if (tree) {
    touch(tree);  // the lease counts from the end of the call
  }
}

// Closes the streams of calls whose every branch has finished (not those still waiting for
// their prompt's prefill).
void Scheduler::Impl::close_finished_jobs() {
  std::vector<GenerateJob*> done;
  for (auto& j : jobs_) {
    if (j->unfinished == 0 && !j->waiting_prefill) done.push_back(j.get());
  }
  for (GenerateJob* j : done) maybe_close_job(j, Status::Ok());
}

// ---------------------------------------------------------------- commands

void Scheduler::Impl::cmd_create_tree(std::vector<int32_t> prompt, int64_t lease_ms, uint64_t seq,
                                      const std::string& tenant, const std::string& route,
                                      std::function<void(StatusOr<CreateTreeResult>)> done) {
  TenantState* owner = tenant_state(tenant);
  if (Status s = check_tree_quota(*owner); !s.ok()) return done(s);
  if (Status s = check_branch_quota(*owner, 1); !s.ok()) return done(s);
  if (static_cast<int32_t>(trees_.size()) >= options_.max_live_trees) {
    return done(ResourceExhausted("too many live trees (limit " +
                                  std::to_string(options_.max_live_trees) +
                                  "); delete trees you no longer need"));
  }
  const int32_t length = static_cast<int32_t>(prompt.size());
  if (pages_for(length) > kv_->pool().num_pages()) {
    return done(ResourceExhausted("prompt of " + std::to_string(length) +
                                  " tokens needs more KV pages than the whole pool holds"));
  }
  if (Status s = check_page_quota(*owner, pages_for(length),
                                  "a prompt of " + std::to_string(length) + " tokens");
      !s.ok()) {
    return done(s);
  }
  Tree* t = add_tree(/*one_shot=*/false, lease_ms > 0 ? lease_ms : options_.tree_lease_default_ms,
                     owner, route);
  SchedBranch* root = add_branch(t, nullptr, 0);
  root->pending = std::move(prompt);
  if (metrics_) metrics_->prompt_tokens_total->inc(length);
  if (length == 1) {
    return done(CreateTreeResult{t->id, root->id, length, 0, t->lease.count()});
  }
  auto job = std::make_unique<PrefillJob>();
  job->seq = seq;
  job->branch = root;
  job->prompt_tokens = length;
  job->done = std::move(done);  // cached_tokens: set by the step that creates its KV
  root->activity = Activity::kPrefill;
  root->prefill = job.get();
  prefills_.push_back(std::move(job));
}

void Scheduler::Impl::cmd_abort_create(uint64_t seq) {
  for (auto& p : prefills_) {
    if (p->seq != seq || !p->done || !p->branch) continue;
    // The prefill's callback reports CANCELLED; the pages computed so far are freed (the
    // pool is as before the call, apart from cached prefixes it reused).
    Tree* tree = p->branch->tree;
    spdlog::debug("tree={} creation abandoned by its caller during the prefill", tree->id);
    int64_t freed = 0;
    remove_tree(tree, /*retain_kv=*/false, &freed);
    update_gauges();
    return;
  }
}

StatusOr<std::vector<std::string>> Scheduler::Impl::cmd_branch(const std::string& tree_id,
                                                               const std::string& branch_id,
                                                               int32_t n, int32_t at_offset,
                                                               const std::string& tenant) {
  StatusOr<Tree*> tree = find_tree(tree_id, tenant);
  if (!tree.ok()) return tree.status();
  StatusOr<SchedBranch*> found = find_branch(*tree, branch_id);
  if (!found.ok()) return found.status();
  SchedBranch* b = *found;
  if (b->activity == Activity::kPrefill) {
    return FailedPrecondition("branch_id: branch " + branch_id + " is still being prefilled");
  }
  const int32_t length = b->length();
  if (at_offset < 0 || at_offset > length) {
    return InvalidArgument("at_offset: " + std::to_string(at_offset) + " is outside [0, " +
                           std::to_string(length) + "] for branch " + branch_id);
  }
  if ((*tree)->live_branches() + n > options_.max_branches_per_tree) {
    return ResourceExhausted("tree " + tree_id + " would exceed " +
                             std::to_string(options_.max_branches_per_tree) + " live branches");
  }
  TS_RETURN_IF_ERROR(check_branch_quota(*(*tree)->owner, n));
  const int32_t keep = at_offset == 0 ? length : at_offset;  // tokens the children start with
  // Children keep KV for tokens [0, kv_keep) and the rest as pending (always >= 1 token).
  std::vector<int32_t> child_pending;
  int32_t kv_keep = 0;
  if (keep > b->kv_len) {
    kv_keep = b->kv_len;
    child_pending.assign(b->pending.begin(), b->pending.begin() + (keep - b->kv_len));
  } else {
    kv_keep = keep - 1;
    std::vector<int32_t> tokens;
    TS_RETURN_IF_ERROR(kv_->branch_tokens(*b->kv, &tokens));
    child_pending.push_back(tokens[keep - 1]);
  }
  std::vector<BranchId> kv_children;
  if (kv_keep > 0) {
    StatusOr<ForkResult> forked = kv_->fork(*b->kv, n, kv_keep == b->kv_len ? 0 : kv_keep);
    if (!forked.ok()) return forked.status();
    kv_children = std::move(forked->branches);
    for (const PageCopy& c : forked->copies) {
      deferred_copies_.push_back({c.src_page, c.dst_page, c.num_slots});
    }
  }
  std::vector<std::string> ids;
  for (int32_t i = 0; i < n; ++i) {
    SchedBranch* child = add_branch(*tree, b, keep);
    child->pending = child_pending;
    if (kv_keep > 0) {
      child->kv = kv_children[i];
      child->kv_len = kv_keep;
    }
    ids.push_back(child->id);
  }
  if (metrics_) {
    metrics_->fork_total->inc(n);
  }
  update_gauges();
  return ids;
}

Status Scheduler::Impl::cmd_generate(GenerateSpec spec, std::shared_ptr<GenerateStream> stream) {
  auto job = std::make_unique<GenerateJob>();
  job->stream = stream;
  job->sampling = spec.sampling;
  job->max_tokens = spec.max_tokens > 0 ? spec.max_tokens : options_.default_max_tokens;
  job->stop = std::move(spec.stop);
  job->stop_token_ids = std::move(spec.stop_token_ids);
  job->start = std::chrono::steady_clock::now();
  std::vector<SchedBranch*> targets;
  if (spec.tree_id.empty()) {
    // One-shot: a private tree, forked n ways, deleted (its KV kept as cache) at the end.
    if (static_cast<int32_t>(trees_.size()) >= options_.max_live_trees) {
      return ResourceExhausted("too many live trees (limit " +
                               std::to_string(options_.max_live_trees) + ")");
    }
    const int64_t need = int64_t(spec.prompt.size()) + int64_t(spec.n) * job->max_tokens;
    const int64_t need_pages =
        pages_for(int64_t(spec.prompt.size())) + spec.n * pages_for(job->max_tokens + 1);
    if (need_pages > kv_->pool().num_pages()) {
      return ResourceExhausted("prompt plus n x max_tokens (" + std::to_string(need) +
                               " tokens) needs more KV pages than the whole pool holds");
    }
    TenantState* owner = tenant_state(spec.tenant);
    TS_RETURN_IF_ERROR(check_branch_quota(*owner, spec.n == 1 ? 1 : 1 + int64_t(spec.n)));
    TS_RETURN_IF_ERROR(check_page_quota(
        *owner, need_pages, "prompt plus n x max_tokens (" + std::to_string(need) + " tokens)"));
    Tree* t = add_tree(/*one_shot=*/true, /*lease_ms=*/0, owner, route_key_ids(spec.prompt));
    SchedBranch* root = add_branch(t, nullptr, 0);
    root->pending = std::move(spec.prompt);
    if (metrics_) metrics_->prompt_tokens_total->inc(static_cast<double>(root->pending.size()));
    job->tree = t;
    job->one_shot = true;
    job->prompt_tokens = static_cast<int32_t>(root->pending.size());
    if (spec.n == 1) {
      targets.push_back(root);
    } else if (root->pending.size() == 1) {
      StatusOr<std::vector<std::string>> ids =
          cmd_branch(t->id, root->id, spec.n, 0, owner->limits.tenant);
      if (!ids.ok()) {
        int64_t freed = 0;
        remove_tree(t, false, &freed);
        return ids.status();
      }
      for (const std::string& id : *ids) targets.push_back(t->by_id[id]);
    } else {
      // Prefill the prompt once, then fork it n ways (start_one_shot): the children share
      // every page-aligned KV page of the prompt.
      GenerateJob* raw = job.get();
      auto pj = std::make_unique<PrefillJob>();
      pj->branch = root;
      pj->prompt_tokens = static_cast<int32_t>(root->pending.size());
      pj->done = [this, raw, t, root, n = spec.n](StatusOr<CreateTreeResult> r) {
        if (r.ok()) raw->cached_tokens = r->cached_tokens;
        start_one_shot(raw, t, root, n, r.status());
      };
      root->activity = Activity::kPrefill;
      root->prefill = pj.get();
      prefills_.push_back(std::move(pj));
      job->waiting_prefill = true;
    }
  } else {
    StatusOr<Tree*> tree = find_tree(spec.tree_id, spec.tenant);
    if (!tree.ok()) return tree.status();
    std::set<std::string> seen;
    for (const std::string& id : spec.branch_ids) {
      if (!seen.insert(id).second) return InvalidArgument("branch_ids: '" + id + "' is repeated");
      StatusOr<SchedBranch*> b = find_branch(*tree, id);
      if (!b.ok()) return b.status();
      if ((*b)->activity != Activity::kIdle) {
        return FailedPrecondition("branch_ids: branch " + id +
                                  " is busy (another Generate, Verify or the prefill)");
      }
      targets.push_back(*b);
    }
    if (options_.max_sequence_tokens > 0) {
      for (SchedBranch* b : targets) {
        if (b->length() + int64_t(spec.append.size()) >= options_.max_sequence_tokens) {
          return InvalidArgument("append: branch " + b->id +
                                 " would reach the model's context of " +
                                 std::to_string(options_.max_sequence_tokens) + " tokens");
        }
      }
    }
    for (SchedBranch* b : targets) {
      b->pending.insert(b->pending.end(), spec.append.begin(), spec.append.end());
    }
    if (metrics_ && !spec.append.empty()) {
      metrics_->prompt_tokens_total->inc(double(spec.append.size()) * targets.size());
    }
    job->tree = *tree;
  }
  if (spec.beam_width > 0) {
    // Beam search from the single target (validated by the caller): the beams are its
    // children; the target itself does not run.
    job->beam_width = spec.beam_width;
    job->length_penalty = spec.length_penalty;
    Status s = check_branch_quota(*targets.front()->tree->owner, spec.beam_width);
    if (s.ok()) s = start_beam_search(job.get(), targets.front());
    if (!s.ok()) {
      if (job->one_shot) {
        int64_t freed = 0;
        remove_tree(job->tree, false, &freed);
      }
      return s;
    }
  } else {
    for (SchedBranch* b : targets) attach_branch(job.get(), b);
  }
  // A cancel() from the stream's reader reaches the job through its sequence number (the
  // job may have ended, and its memory been reused, by then).
  job->seq = next_job_seq_++;
  {
    std::lock_guard<std::mutex> lock(stream->mu_);
    stream->on_cancel_ = [this, seq = job->seq] { post([this, seq] { cmd_cancel(seq); }); };
  }
  jobs_.push_back(std::move(job));
  update_gauges();
  return Status::Ok();
}

void Scheduler::Impl::attach_branch(GenerateJob* job, SchedBranch* b) {
  GenerateBranchState st;
  st.branch = b;
  st.branch_id = b->id;
  st.detok = std::make_unique<IncrementalDetokenizer>(*tokenizer_, detok_vocab_.get());
  job->branches.push_back(std::move(st));
  b->activity = Activity::kGenerate;
  b->job = job;
  ++job->unfinished;
}

void Scheduler::Impl::start_one_shot(GenerateJob* job, Tree* tree, SchedBranch* root, int32_t n,
                                     Status status) {
  job->waiting_prefill = false;
  if (status.ok()) {
    StatusOr<std::vector<std::string>> ids =
        cmd_branch(tree->id, root->id, n, 0, tree->owner->limits.tenant);
    if (ids.ok()) {
      for (const std::string& id : *ids) attach_branch(job, tree->by_id[id]);
      return;
    }
    status = ids.status();
  }
  // Failed or cancelled before any token: the stream ends with the reason; the tree goes
  // after this command (the caller may still be inside end_branch of its root).
  job->stream->close(status);
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](auto& j) { return j.get() == job; });
  if (it != jobs_.end()) jobs_.erase(it);
  const std::string tree_id = tree->id;
  tree->one_shot = false;
  post([this, tree_id] {
    auto t = trees_.find(tree_id);
    if (t == trees_.end()) return;
    int64_t freed = 0;
    remove_tree(t->second.get(), options_.prefix_sharing, &freed);
    update_gauges();
  });
}

void Scheduler::Impl::cmd_cancel(uint64_t job_seq) {
  auto it = std::find_if(jobs_.begin(), jobs_.end(), [&](auto& j) { return j->seq == job_seq; });
  if (it == jobs_.end()) return;  // already finished
  GenerateJob* job = it->get();
  if (job->beam_width > 0) {
    finish_beam_search(job, Cancelled("the client cancelled the beam search"));
    update_gauges();
    return;
  }
  if (job->waiting_prefill) {
    // A one-shot call still prefilling its prompt: prune the root (the tree goes with the
    // call); its PrefillJob callback closes the stream.
    std::vector<SchedBranch*> prefilling;
    for (auto& [index, b] : job->tree->branches) {
      if (b->prefill) prefilling.push_back(b.get());
    }
    for (SchedBranch* b : prefilling) end_branch(b, /*retain_kv=*/false, FinishReason::kCancelled);
    return;
  }
  // No work is lost: the branches stop where they are and stay live with every token they
  // have (the last one pending, as after any Generate), so the tree stays usable.
  for (GenerateBranchState& st : job->branches) {
    finish_job_branch(job, st, FinishReason::kCancelled, nullptr);
  }
  maybe_close_job(job, Status::Ok());
  update_gauges();
}

StatusOr<PruneSummary> Scheduler::Impl::cmd_prune(const std::string& tree_id,
                                                  const std::vector<std::string>& ids,
                                                  bool retain_kv, const std::string& tenant) {
  StatusOr<Tree*> tree = find_tree(tree_id, tenant);
  if (!tree.ok()) return tree.status();
  std::vector<SchedBranch*> roots;
  for (const std::string& id : ids) {
    StatusOr<SchedBranch*> b = find_branch(*tree, id);
    if (!b.ok()) return b.status();
    roots.push_back(*b);
  }
  // The listed branches and every descendant (children fork after their parents, so one
  // pass in index order sees each parent before its children).
  std::unordered_set<std::string> doomed;
  for (SchedBranch* b : roots) doomed.insert(b->id);
  std::vector<SchedBranch*> order;
  for (auto& [index, b] : (*tree)->branches) {
    if (doomed.count(b->id) || doomed.count(b->parent)) {
      doomed.insert(b->id);
      order.push_back(b.get());
    }
  }
  // Newest first: children end before their parents.
  PruneSummary out;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    out.freed_tokens += end_branch(*it, retain_kv, FinishReason::kPruned);
    ++out.pruned_branches;
  }
  drop_dead_copies();
  // Jobs whose every branch is now finished end here.
  close_finished_jobs();
  update_gauges();
  return out;
}

void Scheduler::Impl::cmd_verify(const std::string& tree_id, const std::string& branch_id,
                                 std::vector<int32_t> tokens, std::vector<int32_t> parents,
                                 SamplingParams sampling, const std::string& tenant,
                                 std::function<void(StatusOr<VerifyResult>)> done) {
  StatusOr<Tree*> tree = find_tree(tree_id, tenant);
  if (!tree.ok()) return done(tree.status());
  StatusOr<SchedBranch*> found = find_branch(*tree, branch_id);
  if (!found.ok()) return done(found.status());
  SchedBranch* b = *found;
  if (b->activity != Activity::kIdle) {
    return done(FailedPrecondition("branch_id: branch " + branch_id + " is busy"));
  }
  if (options_.max_sequence_tokens > 0 &&
      b->length() + int64_t(tokens.size()) >= options_.max_sequence_tokens) {
    return done(InvalidArgument("tokens: the token tree could pass the model's context of " +
                                std::to_string(options_.max_sequence_tokens) + " tokens"));
  }
  if (pages_for(b->length() + int64_t(tokens.size())) > kv_->pool().num_pages()) {
    return done(ResourceExhausted("the token tree does not fit in the KV pool"));
  }
  if (Status s = check_page_quota(*(*tree)->owner, pages_for(b->length() + int64_t(tokens.size())),
                                  "the branch plus its token tree");
      !s.ok()) {
    return done(s);
  }
  auto job = std::make_unique<VerifyJob>();
  job->branch = b;
  job->tokens = std::move(tokens);
  job->parents = std::move(parents);
  job->sampling = sampling;
  job->done = std::move(done);
  b->activity = Activity::kVerify;
  b->verify = job.get();
  verifies_.push_back(std::move(job));
}

StatusOr<int64_t> Scheduler::Impl::cmd_delete_tree(const std::string& tree_id,
                                                   const std::string& tenant) {
  StatusOr<Tree*> found = find_tree(tree_id, tenant);
  if (!found.ok()) return found.status();
  if ((*found)->one_shot) {
    return FailedPrecondition("tree_id: tree " + tree_id +
                              " belongs to a one-shot Generate and ends with it");
  }
  int64_t freed = 0;
  // Its KV stays as evictable cache for later prompts (unless prefix sharing is off).
  remove_tree(*found, options_.prefix_sharing, &freed);
  close_finished_jobs();
  update_gauges();
  return freed;
}

SchedulerStats Scheduler::Impl::cmd_stats() {
  KvCacheStats s = kv_->stats();
  SchedulerStats out;
  out.kv_pages_total = s.pages_total;
  out.kv_pages_free = s.pages_free;
  out.kv_pages_evictable = s.pages_evictable;
  out.radix_cached_tokens = s.radix_cached_tokens;
  out.radix_nodes = s.radix_nodes;
  out.live_trees = static_cast<int32_t>(trees_.size());
  for (auto& [id, t] : trees_) out.live_branches += t->live_branches();
  out.running_requests = static_cast<int32_t>(jobs_.size() + verifies_.size());
  out.waiting_requests = static_cast<int32_t>(prefills_.size());
  out.steps = steps_;
  if (metrics_) metrics_->radix_nodes->set(static_cast<double>(s.radix_nodes));
  return out;
}

// ---------------------------------------------------------------- Scheduler (public)

namespace {

// How often a waiting caller asks its CancelCheck.
constexpr std::chrono::milliseconds kCancelPoll{20};

// A fork or a one-shot Generate makes at least one branch.
Status check_branch_count(int32_t n) {
  if (n < 1) return InvalidArgument("n: must be >= 1");
  return Status::Ok();
}

}  // namespace

StatusOr<std::unique_ptr<Scheduler>> Scheduler::create(Backend* backend, const Tokenizer* tokenizer,
                                                       const SchedulerOptions& options,
                                                       ServerMetrics* metrics) {
  if (!backend) return InvalidArgument("backend must not be null");
  if (!tokenizer) return InvalidArgument("tokenizer must not be null");
  if (options.max_step_tokens < 1) return InvalidArgument("max_step_tokens must be >= 1");
  if (options.max_step_rows < 1) return InvalidArgument("max_step_rows must be >= 1");
  SchedulerOptions opts = options;
  TS_RETURN_IF_ERROR(resolve_tree_id_options(&opts));
  const KvLayout& layout = backend->kv_layout();
  KvCacheConfig kc;
  kc.page_size = layout.page_size;
  kc.num_pages = static_cast<int32_t>(layout.num_pages);
  StatusOr<std::unique_ptr<KvCache>> kv = KvCache::create(kc);
  if (!kv.ok()) return kv.status();
  auto impl = std::make_unique<Impl>(backend, tokenizer, opts, metrics, std::move(*kv));
  // On the loop thread, as every other touch of the KV cache.
  StatusOr<bool> configured = impl->call<bool>([&](auto done) {
    Status s = impl->configure_tenants(options.tenants);
    if (s.ok()) {
      done(true);
    } else {
      done(s);
    }
  });
  if (!configured.ok()) return configured.status();
  return std::unique_ptr<Scheduler>(new Scheduler(std::move(impl)));
}

Scheduler::Scheduler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Scheduler::~Scheduler() { shutdown(); }
void Scheduler::shutdown() { impl_->stop(); }
const SchedulerOptions& Scheduler::options() const { return impl_->options_; }
ServerMetrics* Scheduler::metrics() const { return impl_->metrics_; }
const DetokenizerVocab* Scheduler::detokenizer_vocab() const { return impl_->detok_vocab_.get(); }

// The caller waits for the prefill, asking `cancelled` every kCancelPoll. Once it gives up,
// the loop stops the prefill and removes the tree (cmd_abort_create); if the result was ready
// first, the tree is removed here. Either way nothing is left that nobody can name.
StatusOr<CreateTreeResult> Scheduler::create_tree(std::vector<int32_t> prompt,
                                                  const CreateTreeOptions& options) {
  TS_RETURN_IF_ERROR(check_tokens_given("prompt", prompt));
  if (options.lease_ms < 0) {
    return InvalidArgument("lease_ms: must be >= 0 (0 = the default lease)");
  }
  if (!options.route.empty()) TS_RETURN_IF_ERROR(check_route_key(options.route));
  std::string route = options.route.empty() ? route_key_ids(prompt) : options.route;
  const uint64_t seq = impl_->next_call_seq_.fetch_add(1);
  auto submitted = impl_->submit<CreateTreeResult>(
      [this, p = std::move(prompt), lease = options.lease_ms, seq, tenant = options.tenant,
       route = std::move(route)](std::function<void(StatusOr<CreateTreeResult>)> done) mutable {
        impl_->cmd_create_tree(std::move(p), lease, seq, tenant, route, std::move(done));
      });
  if (!submitted.ok()) return submitted.status();
  std::future<StatusOr<CreateTreeResult>>& result = *submitted;
  const CancelCheck& cancelled = options.cancelled;
  bool gave_up = false;
  if (cancelled) {
    while (result.wait_for(kCancelPoll) != std::future_status::ready) {
      if (!gave_up && cancelled()) {
        gave_up = true;
        impl_->post([this, seq] { impl_->cmd_abort_create(seq); });
      }
    }
  }
  StatusOr<CreateTreeResult> r = result.get();
  if (r.ok() && cancelled && (gave_up || cancelled())) {
    discard_tree(r->tree_id);
    return Cancelled(
        "CreateTree: the caller gave up (cancelled, or its deadline passed); the "
        "tree was removed");
  }
  return r;
}

void Scheduler::discard_tree(const std::string& tree_id) {
  (void)impl_->call<bool>([&](auto done) {
    auto it = impl_->trees_.find(tree_id);
    if (it != impl_->trees_.end()) {
      int64_t freed = 0;
      impl_->remove_tree(it->second.get(), /*retain_kv=*/false, &freed);
      impl_->update_gauges();
    }
    done(true);
  });
}

StatusOr<std::vector<std::string>> Scheduler::branch(const std::string& tree_id,
                                                     const std::string& branch_id, int32_t n,
                                                     int32_t at_offset,
                                                     const CancelCheck& cancelled,
                                                     const std::string& tenant) {
  TS_RETURN_IF_ERROR(check_branch_count(n));
  if (cancelled && cancelled()) return Cancelled("Branch: the caller gave up before the fork");
  StatusOr<std::vector<std::string>> ids = impl_->call<std::vector<std::string>>(
      [&](auto done) { done(impl_->cmd_branch(tree_id, branch_id, n, at_offset, tenant)); });
  if (ids.ok() && cancelled && cancelled()) {
    // Nobody learns these ids: they go again (a fork holds at most one private page each).
    (void)prune(tree_id, *ids, /*retain_kv=*/false, tenant);
    return Cancelled(
        "Branch: the caller gave up (cancelled, or its deadline passed); the new "
        "branches were pruned");
  }
  return ids;
}

StatusOr<std::shared_ptr<GenerateStream>> Scheduler::generate(GenerateSpec spec) {
  if (spec.tree_id.empty()) {
    if (spec.prompt.empty()) return InvalidArgument("prompt: a one-shot Generate needs a prompt");
    TS_RETURN_IF_ERROR(check_branch_count(spec.n));
  } else {
    TS_RETURN_IF_ERROR(check_branch_ids_given(spec.tree_id, spec.branch_ids));
  }
  if (spec.beam_width < 0) return InvalidArgument("beam_search.beam_width: must be >= 0");
  if (spec.beam_width > 0) {
    if (spec.tree_id.empty() ? spec.n != 1 : spec.branch_ids.size() != 1) {
      return InvalidArgument(
          "beam_search: searches from exactly one branch (or a one-shot prompt with n = 1)");
    }
    TS_RETURN_IF_ERROR(check_length_penalty(spec.length_penalty));
  }
  auto stream = std::make_shared<GenerateStream>();
  StatusOr<bool> started = impl_->call<bool>([&](auto done) {
    Status s = impl_->cmd_generate(std::move(spec), stream);
    if (s.ok()) {
      done(true);
    } else {
      done(s);
    }
  });
  if (!started.ok()) return started.status();
  return stream;
}

StatusOr<PruneSummary> Scheduler::prune(const std::string& tree_id,
                                        const std::vector<std::string>& ids, bool retain_kv,
                                        const std::string& tenant) {
  if (ids.empty()) return InvalidArgument("branch_ids: name at least one branch");
  return impl_->call<PruneSummary>(
      [&](auto done) { done(impl_->cmd_prune(tree_id, ids, retain_kv, tenant)); });
}

StatusOr<VerifyResult> Scheduler::verify(const std::string& tree_id, const std::string& branch_id,
                                         std::vector<int32_t> tokens, std::vector<int32_t> parents,
                                         SamplingParams sampling, const std::string& tenant) {
  TS_RETURN_IF_ERROR(check_tokens_given("tokens", tokens));
  if (parents.size() != tokens.size()) {
    return InvalidArgument("parents: needs one entry per token (" + std::to_string(tokens.size()) +
                           "), got " + std::to_string(parents.size()));
  }
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] < -1 || parents[i] >= static_cast<int32_t>(i)) {
      return InvalidArgument("parents[" + std::to_string(i) + "]: " + std::to_string(parents[i]) +
                             " must be -1 or the index of an earlier token");
    }
  }
  return impl_->call<VerifyResult>([&](std::function<void(StatusOr<VerifyResult>)> done) {
    impl_->cmd_verify(tree_id, branch_id, std::move(tokens), std::move(parents), sampling, tenant,
                      std::move(done));
  });
}

StatusOr<TreeSummary> Scheduler::get_tree(const std::string& tree_id, const TreePage& page,
                                          const std::string& tenant) {
  std::vector<std::vector<int32_t>> ids;  // written by the loop thread before `done`
  StatusOr<TreeSummary> r = impl_->call<TreeSummary>(
      [&](auto done) { done(impl_->cmd_get_tree(tree_id, page, tenant, &ids)); });
  if (!r.ok() || !page.detail) return r;
  // Each branch's text from its fork offset, decoded here rather than on the loop thread. A
  // fork's text is decoded behind the anchor piece, so its first piece keeps its leading
  // space as in the whole sequence's decode (models/detokenizer.h).
  const DetokenizerVocab* vocab = impl_->detok_vocab_.get();
  for (size_t i = 0; i < r->branches.size() && i < ids.size(); ++i) {
    BranchSummary& b = r->branches[i];
    std::vector<int32_t>& text_ids = ids[i];
    const bool anchored = b.fork_offset > 0 && vocab != nullptr && vocab->anchor() >= 0;
    if (anchored) text_ids.insert(text_ids.begin(), vocab->anchor());
    StatusOr<std::string> text = impl_->tokenizer_->decode(text_ids);
    if (!text.ok()) continue;
    const size_t cut = anchored ? std::min(vocab->anchor_text().size(), text->size()) : 0;
    b.text = text->substr(cut);
  }
  return r;
}

StatusOr<TreeList> Scheduler::list_trees(const std::string& tenant, const TreePage& page) {
  if (page.page_size < 0) return InvalidArgument("page_size: must be >= 0");
  return impl_->call<TreeList>([&](auto done) { done(impl_->cmd_list_trees(tenant, page)); });
}

Status Scheduler::hold_tree(const std::string& tree_id, const std::string& tenant) {
  StatusOr<bool> r = impl_->call<bool>([&](auto done) {
    Status s = impl_->cmd_hold_tree(tree_id, +1, tenant);
    if (s.ok()) {
      done(true);
    } else {
      done(s);
    }
  });
  return r.ok() ? Status::Ok() : r.status();
}

void Scheduler::release_tree(const std::string& tree_id, const std::string& tenant) {
  (void)impl_->call<bool>([&](auto done) {
    (void)impl_->cmd_hold_tree(tree_id, -1, tenant);
    done(true);
  });
}

StatusOr<int64_t> Scheduler::delete_tree(const std::string& tree_id, const std::string& tenant) {
  return impl_->call<int64_t>([&](auto done) { done(impl_->cmd_delete_tree(tree_id, tenant)); });
}

SchedulerStats Scheduler::stats() {
  StatusOr<SchedulerStats> s =
      impl_->call<SchedulerStats>([&](auto done) { done(impl_->cmd_stats()); });
  return s.ok() ? *s : SchedulerStats{};
}

}  // namespace treeserve
