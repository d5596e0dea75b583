// The tree-of-thought BFS controller (scheduler/tree_search.h) over a real scheduler: CPU
// backend, tiny model, no gRPC, so it also runs under the sanitizers. Checks which nodes are
// kept in logprob and client mode, that losers are pruned, the error table, cancellation
// mid-level and pool exhaustion leave the tree as it was, and the pool ends idle.
#include "scheduler/tree_search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include "common/metrics.h"
#include "engine/backend.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "tests/scheduler/scheduler_test_util.h"

namespace treeserve {
namespace {

using testing::expect_idle;
using testing::prompt;
using testing::serve;
using testing::Served;

std::set<std::string> live_branches(Scheduler& s, const std::string& tree) {
  std::set<std::string> out;
  auto info = s.get_tree(tree);
  EXPECT_TRUE(info.ok());
  if (!info.ok()) return out;
  for (const BranchSummary& b : info->branches) {
    if (b.live) out.insert(b.branch_id);
  }
  return out;
}

std::map<std::string, int32_t> lengths(Scheduler& s, const std::string& tree) {
  std::map<std::string, int32_t> out;
  auto info = s.get_tree(tree);
  if (!info.ok()) return out;
  for (const BranchSummary& b : info->branches) out[b.branch_id] = b.length;
  return out;
}

TreeSearchSpec sampled_spec(const std::string& tree, int k, int b, int depth, int max_tokens) {
  TreeSearchSpec spec;
  spec.tree_id = tree;
  spec.expand = k;
  spec.keep = b;
  spec.depth = depth;
  spec.sampling.temperature = 1.0f;
  spec.sampling.seed = 11;
  spec.max_tokens = max_tokens;
  return spec;
}

// Records every level; in client mode scores each candidate with `score_of`.
struct Recorder {
  std::vector<SearchLevel> levels;
  std::function<double(const SearchCandidate&, size_t)> score_of;
  TreeSearchHooks hooks() {
    TreeSearchHooks h;
    h.on_level = [this](const SearchLevel& level, SearchScores* scores) {
      levels.push_back(level);
      if (score_of) {
        for (size_t i = 0; i < level.candidates.size(); ++i) {
          (*scores)[level.candidates[i].branch_id] = score_of(level.candidates[i], i);
        }
      }
      return Status::Ok();
    };
    return h;
  }
};

// The ids of the best `b` candidates by `key` (ties to the earlier one).
std::vector<std::string> best(const SearchLevel& level, size_t b,
                              const std::function<double(const SearchCandidate&)>& key) {
  std::vector<const SearchCandidate*> order;
  for (const SearchCandidate& c : level.candidates) order.push_back(&c);
  std::stable_sort(order.begin(), order.end(), [&](auto* x, auto* y) { return key(*x) > key(*y); });
  std::vector<std::string> out;
  for (size_t i = 0; i < b && i < order.size(); ++i) out.push_back(order[i]->branch_id);
  return out;
}

TEST(SchedulerTreeSearch, LogprobModeKeepsTheBestAndPrunesTheRest) {
  MetricsRegistry registry;
  ServerMetrics metrics(&registry);
  Served sv = serve(256, {}, &metrics);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(30, 1));
  ASSERT_TRUE(tree.ok());
  const std::string root = tree->root_branch_id;
  const int32_t root_len = lengths(s, tree->tree_id).at(root);
  Recorder rec;
  auto r = run_tree_search(&s, *sv.tokenizer, sampled_spec(tree->tree_id, 3, 2, 3, 5), rec.hooks());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->levels, 3);
  ASSERT_EQ(rec.levels.size(), 3u);
  EXPECT_EQ(metrics.tree_search_total->value(), 1);
  EXPECT_EQ(metrics.tree_search_levels_total->value(), 3);
  // Every engine step's forward and host time went to the step histograms.
  std::vector<uint64_t> cumulative;
  double forward_sum = 0, host_sum = 0;
  uint64_t forward_count = 0, host_count = 0;
  metrics.step_forward_seconds->snapshot(&cumulative, &forward_sum, &forward_count);
  metrics.step_host_seconds->snapshot(&cumulative, &host_sum, &host_count);
  EXPECT_EQ(int64_t(forward_count), s.stats().steps);
  EXPECT_EQ(host_count, forward_count);
  EXPECT_GT(forward_sum, 0.0);
  EXPECT_GT(host_sum, 0.0);
  auto score = [](const SearchCandidate& c) { return c.logprob_score; };

