// The step loop: between steps it runs queued commands; each step gathers the rows of every
// active branch (verify trees, decode tokens, prefill chunks), runs one forward, and routes
// the logits back: sampled tokens to streams, accepted paths to Verify calls, finished
// prefills to CreateTree calls.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cassert>

#include "common/metrics.h"
#include "scheduler/detail/scheduler_impl.h"

namespace treeserve {

namespace {

// Where a stop string first occurs in `text`, or npos.
size_t find_stop(const std::string& text, const std::vector<std::string>& stops, size_t from) {
  size_t best = std::string::npos;
  for (const std::string& s : stops) {
    if (s.empty()) continue;
    size_t start = from >= s.size() ? from - s.size() + 1 : 0;
    size_t at = text.find(s, start);
    if (at != std::string::npos && (best == std::string::npos || at < best)) best = at;
  }
  return best;
}

}  // namespace

void Scheduler::Impl::loop() {
  for (;;) {
    std::deque<std::function<void()>> commands;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle, the loop still wakes when the next lease may run out.
      auto ready = [&] { return stopping_ || !commands_.empty() || has_work(); };
      if (next_lease_check_ == std::chrono::steady_clock::time_point::max()) {
        cv_.wait(lock, ready);
      } else {
        cv_.wait_until(lock, next_lease_check_, ready);
      }
      if (stopping_) break;
      commands.swap(commands_);
    }
    free_ended();
    const auto host_begin = std::chrono::steady_clock::now();
    for (auto& c : commands) c();
    expire_leases();
    if (has_work() && step() && metrics_) {
      // The device waits for the host for everything but the forward: this iteration's
      // commands, building the batch and view, and handling the step's results.
      using Seconds = std::chrono::duration<double>;
      const auto now = std::chrono::steady_clock::now();
      metrics_->step_forward_seconds->observe(Seconds(forward_end_ - forward_begin_).count());
      metrics_->step_host_seconds->observe(
          Seconds((forward_begin_ - host_begin) + (now - forward_end_)).count());
    }
  }
  // Shutdown: commands already queued run (their callers wait on them), then every piece of
  // in-flight work ends.
  std::deque<std::function<void()>> rest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    rest.swap(commands_);
  }
  for (auto& c : rest) c();
  const Status bye = Unavailable("the server is shutting down");
  for (auto& p : prefills_) {
    if (p->done) p->done(bye);
    p->done = nullptr;
  }
  for (auto& v : verifies_) {
    if (v->done) v->done(bye);
    v->done = nullptr;
  }
  while (!jobs_.empty()) {
    GenerateJob* job = jobs_.front().get();
    if (job->waiting_prefill) {
      job->stream->close(bye);
      jobs_.erase(jobs_.begin());
      continue;
    }
    job->one_shot = false;
    maybe_close_job(job, bye);  // unfinished branches get FINISH_CANCELLED first
  }
}

bool Scheduler::Impl::has_work() const {
  if (!prefills_.empty() || !verifies_.empty()) return true;
  for (const auto& j : jobs_) {
    if (j->unfinished > 0) return true;
  }
  return false;
}

SampledToken Scheduler::Impl::sample(int32_t logit_index, const SamplingParams& params,
                                     const SchedBranch* b, int64_t position) {
  if (!logits_.sampled.empty()) {
    // The backend drew the row with these params, stream key and position
    // (request_sampling).
    assert(batch_.sampling.at(logit_index).position == position &&
           batch_.sampling.at(logit_index).stream_key == static_cast<uint64_t>(b->index) &&
           "request_sampling asked the backend for another draw than this one");
    return logits_.sampled.at(logit_index);
  }
  if (logits_.data.empty()) {
    // The backend returned only argmaxes (every row of the step is greedy, no alternatives).
    SampledToken t;
    t.token = logits_.argmax.at(logit_index);
    t.logprob = logits_.argmax_logprob.at(logit_index);
    return t;
  }
  return sample_token(logits_.row(logit_index), vocab_, params, static_cast<uint64_t>(b->index),
                      position, &sampling_scratch_);
}

