// Tree-of-thought BFS over the Scheduler's public calls (see tree_search.h). One level:
// Branch every frontier node `expand` ways, one Generate over all the children, score, keep
// the best, Prune the rest. The search remembers every branch it created so that a failed
// or cancelled search can prune them all (pruning its level-1 branches takes every
// descendant with them).
#include "scheduler/tree_search.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "common/metrics.h"
#include "models/detokenizer.h"

namespace treeserve {

namespace {

constexpr std::chrono::milliseconds kCancelPoll{20};

// A branch the search created.
struct SearchNode {
  std::string parent;  // the search root for level 1
  int32_t level = 0;
  std::vector<int32_t> path_tokens;  // every token below the search root, this thought's last
  double path_logprob = 0;
  double score = 0;
  FinishReason finish = FinishReason::kNone;
  bool pruned = false;
};

class TreeSearch {
 public:
  TreeSearch(Scheduler* scheduler, const Tokenizer& tokenizer, const TreeSearchSpec& spec,
             const TreeSearchHooks& hooks)
      : scheduler_(scheduler), tokenizer_(tokenizer), spec_(spec), hooks_(hooks) {}

  StatusOr<SearchResult> run();

 private:
  Status check_spec();
  StatusOr<std::vector<std::string>> fork_frontier(int32_t level);
  StatusOr<SearchLevel> generate_level(int32_t level, const std::vector<std::string>& children);
  Status select(const SearchLevel& level, const SearchScores& client_scores);
  Status prune_unneeded();
  StatusOr<SearchResult> result(int32_t levels) const;
  // Prunes everything the search created and returns `why`.
  Status fail(Status why);

