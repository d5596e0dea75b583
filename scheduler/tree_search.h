// Tree-of-thought breadth-first search, driven from outside the step loop through the
// Scheduler's public calls (Branch, Generate, Prune), so it batches with everything else:
// every level, each kept node is forked `expand` ways (the children share its KV), all new
// children generate one "thought" in a single Generate call (they decode in the same steps),
// the candidates are scored — by their mean token logprob, or by the caller — and the best
// `keep` are kept; the rest, and kept nodes left without kept descendants, are pruned.
//
// A thought that ends with EOS is a finished leaf: when kept it is not expanded again and
// holds one of the `keep` slots until the end (as beam search holds ended beams). The search
// ends after `depth` levels, or earlier when every kept node has finished.
//
// Failure, cancellation or a bad score leaves the tree as it was: every branch the search
// created is pruned (their pages released). On success the kept leaves and their ancestors
// up to the search root stay in the tree for the caller to use. The search holds its tree
// (Scheduler::hold_tree), so the tree's lease cannot run out while it runs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/scheduler.h"

namespace treeserve {

class Tokenizer;

enum class SearchScoreMode { kLogprob, kClient };

struct TreeSearchSpec {
  std::string tenant;  // who the search acts for (scheduler.h, "Tenants")
  std::string tree_id;
  std::string branch_id;  // the search root; empty = the tree's root branch
  int32_t expand = 2;     // k: children per kept node per level
  int32_t keep = 1;       // b: nodes kept per level
  int32_t depth = 1;      // levels
  // Each thought: sampled with these parameters, up to max_tokens (0 = the scheduler
  // default), ended early by a stop string / stop token id / EOS.
  SamplingParams sampling;
  int32_t max_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  SearchScoreMode score_mode = SearchScoreMode::kLogprob;
};

struct SearchCandidate {
  std::string branch_id;
  std::string parent_branch_id;
  std::string text;  // this thought's text, as Generate streams it (stop string cut)
  int32_t tokens = 0;
  double logprob = 0;  // sum of the thought's token logprobs
  // Mean token logprob over the path from the search root (ancestors' thoughts and this
  // one): comparable between thoughts of different lengths and between levels.
  double logprob_score = 0;
  FinishReason finish = FinishReason::kNone;
};

struct SearchLevel {
  int32_t level = 0;  // 1-based
  std::vector<SearchCandidate> candidates;
};

struct SearchLeaf {
  std::string branch_id;
  // The text of every token the branch gained below the search root (stop strings included:
  // they are in the branch), decoded as one sequence.
  std::string text;
  int32_t tokens = 0;
  double score = 0;                           // the score it was kept by (client or logprob score)
  FinishReason finish = FinishReason::kNone;  // of its last thought
  int32_t level = 0;                          // the level it was produced at
};

struct SearchResult {
  std::vector<SearchLeaf> leaves;  // best first
  int32_t levels = 0;              // levels run
};

using SearchScores = std::map<std::string, double>;

struct TreeSearchHooks {
  // After each level's thoughts are generated. In client mode it fills *scores with one
  // finite score per candidate (anything else ends the search INVALID_ARGUMENT); an error it
  // returns ends the search with that error (the server's DEADLINE_EXCEEDED when the client
  // sent no scores in time). May be empty in logprob mode.
  std::function<Status(const SearchLevel& level, SearchScores* scores)> on_level;
  // Polled while a level generates; true ends the search CANCELLED. May be empty.
  std::function<bool()> cancelled;
};

// Runs the search on the caller's thread (blocking); `tokenizer` is the one the scheduler was
// created with (the leaves' text uses the scheduler's detokenizer table). Errors: NOT_FOUND for an
// unknown tree or branch (a pruned search root is unknown), INVALID_ARGUMENT for
// expand/keep/ depth < 1 or expand * keep over SchedulerOptions::max_branches_per_tree, and
// whatever the scheduler calls return (RESOURCE_EXHAUSTED when the pool cannot hold a level).
StatusOr<SearchResult> run_tree_search(Scheduler* scheduler, const Tokenizer& tokenizer,
                                       const TreeSearchSpec& spec, const TreeSearchHooks& hooks);

}  // namespace treeserve