void Scheduler::Impl::request_sampling() {
  batch_.full_logits = false;
  batch_.sampling.clear();
  bool draws = false;
  for (const StepEntry& e : entries_) {
    if (e.samples && e.logit_index >= 0) {
      draws |= e.sampling.temperature > 0 || e.sampling.logprobs > 0;
    }
  }
  if (!draws) return;  // greedy only: the backend's argmaxes suffice
  StepSampling greedy;
  greedy.params.temperature = 0;
  batch_.sampling.assign(batch_.logit_rows.size(), greedy);
  auto draw = [&](const StepEntry& e, int32_t logit_index) {
    // Every consumer of sample() passes the position after the row's token: the branch's
    // KV length for generate and beams, that plus the accepted path for a verify's drafts.
    const int64_t position = batch_.positions[batch_.logit_rows[logit_index]] + 1;
    batch_.sampling[logit_index] = {e.sampling, static_cast<uint64_t>(e.branch->index), position};
  };
  for (const StepEntry& e : entries_) {
    if (!e.samples || e.logit_index < 0) continue;
    draw(e, e.logit_index);
    for (int32_t i = 0; i < e.draft_rows; ++i) draw(e, e.draft_logits + i);
  }
}

bool Scheduler::Impl::add_rows(SchedBranch* b, int32_t count, bool want_logits, StepEntry* e) {
  e->branch = b;
  e->kv_len_before = b->kv_len;
  e->consumed.assign(b->pending.begin(), b->pending.begin() + count);
  std::span<const int32_t> tokens(e->consumed);
  slots_.clear();
  int32_t cached = 0;
  if (!b->kv) {
    // First KV of this branch: create_branch reuses the radix cache's longest prefix (at
    // most count - 1 tokens). Without prefix sharing only the first token is passed, so
    // nothing can match, and the rest is appended.
    const size_t first = options_.prefix_sharing ? tokens.size() : 1;
    StatusOr<NewBranch> nb = kv_->create_branch(tokens.first(first), b->tree->owner->ns);
    if (!nb.ok()) return false;
    if (first < tokens.size()) {
      std::vector<KvSlot> more;
      if (!kv_->append(nb->id, tokens.subspan(first), &more).ok()) {
        (void)kv_->prune(nb->id, /*retain_kv=*/false);
        return false;
      }
      nb->slots.insert(nb->slots.end(), more.begin(), more.end());
    }
    b->kv = nb->id;
    e->created_kv = true;
    cached = nb->cached_tokens;
    slots_ = std::move(nb->slots);
    for (const PageCopy& c : nb->copies) {
      batch_.page_copies.push_back({c.src_page, c.dst_page, c.num_slots});
    }
    if (b->prefill) b->prefill->cached_tokens = cached;
    if (b->job && b->job->one_shot) b->job->cached_tokens = cached;  // one-shot, n = 1
    if (metrics_ && cached > 0) metrics_->prefix_cache_hit_tokens_total->inc(cached);
  } else if (!kv_->append(*b->kv, tokens, &slots_).ok()) {
    return false;
  }
  const int32_t ps = kv_->page_size();
  e->first_row = batch_.num_rows();
  e->num_rows = count - cached;
  for (int32_t i = cached; i < count; ++i) {
    const KvSlot& s = slots_[i - cached];
    batch_.token_ids.push_back(tokens[i]);
    batch_.positions.push_back(b->kv_len + i);
    batch_.kv_slots.push_back(int64_t(s.page) * ps + s.slot);
  }
  b->kv_len += count;
  b->pending.erase(b->pending.begin(), b->pending.begin() + count);
  view_queries_.push_back({*b->kv, e->num_rows});
  if (want_logits) {
    e->logit_index = static_cast<int32_t>(batch_.logit_rows.size());
    batch_.logit_rows.push_back(batch_.num_rows() - 1);
  }
  return true;
}

bool Scheduler::Impl::add_pending_rows(SchedBranch* b, int32_t* budget, StepEntry* e) {
  const int32_t want = static_cast<int32_t>(b->pending.size());
  int32_t skip = 0;
  if (!b->kv && options_.prefix_sharing && want > 1) {
    skip = kv_->match_prefix_length(b->pending, b->tree->owner->ns);
  }
  const int32_t count = want - skip <= 1 ? want : std::min(want, skip + std::max(1, *budget));
  if (count - skip > 1) *budget -= count - skip;
  return add_rows(b, count, count == want, e);
}

// Undoes add_rows (and a verify's drafts) after a failed forward or a failed draft append.
void Scheduler::Impl::rollback(const StepEntry& e) {
  SchedBranch* b = e.branch;
  if (!b->kv) return;
  if (e.draft_rows > 0) {
    std::vector<SlotMove> none;
    (void)kv_->accept(*b->kv, {}, &none);
  }
  if (e.created_kv) {
    (void)kv_->prune(*b->kv, /*retain_kv=*/false);
    b->kv.reset();
    b->kv_len = 0;
  } else {
    (void)kv_->truncate(*b->kv, e.kv_len_before);
    b->kv_len = e.kv_len_before;
  }
  b->pending.insert(b->pending.begin(), e.consumed.begin(), e.consumed.end());
}

