// Server-side beam search, driven by the same step loop as sampling: each beam is a branch
// (a child of the searched branch); every step the live beams each propose their most likely
// next tokens, the best continuations by total logprob are kept — a beam with several kept
// continuations is forked (its KV shared), a beam with none is pruned — and ended beams
// (EOS or a stop token id) stop running. At the end the best beams are streamed, best first.
// A cancelled search ends the same way (its unfinished beams' last events say
// FINISH_CANCELLED): the beams that have tokens stay as live children of the searched branch,
// so no work is lost. A search that fails (no KV pages, a failed step, shutdown) prunes them.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

#include "common/metrics.h"
#include "scheduler/detail/scheduler_impl.h"

namespace treeserve {

double Scheduler::Impl::beam_score(const GenerateJob& job, const Beam& beam) const {
  if (job.length_penalty == 0 || beam.tokens.empty()) return beam.total;
  return beam.total / std::pow(double(beam.tokens.size()), double(job.length_penalty));
}

Status Scheduler::Impl::start_beam_search(GenerateJob* job, SchedBranch* root) {
  StatusOr<std::vector<std::string>> ids =
      cmd_branch(root->tree->id, root->id, 1, 0, root->tree->owner->limits.tenant);
  if (!ids.ok()) return ids.status();
  SchedBranch* b = root->tree->by_id[ids->front()];
  b->activity = Activity::kBeam;
  b->beam_job = job;
  Beam first;
  first.branch = b;
  job->beams.push_back(std::move(first));
  job->unfinished = 1;
  return Status::Ok();
}

SamplingParams Scheduler::Impl::beam_step_sampling(const GenerateJob& job) {
  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.logprobs = std::min(kMaxLogprobs, std::max(2, 2 * job.beam_width));
  return greedy;
}

void Scheduler::Impl::after_beam_step(GenerateJob* job) {
  struct Candidate {
    int32_t beam;
    int32_t token;
    float logprob;
    double total;
  };
  std::vector<Candidate> candidates;
  const SamplingParams greedy = beam_step_sampling(*job);
  int32_t ended = 0;
  for (size_t i = 0; i < job->beams.size(); ++i) {
    Beam& beam = job->beams[i];
    if (beam.ended) ++ended;
    if (beam.ended || !beam.branch || beam.logit_index < 0) continue;
    const SampledToken t = sample(beam.logit_index, greedy, beam.branch, beam.branch->kv_len);
    for (const TokenLogprob& alt : t.top) {
      candidates.push_back({int32_t(i), alt.token, alt.logprob, beam.total + alt.logprob});
    }
  }
  if (candidates.empty()) return;  // every live beam is still prefilling
  ++job->beam_steps;
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const Candidate& a, const Candidate& b) { return a.total > b.total; });
  const int32_t slots = std::max(0, job->beam_width - ended);
  candidates.resize(std::min<size_t>(candidates.size(), size_t(slots)));

  // Which continuations each beam keeps; beams that ran and keep none are pruned.
  std::vector<std::vector<const Candidate*>> kept(job->beams.size());
  for (const Candidate& c : candidates) kept[c.beam].push_back(&c);
  std::vector<Beam> next;
  for (size_t i = 0; i < job->beams.size(); ++i) {
    Beam& beam = job->beams[i];
    if (!beam.branch) continue;
    if (beam.ended || beam.logit_index < 0) {
      next.push_back(beam);  // ended, or still prefilling: unchanged
      continue;
    }
    SchedBranch* b = beam.branch;
    if (kept[i].empty()) {
      b->beam_job = nullptr;
      end_branch(b, /*retain_kv=*/false, FinishReason::kPruned);
      continue;
    }
    std::vector<SchedBranch*> holders = {b};
    if (kept[i].size() > 1) {
      const int32_t extra = int32_t(kept[i].size()) - 1;
      const Status quota = check_branch_quota(*b->tree->owner, extra);
      StatusOr<ForkResult> forked =
          quota.ok() ? kv_->fork(*b->kv, extra, 0) : StatusOr<ForkResult>(quota);
      if (!forked.ok()) {
        // No pages (or no branches left in the tenant's quota) for the extra continuations:
        // keep only the best one of this beam.
        kept[i].resize(1);
      } else {
        for (const PageCopy& c : forked->copies) {
          deferred_copies_.push_back({c.src_page, c.dst_page, c.num_slots});
        }
        for (BranchId id : forked->branches) {
          SchedBranch* child = add_branch(b->tree, b, b->length());
          child->kv = id;
          child->kv_len = b->kv_len;
          child->activity = Activity::kBeam;
          child->beam_job = job;
          holders.push_back(child);
        }
      }
    }
    for (size_t j = 0; j < kept[i].size(); ++j) {
      const Candidate& c = *kept[i][j];
      Beam nb = beam;
      nb.branch = holders[j];
      nb.branch->pending.assign(1, c.token);
      nb.tokens.push_back(c.token);
      nb.logprobs.push_back(c.logprob);
      nb.total = c.total;
      nb.logit_index = -1;
      if (std::find(eos_ids_.begin(), eos_ids_.end(), c.token) != eos_ids_.end()) {
        nb.ended = true;
        nb.reason = FinishReason::kEos;
      } else if (std::find(job->stop_token_ids.begin(), job->stop_token_ids.end(), c.token) !=
                 job->stop_token_ids.end()) {
        nb.ended = true;
        nb.reason = FinishReason::kStop;
      } else if (options_.max_sequence_tokens > 0 &&
                 nb.branch->length() >= options_.max_sequence_tokens) {
        nb.ended = true;
        nb.reason = FinishReason::kLength;
      }
      next.push_back(std::move(nb));
    }
  }
  job->beams = std::move(next);
  if (metrics_) metrics_->generation_tokens_total->inc(double(candidates.size()));
  const bool running = std::any_of(job->beams.begin(), job->beams.end(),
                                   [](const Beam& b) { return !b.ended && b.branch; });
  if (!running || job->beam_steps >= job->max_tokens) finish_beam_search(job, Status::Ok());
}