  Scheduler* scheduler_;
  const Tokenizer& tokenizer_;
  const TreeSearchSpec& spec_;
  const TreeSearchHooks& hooks_;
  std::string root_;
  std::map<std::string, SearchNode> nodes_;
  std::vector<std::string> level_one_;  // created directly under the search root
  std::vector<std::string> frontier_;   // kept, to expand next level
  std::vector<std::string> finished_;   // kept, ended with EOS: leaves for good
};

Status TreeSearch::check_spec() {
  if (spec_.expand < 1) return InvalidArgument("expand: must be >= 1");
  if (spec_.keep < 1) return InvalidArgument("keep: must be >= 1");
  if (spec_.depth < 1) return InvalidArgument("depth: must be >= 1");
  const int64_t per_level = int64_t(spec_.expand) * spec_.keep;
  const int32_t limit = scheduler_->options().max_branches_per_tree;
  if (per_level > limit) {
    return InvalidArgument("expand * keep: " + std::to_string(per_level) +
                           " candidates per level is over the limit of " + std::to_string(limit) +
                           " branches per tree");
  }
  StatusOr<TreeSummary> tree = scheduler_->get_tree(spec_.tree_id, {}, spec_.tenant);
  if (!tree.ok()) return tree.status();
  const BranchSummary* root = nullptr;
  for (const BranchSummary& b : tree->branches) {
    if (spec_.branch_id.empty() ? b.parent_branch_id.empty() : b.branch_id == spec_.branch_id) {
      root = &b;
      break;
    }
  }
  if (!root) {
    return NotFound("branch_id: unknown branch '" + spec_.branch_id + "' in tree " + spec_.tree_id +
                    " (never created, or pruned)");
  }
  root_ = root->branch_id;
  return Status::Ok();
}

Status TreeSearch::fail(Status why) {
  // Pruning the level-1 branches still live takes every descendant with them. One the search
  // or another call pruned already is unknown (NOT_FOUND): then they go one by one.
  std::vector<std::string> live;
  for (const std::string& id : level_one_) {
    if (!nodes_.at(id).pruned) live.push_back(id);
  }
  if (!live.empty()) {
    StatusOr<PruneSummary> p =
        scheduler_->prune(spec_.tree_id, live, /*retain_kv=*/false, spec_.tenant);
    if (!p.ok() && p.status().code() == StatusCode::kNotFound) {
      for (const std::string& id : live) {
        p = scheduler_->prune(spec_.tree_id, {id}, /*retain_kv=*/false, spec_.tenant);
        if (!p.ok() && p.status().code() != StatusCode::kNotFound) break;
      }
    }
    if (!p.ok() && p.status().code() != StatusCode::kNotFound) {
      spdlog::warn("tree={} search from {}: pruning its branches failed: {}", spec_.tree_id, root_,
                   p.status().message());
    }
  }
  spdlog::debug("tree={} search from {} ended: {}", spec_.tree_id, root_, why.ToString());
  return why;
}

StatusOr<std::vector<std::string>> TreeSearch::fork_frontier(int32_t level) {
  std::vector<std::string> children;
  for (const std::string& parent : frontier_) {
    StatusOr<std::vector<std::string>> ids =
        scheduler_->branch(spec_.tree_id, parent, spec_.expand, /*at_offset=*/0,
                           /*cancelled=*/nullptr, spec_.tenant);
    if (!ids.ok()) return ids.status();
    const SearchNode* from = parent == root_ ? nullptr : &nodes_.at(parent);
    for (const std::string& id : *ids) {
      SearchNode& n = nodes_[id];
      n.parent = parent;
      n.level = level;
      if (from) {
        n.path_tokens = from->path_tokens;
        n.path_logprob = from->path_logprob;
      }
      if (level == 1) level_one_.push_back(id);
      children.push_back(id);
    }
  }
  return children;
}

// One Generate over every child: they decode in the same steps. Cancellation is polled
// between events (at most kCancelPoll apart); the scheduler then stops the children within
// one step.
StatusOr<SearchLevel> TreeSearch::generate_level(int32_t level,
                                                 const std::vector<std::string>& children) {
  GenerateSpec g;
  g.tenant = spec_.tenant;
  g.tree_id = spec_.tree_id;
  g.branch_ids = children;
  g.sampling = spec_.sampling;
  g.max_tokens = spec_.max_tokens;
  g.stop = spec_.stop;
  g.stop_token_ids = spec_.stop_token_ids;
  StatusOr<std::shared_ptr<GenerateStream>> stream = scheduler_->generate(std::move(g));
  if (!stream.ok()) return stream.status();

  SearchLevel out;
  out.level = level;
  std::map<std::string, size_t> index;
  for (const std::string& id : children) {
    index[id] = out.candidates.size();
    SearchCandidate c;
    c.branch_id = id;
    c.parent_branch_id = nodes_.at(id).parent;
    out.candidates.push_back(std::move(c));
  }
  bool cancelled = false;
  TokenEvent ev;
  Status final_status;
  for (;;) {
    const GenerateStream::Wait w = (*stream)->next(&ev, &final_status, kCancelPoll);
    if (w == GenerateStream::Wait::kEnd) break;
    if (w == GenerateStream::Wait::kEvent) {
      auto it = index.find(ev.branch_id);
      if (it != index.end()) {
        SearchCandidate& c = out.candidates[it->second];
        c.text += ev.text;
        if (ev.token_id >= 0) {
          ++c.tokens;
          c.logprob += ev.logprob;
          nodes_.at(c.branch_id).path_tokens.push_back(ev.token_id);
        }
        if (ev.finish != FinishReason::kNone) c.finish = ev.finish;
      }
    }
    if (!cancelled && hooks_.cancelled && hooks_.cancelled()) {
      cancelled = true;
      (*stream)->cancel();  // drained below: the children end FINISH_CANCELLED
    }
  }
  if (cancelled) return Cancelled("the client cancelled the tree search");
  if (!final_status.ok()) return final_status;
  for (SearchCandidate& c : out.candidates) {
    SearchNode& n = nodes_.at(c.branch_id);
    n.path_logprob += c.logprob;
    n.finish = c.finish;
    const size_t path = n.path_tokens.size();
    c.logprob_score = path > 0 ? n.path_logprob / double(path) : 0.0;
  }
  return out;
}

// Keeps the best candidates for the free slots (keep minus the finished leaves), by the
// client's scores or the logprob score; ties go to the earlier candidate.
Status TreeSearch::select(const SearchLevel& level, const SearchScores& client_scores) {
  const bool by_client = spec_.score_mode == SearchScoreMode::kClient;
  if (by_client) {
    std::set<std::string> ids;
    for (const SearchCandidate& c : level.candidates) ids.insert(c.branch_id);
    for (const auto& [id, score] : client_scores) {
      if (!ids.count(id)) {
        return InvalidArgument("scores: '" + id + "' is not a candidate of level " +
                               std::to_string(level.level));
      }
      if (!std::isfinite(score)) {
        return InvalidArgument("scores[" + id + "]: must be a finite number");
      }
    }
    for (const SearchCandidate& c : level.candidates) {
      if (!client_scores.count(c.branch_id)) {
        return InvalidArgument("scores: no score for candidate " + c.branch_id + " of level " +
                               std::to_string(level.level));
      }
    }
  }
  std::vector<const SearchCandidate*> order;
  for (const SearchCandidate& c : level.candidates) {
    SearchNode& n = nodes_.at(c.branch_id);
    n.score = by_client ? client_scores.at(c.branch_id) : c.logprob_score;
    // A thought stopped by another call (Prune of a search branch) cannot be kept.
    if (c.tokens > 0 && c.finish != FinishReason::kPruned && c.finish != FinishReason::kCancelled) {
      order.push_back(&c);
    }
  }
  if (order.empty()) {
    return FailedPrecondition("every candidate of level " + std::to_string(level.level) +
                              " was pruned by another call");
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](const SearchCandidate* a, const SearchCandidate* b) {
                     return nodes_.at(a->branch_id).score > nodes_.at(b->branch_id).score;
                   });
  const size_t slots = size_t(std::max<int64_t>(0, int64_t(spec_.keep) - finished_.size()));
  frontier_.clear();
  for (size_t i = 0; i < order.size() && i < slots; ++i) {
    if (order[i]->finish == FinishReason::kEos) {
      finished_.push_back(order[i]->branch_id);
    } else {
      frontier_.push_back(order[i]->branch_id);
    }
  }
  return Status::Ok();
}

// Prunes every search branch that is neither kept nor an ancestor of a kept one.
Status TreeSearch::prune_unneeded() {
  std::set<std::string> needed;
  for (const auto* list : {&frontier_, &finished_}) {
    for (const std::string& id : *list) {
      for (std::string cur = id; cur != root_ && needed.insert(cur).second;) {
        cur = nodes_.at(cur).parent;
      }
    }
  }
  std::vector<std::string> doomed;
  for (auto& [id, n] : nodes_) {
    if (n.pruned || needed.count(id)) continue;
    n.pruned = true;
    doomed.push_back(id);
  }
  if (doomed.empty()) return Status::Ok();
  StatusOr<PruneSummary> p =
      scheduler_->prune(spec_.tree_id, doomed, /*retain_kv=*/false, spec_.tenant);
  return p.ok() ? Status::Ok() : p.status();
}

StatusOr<SearchResult> TreeSearch::result(int32_t levels) const {
  SearchResult out;
  out.levels = levels;
  for (const auto* list : {&finished_, &frontier_}) {
    for (const std::string& id : *list) {
      const SearchNode& n = nodes_.at(id);
      SearchLeaf leaf;
      leaf.branch_id = id;
      leaf.tokens = int32_t(n.path_tokens.size());
      leaf.score = n.score;
      leaf.finish = n.finish;
      leaf.level = n.level;
      IncrementalDetokenizer detok(tokenizer_, scheduler_->detokenizer_vocab());
      for (int32_t t : n.path_tokens) {
        StatusOr<std::string> piece = detok.push(t);
        if (!piece.ok()) return piece.status();
        leaf.text += *piece;
      }
      StatusOr<std::string> rest = detok.flush();
      if (!rest.ok()) return rest.status();
      leaf.text += *rest;
      out.leaves.push_back(std::move(leaf));
    }
  }
  std::stable_sort(out.leaves.begin(), out.leaves.end(),
                   [](const SearchLeaf& a, const SearchLeaf& b) { return a.score > b.score; });
  return out;
}

StatusOr<SearchResult> TreeSearch::run() {
  TS_RETURN_IF_ERROR(check_spec());
  // The tree's lease cannot run out between the search's own calls (while the client
  // scores a level, say); letting go renews it.
  TS_RETURN_IF_ERROR(scheduler_->hold_tree(spec_.tree_id, spec_.tenant));
  struct Release {
    Scheduler* s;
    const std::string& tree;
    const std::string& tenant;
    ~Release() { s->release_tree(tree, tenant); }
  } release{scheduler_, spec_.tree_id, spec_.tenant};
  ServerMetrics* metrics = scheduler_->metrics();
  if (metrics) metrics->tree_search_total->inc();
  frontier_ = {root_};
  int32_t levels = 0;
  for (int32_t level = 1; level <= spec_.depth && !frontier_.empty(); ++level) {
    StatusOr<std::vector<std::string>> children = fork_frontier(level);
    if (!children.ok()) return fail(children.status());
    StatusOr<SearchLevel> lv = generate_level(level, *children);
    if (!lv.ok()) return fail(lv.status());
    SearchScores scores;
    if (hooks_.on_level) {
      if (Status s = hooks_.on_level(*lv, &scores); !s.ok()) return fail(s);
    } else if (spec_.score_mode == SearchScoreMode::kClient) {
      return fail(InvalidArgument("score_mode: client scoring needs a scorer"));
    }
    if (Status s = select(*lv, scores); !s.ok()) return fail(s);
    if (Status s = prune_unneeded(); !s.ok()) return fail(s);
    levels = level;
    if (metrics) metrics->tree_search_levels_total->inc();
  }
  StatusOr<SearchResult> out = result(levels);
  if (!out.ok()) return fail(out.status());
  spdlog::debug("tree={} search from {}: {} levels, {} leaves", spec_.tree_id, root_, levels,
                out->leaves.size());
  return out;
}

}  // namespace

StatusOr<SearchResult> run_tree_search(Scheduler* scheduler, const Tokenizer& tokenizer,
                                       const TreeSearchSpec& spec, const TreeSearchHooks& hooks) {
  return TreeSearch(scheduler, tokenizer, spec, hooks).run();
}

}  // namespace treeserve