bool Scheduler::Impl::step() {
  // Drop the records of calls that ended between steps.
  std::erase_if(prefills_, [](auto& p) { return !p->done; });
  std::erase_if(verifies_, [](auto& v) { return !v->done; });

  // Beam searches whose beams were all pruned (or whose tree was deleted) end here.
  std::vector<GenerateJob*> orphaned;
  for (auto& j : jobs_) {
    if (j->beam_width > 0 && j->unfinished > 0 &&
        std::none_of(j->beams.begin(), j->beams.end(), [](const Beam& b) { return b.branch; })) {
      orphaned.push_back(j.get());
    }
  }
  for (GenerateJob* j : orphaned) {
    finish_beam_search(j, FailedPrecondition("the beam search's branches were pruned"));
  }
  if (!has_work()) return false;

  batch_.clear();
  entries_.clear();
  view_queries_.clear();
  batch_.slot_moves = deferred_moves_;
  batch_.page_copies = deferred_copies_;
  int32_t budget = options_.max_step_tokens;
  bool stalled = false;
  // Namespaces whose work could not get KV pages this step.
  std::vector<CacheNamespace> stalled_ns;
  auto stall = [&](const SchedBranch* b) {
    stalled = true;
    const CacheNamespace ns = b->tree->owner->ns;
    if (std::find(stalled_ns.begin(), stalled_ns.end(), ns) == stalled_ns.end()) {
      stalled_ns.push_back(ns);
    }
  };
  // Rows of this step (max_step_rows): work past it waits for the next step (a step always
  // takes its first piece of work, whatever its size).
  int32_t rows_left = options_.max_step_rows;
  auto fits = [&](int32_t rows) { return rows <= rows_left || entries_.empty(); };

  // 1. Speculative token trees: the branch's pending tokens and the whole draft tree.
  for (auto& v : verifies_) {
    SchedBranch* b = v->branch;
    if (!fits(static_cast<int32_t>(b->pending.size() + v->tokens.size()))) continue;
    StepEntry e;
    if (!add_rows(b, static_cast<int32_t>(b->pending.size()), true, &e)) {
      stall(b);
      continue;
    }
    e.samples = true;
    e.sampling = v->sampling;
    slots_.clear();
    if (!kv_->append_token_tree(*b->kv, v->tokens, v->parents, &slots_).ok()) {
      rollback(e);
      batch_.token_ids.resize(e.first_row);
      batch_.positions.resize(e.first_row);
      batch_.kv_slots.resize(e.first_row);
      batch_.logit_rows.pop_back();
      view_queries_.pop_back();
      stall(b);
      continue;
    }
    std::vector<int32_t> depth(v->tokens.size(), 0);
    const int32_t ps = kv_->page_size();
    e.draft_rows = static_cast<int32_t>(v->tokens.size());
    e.draft_logits = static_cast<int32_t>(batch_.logit_rows.size());
    for (size_t i = 0; i < v->tokens.size(); ++i) {
      depth[i] = v->parents[i] < 0 ? 0 : depth[v->parents[i]] + 1;
      batch_.token_ids.push_back(v->tokens[i]);
      batch_.positions.push_back(b->kv_len + depth[i]);
      batch_.kv_slots.push_back(int64_t(slots_[i].page) * ps + slots_[i].slot);
      batch_.logit_rows.push_back(batch_.num_rows() - 1);
    }
    rows_left -= e.num_rows + e.draft_rows;
    entries_.push_back(std::move(e));
  }
  // 2. Generating branches: one decode row each, or a chunk of appended text; beam searches:
  //    every live beam runs its pending token(s) with logits — all of a search's beams in one
  //    step or none (their candidates compete). When the step's rows run out, the jobs after
  //    that point go first next step (the start rotates).
  const size_t num_jobs = jobs_.size();
  for (size_t k = 0; k < num_jobs; ++k) {
    GenerateJob* job = jobs_[(k + rotation_) % num_jobs].get();
    if (!job->waiting_prefill) {
      for (GenerateBranchState& st : job->branches) {
        if (st.finished || !st.branch) continue;
        if (!fits(1)) break;
        StepEntry e;
        if (!add_pending_rows(st.branch, &budget, &e)) {
          stall(st.branch);
          continue;
        }
        e.samples = true;
        e.sampling = job->sampling;
        rows_left -= e.num_rows;
        entries_.push_back(std::move(e));
      }
    }
    if (job->beam_width <= 0) continue;
    int32_t beam_rows = 0;
    for (Beam& beam : job->beams) {
      beam.logit_index = -1;
      if (!beam.ended && beam.branch) {
        beam_rows += static_cast<int32_t>(beam.branch->pending.size());
      }
    }
    if (!fits(beam_rows)) continue;
    for (Beam& beam : job->beams) {
      if (beam.ended || !beam.branch) continue;
      StepEntry e;
      if (!add_pending_rows(beam.branch, &budget, &e)) {
        stall(beam.branch);
        continue;
      }
      e.samples = true;
      e.sampling = beam_step_sampling(*job);
      beam.logit_index = e.logit_index;
      rows_left -= e.num_rows;
      entries_.push_back(std::move(e));
    }
  }
  ++rotation_;
  // 3. Prefill of new trees (all but the prompt's last token), in arrival order, within
  //    the remaining budget.
  for (auto& p : prefills_) {
    SchedBranch* b = p->branch;
    if (!p->done || !b) continue;
    const int32_t want = static_cast<int32_t>(b->pending.size()) - 1;
    const int32_t room = entries_.empty() ? budget : std::min(budget, rows_left);
    if (want <= 0 || room <= 0) continue;
    int32_t skip = 0;
    if (!b->kv && options_.prefix_sharing && want > 1) {
      skip = kv_->match_prefix_length(std::span(b->pending.data(), want), b->tree->owner->ns);
    }
    const int32_t count = std::min(want, skip + room);
    budget -= count - skip;
    StepEntry e;
    if (!add_rows(b, count, false, &e)) {
      stall(b);
      continue;
    }
    rows_left -= e.num_rows;
    entries_.push_back(std::move(e));
  }

  // A namespace at its page limit (a tenant's KV quota) with none of its work running frees no
  // page of its own: its waiting work is refused now, naming the quota, while other tenants'
  // work goes on. (Work short of pool pages waits while anything runs, as below.)
  for (const CacheNamespace ns : stalled_ns) {
    const bool ran = std::any_of(entries_.begin(), entries_.end(), [&](const StepEntry& e) {
      return e.branch->tree->owner->ns == ns;
    });
    if (ran) continue;
    if (Status refusal = namespace_limit_refusal(ns); !refusal.ok()) fail_stalled(refusal, &ns);
  }
  if (entries_.empty()) {
    // Nothing could run. Everything active is waiting for KV pages that only idle trees
    // hold (nothing running will free them): refuse the waiting work.
    if (stalled) {
      fail_stalled(ResourceExhausted(
          "KV pool exhausted: the request cannot fit even after evicting every unused "
          "cached prefix (pages are held by live branches; prune or delete trees)"));
    } else {
      // Only zero-row work was listed (e.g. a one-token prompt's prefill): settle it.
      for (auto& p : prefills_) {
        if (p->done && p->branch && p->branch->pending.size() <= 1) {
          StepEntry e;
          e.branch = p->branch;
          after_prefill(e);
        }
      }
    }
    return false;
  }

  batch_.vocab_limit = vocab_;
  request_sampling();
  Status built = kv_->build_attention_view(view_queries_, &batch_.view);
  forward_begin_ = std::chrono::steady_clock::now();
  Status ran = built.ok() ? backend_->forward(batch_, &logits_) : built;
  forward_end_ = std::chrono::steady_clock::now();
  if (metrics_ && built.ok()) {
    // KV tokens read once for several queries instead of once per query.
    int64_t saved = 0;
    for (const KvNodeRun& n : batch_.view.nodes) {
      saved += int64_t(std::max(0, n.query_end - n.query_begin - 1)) * n.num_tokens;
    }
    metrics_->shared_kv_tokens_saved_total->inc(static_cast<double>(saved));
  }
  ++steps_;
  if (!ran.ok()) {
    spdlog::error("step {} failed ({} rows): {}", steps_, batch_.num_rows(), ran.message());
    const Status err = Internal("decode step failed: " + ran.message());
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) rollback(*it);
    std::vector<std::string> failed_trees;  // trees whose prefill failed: they go
    for (StepEntry& e : entries_) {
      SchedBranch* b = e.branch;
      if (!b->live) continue;
      if (b->verify) {
        b->verify->done(err);
        b->verify->done = nullptr;
        b->verify->branch = nullptr;
        b->verify = nullptr;
        b->activity = Activity::kIdle;
      } else if (b->prefill) {
        b->prefill->done(err);
        b->prefill->done = nullptr;
        b->prefill->branch = nullptr;
        b->prefill = nullptr;
        b->activity = Activity::kIdle;
        failed_trees.push_back(b->tree->id);
      } else if (b->job) {
        GenerateJob* job = b->job;
        maybe_close_job(job, err);
      } else if (b->beam_job) {
        finish_beam_search(b->beam_job, err);
      }
    }
    // A CreateTree whose prefill failed leaves no tree (nor does a one-shot call's).
    for (const std::string& id : failed_trees) {
      auto it = trees_.find(id);
      if (it == trees_.end()) continue;
      int64_t freed = 0;
      remove_tree(it->second.get(), /*retain_kv=*/false, &freed);
    }
    update_gauges();
    return false;
  }
  deferred_moves_.clear();
  deferred_copies_.clear();

  for (StepEntry& e : entries_) {
    SchedBranch* b = e.branch;
    if (!b->live) continue;
    switch (b->activity) {
      case Activity::kVerify:
        after_verify(e);
        break;
      case Activity::kGenerate:
        after_generate(e);
        break;
      case Activity::kPrefill:
        after_prefill(e);
        break;
      case Activity::kBeam:  // all beams of a search are decided together, below
      case Activity::kIdle:
        break;
    }
  }
  std::vector<GenerateJob*> searching;
  for (auto& j : jobs_) {
    if (j->beam_width > 0 && j->unfinished > 0) searching.push_back(j.get());
  }
  for (GenerateJob* j : searching) after_beam_step(j);
  // Close the streams whose branches all finished this step.
  close_finished_jobs();
  update_gauges();
  return true;
}