void Scheduler::Impl::finish_beam_search(GenerateJob* job, Status status) {
  std::vector<Beam*> order;
  for (Beam& b : job->beams) {
    if (b.branch) order.push_back(&b);
  }
  std::stable_sort(order.begin(), order.end(), [&](const Beam* a, const Beam* b) {
    return beam_score(*job, *a) > beam_score(*job, *b);
  });
  const bool cancelled = status.code() == StatusCode::kCancelled;
  for (Beam* beam : order) {
    SchedBranch* b = beam->branch;
    b->beam_job = nullptr;
    b->activity = Activity::kIdle;
    if ((!status.ok() && !cancelled) || beam->tokens.empty()) {
      end_branch(b, /*retain_kv=*/false, FinishReason::kCancelled);
      continue;
    }
    // The beam's tokens, each with its text; the last carries the reason and the score.
    IncrementalDetokenizer detok(*tokenizer_, detok_vocab_.get());
    for (size_t i = 0; i < beam->tokens.size(); ++i) {
      TokenEvent ev;
      ev.branch_id = b->id;
      ev.token_id = beam->tokens[i];
      ev.logprob = beam->logprobs[i];
      StatusOr<std::string> piece = detok.push(beam->tokens[i]);
      if (piece.ok()) ev.text = *piece;
      if (i + 1 == beam->tokens.size()) {
        StatusOr<std::string> rest = detok.flush();
        if (rest.ok()) ev.text += *rest;
        ev.finish = beam->ended ? beam->reason
                    : cancelled ? FinishReason::kCancelled
                                : FinishReason::kLength;
        ev.score = float(beam_score(*job, *beam));
      }
      job->stream->push(std::move(ev));
    }
  }
  job->beams.clear();
  job->unfinished = 0;
  maybe_close_job(job, status);
}

}  // namespace treeserve