  // Level 1: three children of the root. Each later level: `expand` children of each node
  // the previous level kept, and a path score that is the path's mean token logprob.
  std::map<std::string, const SearchCandidate*> by_id;
  std::vector<std::string> kept = {root};
  for (const SearchLevel& level : rec.levels) {
    ASSERT_EQ(level.candidates.size(), 3 * kept.size());
    std::map<std::string, int> per_parent;
    for (const SearchCandidate& c : level.candidates) {
      ++per_parent[c.parent_branch_id];
      EXPECT_GT(c.tokens, 0);
      EXPECT_LE(c.tokens, 5);
      double sum = c.logprob;
      int32_t n = c.tokens;
      for (auto it = by_id.find(c.parent_branch_id); it != by_id.end();
           it = by_id.find(it->second->parent_branch_id)) {
        sum += it->second->logprob;
        n += it->second->tokens;
      }
      EXPECT_NEAR(c.logprob_score, sum / n, 1e-6);
      by_id[c.branch_id] = &c;
    }
    for (const std::string& p : kept) EXPECT_EQ(per_parent[p], 3) << p;
    kept = best(level, 2, score);
  }
  // The leaves are the last level's two best, best first; their branches hold their paths.
  ASSERT_EQ(r->leaves.size(), 2u);
  EXPECT_EQ(r->leaves[0].branch_id, kept[0]);
  EXPECT_EQ(r->leaves[1].branch_id, kept[1]);
  EXPECT_GE(r->leaves[0].score, r->leaves[1].score);
  const auto len = lengths(s, tree->tree_id);
  std::set<std::string> expect_live = {root};
  for (const SearchLeaf& leaf : r->leaves) {
    EXPECT_EQ(leaf.score, by_id.at(leaf.branch_id)->logprob_score);
    EXPECT_EQ(leaf.level, 3);
    EXPECT_EQ(len.at(leaf.branch_id), root_len + leaf.tokens);
    EXPECT_FALSE(leaf.text.empty());
    // Losers are pruned; the leaves and their ancestors stay.
    for (std::string id = leaf.branch_id; id != root; id = by_id.at(id)->parent_branch_id) {
      expect_live.insert(id);
    }
  }
  EXPECT_EQ(live_branches(s, tree->tree_id), expect_live);
  // A kept leaf is a normal branch.
  GenerateSpec more;
  more.tree_id = tree->tree_id;
  more.branch_ids = {r->leaves[0].branch_id};
  more.max_tokens = 2;
  auto stream = s.generate(more);
  ASSERT_TRUE(stream.ok());
  TokenEvent ev;
  Status end;
  while ((*stream)->next(&ev, &end, std::chrono::milliseconds(5000)) ==
         GenerateStream::Wait::kEvent) {
  }
  EXPECT_TRUE(end.ok()) << end.message();
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerTreeSearch, ClientModeKeepsWhatTheClientScoresBest) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 2));
  ASSERT_TRUE(tree.ok());
  auto first = s.branch(tree->tree_id, tree->root_branch_id, 1, 0);  // below a non-root branch
  ASSERT_TRUE(first.ok());
  TreeSearchSpec spec = sampled_spec(tree->tree_id, 3, 1, 3, 4);
  spec.branch_id = first->front();
  spec.score_mode = SearchScoreMode::kClient;
  Recorder rec;
  // The client prefers the last candidate of each level: the worst-listed, not the
  // logprob favourite.
  rec.score_of = [](const SearchCandidate&, size_t i) { return double(i); };
  auto r = run_tree_search(&s, *sv.tokenizer, spec, rec.hooks());
  ASSERT_TRUE(r.ok()) << r.status().message();
  ASSERT_EQ(rec.levels.size(), 3u);
  EXPECT_EQ(rec.levels[0].candidates[0].parent_branch_id, first->front());
  for (size_t l = 1; l < rec.levels.size(); ++l) {
    for (const SearchCandidate& c : rec.levels[l].candidates) {
      EXPECT_EQ(c.parent_branch_id, rec.levels[l - 1].candidates.back().branch_id);
    }
  }
  ASSERT_EQ(r->leaves.size(), 1u);
  EXPECT_EQ(r->leaves[0].branch_id, rec.levels[2].candidates.back().branch_id);
  EXPECT_EQ(r->leaves[0].score, 2.0);
  EXPECT_EQ(live_branches(s, tree->tree_id).size(), 5u);  // root, search root, 3 kept
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// A thought that ends with EOS is a finished leaf: kept, it is not expanded and holds its
// slot to the end. The client keeps an EOS thought (when the tiny model samples one) and one
// other thought at level 1; level 2 expands only the other.
TEST(SchedulerTreeSearch, EosThoughtsAreFinishedLeaves) {
  Served sv = serve(512);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(12, 7));
  ASSERT_TRUE(tree.ok());
  bool saw_eos = false;
  for (uint64_t seed = 1; seed <= 40 && !saw_eos; ++seed) {
    TreeSearchSpec spec = sampled_spec(tree->tree_id, 16, 2, 2, 24);
    spec.sampling.seed = seed;
    spec.score_mode = SearchScoreMode::kClient;
    std::string eos_id, other_id;
    std::vector<SearchLevel> levels;
    TreeSearchHooks hooks;
    hooks.on_level = [&](const SearchLevel& level, SearchScores* scores) {
      levels.push_back(level);
      for (const SearchCandidate& c : level.candidates) {
        double score = 0;
        if (level.level == 1 && c.finish == FinishReason::kEos && eos_id.empty()) {
          eos_id = c.branch_id;
          score = 10;
        } else if (level.level == 1 && c.finish != FinishReason::kEos && other_id.empty()) {
          other_id = c.branch_id;
          score = 5;
        }
        (*scores)[c.branch_id] = score;
      }
      return Status::Ok();
    };
    auto r = run_tree_search(&s, *sv.tokenizer, spec, hooks);
    ASSERT_TRUE(r.ok()) << r.status().message();
    if (eos_id.empty()) continue;
    saw_eos = true;
    ASSERT_EQ(levels.size(), 2u);
    ASSERT_EQ(levels[1].candidates.size(), 16u);  // one slot left: only `other` expands
    for (const SearchCandidate& c : levels[1].candidates) {
      EXPECT_EQ(c.parent_branch_id, other_id);
    }
    ASSERT_EQ(r->leaves.size(), 2u);
    EXPECT_EQ(r->leaves[0].branch_id, eos_id);
    EXPECT_EQ(r->leaves[0].finish, FinishReason::kEos);
    EXPECT_EQ(r->leaves[0].level, 1);
    EXPECT_EQ(r->leaves[1].level, 2);
    EXPECT_EQ(live_branches(s, tree->tree_id).count(eos_id), 1u);
  }
  EXPECT_TRUE(saw_eos) << "no seed made the tiny model end a thought with EOS";
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerTreeSearch, BadArgumentsAndBadScoresLeaveTheTreeAsItWas) {
  SchedulerOptions options;
  options.max_branches_per_tree = 8;
  Served sv = serve(256, options);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 3));
  ASSERT_TRUE(tree.ok());
  const SchedulerStats before = s.stats();
  const std::string t = tree->tree_id;
  const std::set<std::string> just_root = {tree->root_branch_id};
  auto code = [&](TreeSearchSpec spec, TreeSearchHooks hooks = {}) {
    return run_tree_search(&s, *sv.tokenizer, spec, hooks).status().code();
  };
  TreeSearchSpec spec = sampled_spec(t, 2, 2, 2, 3);
  spec.tree_id = "t_unknown";
  EXPECT_EQ(code(spec), StatusCode::kNotFound);
  spec = sampled_spec(t, 2, 2, 2, 3);
  spec.branch_id = "b_unknown";
  EXPECT_EQ(code(spec), StatusCode::kNotFound);
  EXPECT_EQ(code(sampled_spec(t, 0, 2, 2, 3)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(sampled_spec(t, 2, 0, 2, 3)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(sampled_spec(t, 2, 2, 0, 3)), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(sampled_spec(t, 3, 3, 1, 3)), StatusCode::kInvalidArgument);  // 9 > 8

  // Client scores that miss a candidate, name a stranger, or are not finite; a scorer that
  // fails: each ends the search with every branch it made pruned.
  spec = sampled_spec(t, 2, 1, 2, 3);
  spec.score_mode = SearchScoreMode::kClient;
  const std::vector<std::function<void(const SearchLevel&, SearchScores*)>> bad = {
      [](const SearchLevel& l, SearchScores* sc) { (*sc)[l.candidates[0].branch_id] = 1; },
      [](const SearchLevel& l, SearchScores* sc) {
        for (const SearchCandidate& c : l.candidates) (*sc)[c.branch_id] = 1;
        (*sc)["b_stranger"] = 2;
      },
      [](const SearchLevel& l, SearchScores* sc) {
        for (const SearchCandidate& c : l.candidates) {
          (*sc)[c.branch_id] = std::numeric_limits<double>::quiet_NaN();
        }
      },
  };
  for (const auto& fill : bad) {
    TreeSearchHooks hooks;
    hooks.on_level = [&](const SearchLevel& l, SearchScores* sc) {
      fill(l, sc);
      return Status::Ok();
    };
    EXPECT_EQ(code(spec, hooks), StatusCode::kInvalidArgument);
    EXPECT_EQ(live_branches(s, t), just_root);
  }
  // Failing at level 2, after level 1 kept a branch: that one goes too.
  TreeSearchHooks late;
  late.on_level = [](const SearchLevel& l, SearchScores* sc) {
    for (const SearchCandidate& c : l.candidates) (*sc)[c.branch_id] = 0;
    return l.level == 2 ? Cancelled("the scorer gave up") : Status::Ok();
  };
  EXPECT_EQ(code(spec, late), StatusCode::kCancelled);
  EXPECT_EQ(live_branches(s, t), just_root);
  // The server's scorer gave up waiting for the client (DEADLINE_EXCEEDED): the same.
  TreeSearchHooks slow;
  slow.on_level = [](const SearchLevel& l, SearchScores* sc) {
    for (const SearchCandidate& c : l.candidates) (*sc)[c.branch_id] = 0;
    return l.level == 2 ? Status(StatusCode::kDeadlineExceeded, "scores: none in time")
                        : Status::Ok();
  };
  EXPECT_EQ(code(spec, slow), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(live_branches(s, t), just_root);
  const SchedulerStats after = s.stats();
  EXPECT_EQ(after.kv_pages_free + after.kv_pages_evictable,
            before.kv_pages_free + before.kv_pages_evictable);

  // A pruned search root has left the tree: unknown.
  auto kid = s.branch(t, tree->root_branch_id, 1, 0);
  ASSERT_TRUE(kid.ok());
  ASSERT_TRUE(s.prune(t, *kid, false).ok());
  spec = sampled_spec(t, 2, 1, 1, 3);
  spec.branch_id = kid->front();
  EXPECT_EQ(code(spec), StatusCode::kNotFound);
  ASSERT_TRUE(s.delete_tree(t).ok());
  expect_idle(s);
}

TEST(SchedulerTreeSearch, CancelMidLevelPrunesEverythingItMade) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 4));
  ASSERT_TRUE(tree.ok());
  const SchedulerStats before = s.stats();
  // Cancelled while level 1 generates (1500-token thoughts), and while level 2 does, after
  // level 1 kept two branches.
  for (int at_level : {1, 2}) {
    TreeSearchSpec spec = sampled_spec(tree->tree_id, 2, 2, 3, at_level == 1 ? 1500 : 40);
    int levels = 0;
    int polls = 0;
    TreeSearchHooks hooks;
    hooks.on_level = [&](const SearchLevel&, SearchScores*) {
      ++levels;
      return Status::Ok();
    };
    hooks.cancelled = [&] { return levels + 1 == at_level && ++polls > 3; };
    auto r = run_tree_search(&s, *sv.tokenizer, spec, hooks);
    EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().message();
    EXPECT_EQ(levels, at_level - 1);
    EXPECT_EQ(live_branches(s, tree->tree_id), std::set<std::string>{tree->root_branch_id});
    const SchedulerStats after = s.stats();
    EXPECT_EQ(after.kv_pages_free + after.kv_pages_evictable,
              before.kv_pages_free + before.kv_pages_evictable);
    EXPECT_EQ(after.running_requests, 0);
  }
  // The tree is still usable: a fresh search completes.
  auto again = run_tree_search(&s, *sv.tokenizer, sampled_spec(tree->tree_id, 2, 1, 2, 3), {});
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_EQ(again->leaves.size(), 1u);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerTreeSearch, PoolExhaustionEndsTheSearchCleanly) {
  Served sv = serve(8);  // 128 tokens
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(40, 5));
  ASSERT_TRUE(tree.ok());
  auto r = run_tree_search(&s, *sv.tokenizer, sampled_spec(tree->tree_id, 4, 2, 3, 60), {});
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().message();
  EXPECT_EQ(live_branches(s, tree->tree_id), std::set<std::string>{tree->root_branch_id});
  auto ok = run_tree_search(&s, *sv.tokenizer, sampled_spec(tree->tree_id, 2, 1, 2, 4), {});
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// The search holds its tree: a client that takes longer to score than the tree's lease does
// not lose the tree mid-search; once the search ends, the lease runs again.
TEST(SchedulerTreeSearch, TheSearchHoldsItsTreeAgainstTheLease) {
  SchedulerOptions options;
  options.tree_lease_default_ms = 150;
  Served sv = serve(256, options);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 8));
  ASSERT_TRUE(tree.ok());
  TreeSearchSpec spec = sampled_spec(tree->tree_id, 2, 1, 2, 3);
  spec.score_mode = SearchScoreMode::kClient;
  TreeSearchHooks hooks;
  hooks.on_level = [](const SearchLevel& l, SearchScores* sc) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    for (const SearchCandidate& c : l.candidates) (*sc)[c.branch_id] = 0;
    return Status::Ok();
  };
  auto r = run_tree_search(&s, *sv.tokenizer, spec, hooks);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(s.stats().live_trees, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(s.stats().live_trees, 0) << "the lease runs again after the search";
  expect_idle(s);
}

TEST(SchedulerTreeSearch, SameSeedSameSearch) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  std::vector<std::vector<std::string>> texts;
  for (int run = 0; run < 2; ++run) {
    auto tree = s.create_tree(prompt(24, 6));
    ASSERT_TRUE(tree.ok());
    auto r = run_tree_search(&s, *sv.tokenizer, sampled_spec(tree->tree_id, 3, 2, 2, 6), {});
    ASSERT_TRUE(r.ok()) << r.status().message();
    std::vector<std::string> t;
    for (const SearchLeaf& leaf : r->leaves) {
      t.push_back(std::to_string(leaf.tokens) + ":" + std::to_string(leaf.score) + ":" + leaf.text);
    }
    texts.push_back(t);
    ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  }
  EXPECT_EQ(texts[0], texts[1]);
  expect_idle(s);
}

}  // namespace
}  // namespace treeserve