void Scheduler::Impl::fail_stalled(const Status& status, const CacheNamespace* only) {
  auto chosen = [&](const Tree* t) {
    return only == nullptr || (t != nullptr && t->owner->ns == *only);
  };
  for (auto& v : verifies_) {
    if (!v->done || !v->branch || !chosen(v->branch->tree)) continue;
    v->branch->activity = Activity::kIdle;
    v->branch->verify = nullptr;
    v->branch = nullptr;
    v->done(status);
    v->done = nullptr;
  }
  // New trees that cannot be prefilled leave nothing behind.
  std::vector<std::string> doomed;
  for (auto& p : prefills_) {
    if (!p->done || !p->branch || !chosen(p->branch->tree)) continue;
    SchedBranch* b = p->branch;
    auto done = std::move(p->done);
    p->done = nullptr;
    p->branch = nullptr;
    b->prefill = nullptr;
    b->activity = Activity::kIdle;
    doomed.push_back(b->tree->id);
    done(status);
  }
  for (const std::string& id : doomed) {
    auto it = trees_.find(id);
    if (it == trees_.end()) continue;
    int64_t freed = 0;
    remove_tree(it->second.get(), /*retain_kv=*/false, &freed);
  }
  std::vector<GenerateJob*> jobs;
  for (auto& j : jobs_) {
    if (j->unfinished > 0 && chosen(j->tree)) jobs.push_back(j.get());
  }
  for (GenerateJob* j : jobs) maybe_close_job(j, status);
  update_gauges();
}

void Scheduler::Impl::after_prefill(StepEntry& e) {
  SchedBranch* b = e.branch;
  PrefillJob* p = b->prefill;
  if (!p || b->pending.size() > 1) return;  // more chunks to go
  b->prefill = nullptr;
  b->activity = Activity::kIdle;
  // The prompt becomes matchable at once: trees created while this one lives reuse it.
  if (options_.prefix_sharing && b->kv) (void)kv_->commit(*b->kv);
  auto done = std::move(p->done);
  p->done = nullptr;
  p->branch = nullptr;
  touch(b->tree);  // the lease counts from the end of the prefill
  done(CreateTreeResult{b->tree->id, b->id, p->prompt_tokens, p->cached_tokens,
                        b->tree->lease.count()});
}

void Scheduler::Impl::after_generate(StepEntry& e) {
  if (e.logit_index < 0) return;  // a chunk of appended text; the logits come later
  SchedBranch* b = e.branch;
  GenerateJob* job = b->job;
  if (!job) return;
  GenerateBranchState* st = nullptr;
  for (GenerateBranchState& s : job->branches) {
    if (s.branch == b && !s.finished) st = &s;
  }
  if (!st) return;
  const SampledToken t = sample(e.logit_index, job->sampling, b, b->kv_len);
  b->pending.assign(1, t.token);
  ++st->generated;
  if (metrics_) {
    const auto now = std::chrono::steady_clock::now();
    metrics_->generation_tokens_total->inc();
    if (st->generated == 1) {
      if (!job->first_token_seen) {
        metrics_->time_to_first_token_seconds->observe(
            std::chrono::duration<double>(now - job->start).count());
        job->first_token_seen = true;
      }
    } else {
      metrics_->inter_token_latency_seconds->observe(
          std::chrono::duration<double>(now - st->last_token_time).count());
    }
    st->last_token_time = now;
  }

  TokenEvent ev;
  ev.branch_id = st->branch_id;
  ev.token_id = t.token;
  ev.logprob = t.logprob;
  ev.top_logprobs = t.top;
  if (st->generated == 1 && job->prompt_tokens > 0) {
    ev.prompt_tokens = job->prompt_tokens;
    ev.cached_tokens = job->cached_tokens;
  }
  StatusOr<std::string> piece = st->detok->push(t.token);
  if (piece.ok()) ev.text = *piece;
  const size_t before = st->text.size();
  st->text += ev.text;

  FinishReason reason = FinishReason::kNone;
  if (std::find(eos_ids_.begin(), eos_ids_.end(), t.token) != eos_ids_.end()) {
    reason = FinishReason::kEos;
  } else if (std::find(job->stop_token_ids.begin(), job->stop_token_ids.end(), t.token) !=
             job->stop_token_ids.end()) {
    reason = FinishReason::kStop;
  } else if (size_t at = find_stop(st->text, job->stop, before); at != std::string::npos) {
    // The stop string itself is not returned: cut this token's text where it begins.
    reason = FinishReason::kStop;
    ev.text = at > before ? st->text.substr(before, at - before) : "";
  } else if (st->generated >= job->max_tokens ||
             (options_.max_sequence_tokens > 0 && b->length() >= options_.max_sequence_tokens)) {
    reason = FinishReason::kLength;
  }
  if (reason == FinishReason::kNone) {
    job->stream->push(std::move(ev));
  } else {
    finish_job_branch(job, *st, reason, &ev);
  }
}

void Scheduler::Impl::after_verify(StepEntry& e) {
  SchedBranch* b = e.branch;
  VerifyJob* v = b->verify;
  if (!v) return;
  // Walk down the token tree: sample the model's token at the current node (greedy at
  // temperature 0); if a child draft carries it, accept that child and continue from it.
  // Sampling from the target distribution and matching against the drafts keeps the output
  // distributed exactly as plain decoding would.
  std::vector<int32_t> path;
  int32_t node = -1;
  int32_t logit = e.logit_index;
  int32_t bonus = 0;
  for (;;) {
    const SampledToken t = sample(logit, v->sampling, b, b->kv_len + int64_t(path.size()));
    int32_t next = -1;
    for (size_t i = 0; i < v->tokens.size(); ++i) {
      if (v->parents[i] == node && v->tokens[i] == t.token) {
        next = static_cast<int32_t>(i);
        break;
      }
    }
    if (next < 0) {
      bonus = t.token;
      break;
    }
    path.push_back(next);
    node = next;
    logit = e.draft_logits + next;
  }
  std::vector<SlotMove> moves;
  Status accepted = kv_->accept(*b->kv, path, &moves);
  b->verify = nullptr;
  b->activity = Activity::kIdle;
  auto done = std::move(v->done);
  v->done = nullptr;
  v->branch = nullptr;
  touch(b->tree);
  if (!accepted.ok()) {
    done(Internal("accepting the verified path failed: " + accepted.message()));
    return;
  }
  for (const SlotMove& m : moves) {
    const int32_t ps = kv_->page_size();
    deferred_moves_.push_back(
        {int64_t(m.src.page) * ps + m.src.slot, int64_t(m.dst.page) * ps + m.dst.slot});
  }
  VerifyResult r;
  for (int32_t i : path) r.accepted_tokens.push_back(v->tokens[i]);
  r.bonus_token = bonus;
  b->kv_len += static_cast<int32_t>(path.size());
  b->pending.assign(1, bonus);
  if (metrics_) metrics_->verify_accepted_tokens->observe(static_cast<double>(path.size()));
  done(std::move(r));
}

}  // namespace treeserve
