// The scheduler driven directly (no gRPC): CPU backend, tiny model. These run in the
// sanitizer build too, so every path of the step loop (prefill chunks, forks, decode,
// verify, prune mid-generation, cancellation, exhaustion, shutdown) is checked for leaks and
// undefined behaviour; after each test the pool is idle.
#include "scheduler/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include "engine/backend.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "tests/scheduler/scheduler_test_util.h"

namespace treeserve {
namespace {

using testing::drain;
using testing::Drained;
using testing::expect_idle;
using testing::prompt;
using testing::serve;
using testing::Served;

using std::chrono::milliseconds;

TEST(Scheduler, TreeLifecycle) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(70));
  ASSERT_TRUE(tree.ok()) << tree.status().message();
  EXPECT_EQ(tree->prompt_tokens, 70);
  auto kids = s.branch(tree->tree_id, tree->root_branch_id, 3, 0);
  ASSERT_TRUE(kids.ok());
  GenerateSpec spec;
  spec.tree_id = tree->tree_id;
  spec.branch_ids = *kids;
  spec.sampling.temperature = 0;
  spec.max_tokens = 6;
  spec.append = {5, 6};
  auto stream = s.generate(spec);
  ASSERT_TRUE(stream.ok());
  Drained d = drain(**stream);
  EXPECT_TRUE(d.status.ok());
  for (const std::string& id : *kids) {
    EXPECT_EQ(d.tokens[id].size(), 6u);
    EXPECT_EQ(d.finish[id], FinishReason::kLength);
  }
  // Identical context, greedy: identical tokens.
  EXPECT_EQ(d.tokens[(*kids)[0]], d.tokens[(*kids)[1]]);
  auto info = s.get_tree(tree->tree_id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->branches.size(), 4u);
  EXPECT_EQ(info->total_tokens, 70 + 3 * 8);
  SamplingParams greedy;
  greedy.temperature = 0;
  auto v = s.verify(tree->tree_id, (*kids)[0], {d.tokens[(*kids)[0]][0], 7}, {-1, 0}, greedy);
  ASSERT_TRUE(v.ok()) << v.status().message();
  auto pruned = s.prune(tree->tree_id, {(*kids)[1]}, false);
  ASSERT_TRUE(pruned.ok());
  EXPECT_EQ(pruned->pruned_branches, 1);
  // A pruned branch has left the tree: its id is unknown.
  EXPECT_EQ(s.branch(tree->tree_id, (*kids)[1], 1, 0).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s.branch("nope", tree->root_branch_id, 1, 0).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(Scheduler, ChunkedPrefillOneShotAndCancel) {
  SchedulerOptions o;
  o.max_step_tokens = 32;  // several prefill chunks
  Served sv = serve(256, o);
  Scheduler& s = *sv.scheduler;
  GenerateSpec spec;
  spec.prompt = prompt(150, 1);
  spec.n = 4;
  spec.sampling.temperature = 0.9f;
  spec.sampling.seed = 3;
  spec.max_tokens = 5;
  auto stream = s.generate(spec);
  ASSERT_TRUE(stream.ok());
  Drained d = drain(**stream);
  EXPECT_TRUE(d.status.ok());
  EXPECT_EQ(d.tokens.size(), 4u);
  expect_idle(s);

  // A long generation cancelled after a few events: its branch stops CANCELLED (and stays
  // live with its tokens: scheduler_lifecycle_test.cpp).
  auto tree = s.create_tree(prompt(40, 2));
  ASSERT_TRUE(tree.ok());
  GenerateSpec g;
  g.tree_id = tree->tree_id;
  g.branch_ids = {tree->root_branch_id};
  g.max_tokens = 1000;
  auto long_stream = s.generate(g);
  ASSERT_TRUE(long_stream.ok());
  Drained c = drain(**long_stream, 3);
  EXPECT_EQ(c.finish[tree->root_branch_id], FinishReason::kCancelled);
  EXPECT_LT(c.tokens[tree->root_branch_id].size(), 1000u);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// max_step_rows: a step takes at most that many rows; the rest waits (jobs take turns going
// first, a beam search's beams run together). Greedy tokens are the same as without the cap,
// only spread over more steps.
TEST(Scheduler, StepRowCapQueuesWorkWithoutChangingIt) {
  auto run = [](int32_t max_rows, int64_t* steps) {
    SchedulerOptions o;
    o.max_step_rows = max_rows;
    Served sv = serve(256, o);
    Scheduler& s = *sv.scheduler;
    std::vector<std::shared_ptr<GenerateStream>> streams;
    for (int j = 0; j < 2; ++j) {
      GenerateSpec spec;
      spec.prompt = prompt(20 + j, 4 + j);
      spec.n = 5;
      spec.sampling.temperature = 0.0f;
      spec.max_tokens = 6;
      auto st = s.generate(spec);
      EXPECT_TRUE(st.ok());
      streams.push_back(std::move(*st));
    }
    GenerateSpec beam;
    beam.prompt = prompt(18, 9);
    beam.beam_width = 4;
    beam.max_tokens = 5;
    auto bs = s.generate(beam);
    EXPECT_TRUE(bs.ok());
    streams.push_back(std::move(*bs));
    // Per stream, its branches' tokens (sorted: branch ids are random).
    std::vector<std::vector<std::vector<int32_t>>> out;
    for (auto& st : streams) {
      Drained d = drain(*st);
      EXPECT_TRUE(d.status.ok()) << d.status.ToString();
      std::vector<std::vector<int32_t>> tokens;
      for (auto& [id, t] : d.tokens) tokens.push_back(t);
      std::sort(tokens.begin(), tokens.end());
      out.push_back(tokens);
    }
    *steps = s.stats().steps;
    expect_idle(s);
    return out;
  };
  int64_t free_steps = 0, capped_steps = 0;
  const auto free = run(4096, &free_steps);
  const auto capped = run(3, &capped_steps);
  EXPECT_EQ(capped, free);
  EXPECT_EQ(capped[0].size(), 5u);
  EXPECT_EQ(capped[1].size(), 5u);
  EXPECT_GT(capped_steps, free_steps + 10) << "the cap did not split the steps";
  SchedulerOptions bad;
  bad.max_step_rows = 0;
  Served sv = serve(16);
  EXPECT_EQ(Scheduler::create(sv.backend.get(), sv.tokenizer.get(), bad, nullptr).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Scheduler, ExhaustionAndShutdownLeaveNothingBehind) {
  Served sv = serve(6);  // 96 tokens
  Scheduler& s = *sv.scheduler;
  EXPECT_EQ(s.create_tree(prompt(200)).status().code(), StatusCode::kResourceExhausted);
  auto a = s.create_tree(prompt(60, 3));
  ASSERT_TRUE(a.ok());
  // 60 more tokens cannot fit beside the first tree, and nothing running will free pages.
  EXPECT_EQ(s.create_tree(prompt(60, 4)).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.stats().live_trees, 1);
  // A generation that outgrows the pool ends with RESOURCE_EXHAUSTED; the tree survives.
  GenerateSpec g;
  g.tree_id = a->tree_id;
  g.branch_ids = {a->root_branch_id};
  g.max_tokens = 200;
  auto stream = s.generate(g);
  ASSERT_TRUE(stream.ok());
  Drained d = drain(**stream);
  EXPECT_EQ(d.status.code(), StatusCode::kResourceExhausted) << d.status.message();
  EXPECT_TRUE(s.get_tree(a->tree_id).ok());
  // Shutdown with a generation in flight ends it; later calls are UNAVAILABLE.
  ASSERT_TRUE(s.delete_tree(a->tree_id).ok());
  auto b = s.create_tree(prompt(20, 5));
  ASSERT_TRUE(b.ok());
  g.tree_id = b->tree_id;
  g.branch_ids = {b->root_branch_id};
  g.max_tokens = 50;
  auto late = s.generate(g);
  ASSERT_TRUE(late.ok());
  s.shutdown();
  Drained e = drain(**late);
  EXPECT_TRUE(e.status.code() == StatusCode::kUnavailable || e.status.ok());
  EXPECT_EQ(s.create_tree(prompt(5)).status().code(), StatusCode::kUnavailable);
}

}  // namespace
}  // namespace treeserve

namespace treeserve {
namespace {

using testing::beam_spec;

struct BeamResult {
  std::vector<std::string> order;  // beams as streamed, best first
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, float> logprob_sum;
  std::map<std::string, float> score;
  std::map<std::string, FinishReason> finish;
  Status status;
};

BeamResult drain_beams(GenerateStream& stream, int cancel_after_ms = -1) {
  BeamResult r;
  TokenEvent ev;
  if (cancel_after_ms >= 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(cancel_after_ms));
    stream.cancel();
  }
  for (;;) {
    GenerateStream::Wait w = stream.next(&ev, &r.status, std::chrono::milliseconds(20000));
    if (w != GenerateStream::Wait::kEvent) break;
    if (r.tokens.find(ev.branch_id) == r.tokens.end()) r.order.push_back(ev.branch_id);
    r.tokens[ev.branch_id].push_back(ev.token_id);
    r.logprob_sum[ev.branch_id] += ev.logprob;
    if (ev.finish != FinishReason::kNone) {
      r.finish[ev.branch_id] = ev.finish;
      r.score[ev.branch_id] = ev.score;
    }
  }
  return r;
}

TEST(SchedulerBeamSearch, WidthOneIsGreedy) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(30, 6));
  ASSERT_TRUE(tree.ok());
  auto copy = s.branch(tree->tree_id, tree->root_branch_id, 1, 0);
  ASSERT_TRUE(copy.ok());
  GenerateSpec greedy;
  greedy.tree_id = tree->tree_id;
  greedy.branch_ids = *copy;
  greedy.sampling.temperature = 0;
  greedy.max_tokens = 8;
  Drained g = drain(**s.generate(greedy));
  BeamResult b = drain_beams(**s.generate(beam_spec(tree->tree_id, tree->root_branch_id, 1, 8)));
  ASSERT_TRUE(b.status.ok()) << b.status.message();
  ASSERT_EQ(b.order.size(), 1u);
  EXPECT_EQ(b.tokens[b.order[0]], g.tokens[(*copy)[0]]);
  EXPECT_EQ(b.finish[b.order[0]], FinishReason::kLength);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerBeamSearch, KeepsTheBestBeamsAsBranches) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(25, 7));
  ASSERT_TRUE(tree.ok());
  BeamResult b = drain_beams(**s.generate(beam_spec(tree->tree_id, tree->root_branch_id, 4, 6)));
  ASSERT_TRUE(b.status.ok()) << b.status.message();
  ASSERT_EQ(b.order.size(), 4u);
  std::set<std::vector<int32_t>> distinct;
  float previous = 1e30f;
  for (const std::string& id : b.order) {
    distinct.insert(b.tokens[id]);
    EXPECT_LE(b.score[id], previous) << "beams are streamed best first";
    previous = b.score[id];
    EXPECT_NEAR(b.score[id], b.logprob_sum[id], 1e-3) << "score = total logprob";
    if (b.finish[id] == FinishReason::kLength) {
      EXPECT_EQ(b.tokens[id].size(), 6u);
    }
  }
  EXPECT_EQ(distinct.size(), 4u);
  // The beams stay as live children of the searched branch; everything else was pruned.
  auto info = s.get_tree(tree->tree_id);
  ASSERT_TRUE(info.ok());
  int live = 0;
  for (const BranchSummary& br : info->branches) live += br.live;
  EXPECT_EQ(live, 5);  // the root + 4 beams
  // A beam can be generated from like any branch.
  GenerateSpec more;
  more.tree_id = tree->tree_id;
  more.branch_ids = {b.order[0]};
  more.sampling.temperature = 0;
  more.max_tokens = 2;
  EXPECT_TRUE(drain(**s.generate(more)).status.ok());
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerBeamSearch, CancelPruneAndBadArguments) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 8));
  ASSERT_TRUE(tree.ok());
  const std::string root = tree->root_branch_id;
  BeamResult c = drain_beams(**s.generate(beam_spec(tree->tree_id, root, 3, 1500)), 30);
  EXPECT_EQ(c.status.code(), StatusCode::kCancelled) << c.status.message();
  // Pruning the searched branch takes its beams (the cancelled search's too): the search ends.
  auto stream = s.generate(beam_spec(tree->tree_id, root, 2, 1500));
  ASSERT_TRUE(stream.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  ASSERT_TRUE(s.prune(tree->tree_id, {root}, false).ok());
  BeamResult p = drain_beams(**stream);
  EXPECT_EQ(p.status.code(), StatusCode::kFailedPrecondition) << p.status.message();
  GenerateSpec bad = beam_spec(tree->tree_id, root, 2, 4);
  bad.branch_ids = {root, "b_other"};
  EXPECT_EQ(s.generate(bad).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  // One-shot beam search: the tree goes with the call.
  GenerateSpec one;
  one.prompt = prompt(15, 9);
  one.beam_width = 2;
  one.max_tokens = 4;
  BeamResult o = drain_beams(**s.generate(one));
  ASSERT_TRUE(o.status.ok()) << o.status.message();
  EXPECT_EQ(o.order.size(), 2u);
  expect_idle(s);
}

// Regression: a beam search that runs out of KV pages ends cleanly, its beams no longer
// pointing at the closed job (which would be a use-after-free under the soak test).
TEST(SchedulerBeamSearch, PoolExhaustionEndsTheSearchCleanly) {
  Served sv = serve(8);  // 128 tokens
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(40, 10));
  ASSERT_TRUE(tree.ok());
  BeamResult b = drain_beams(**s.generate(beam_spec(tree->tree_id, tree->root_branch_id, 4, 200)));
  EXPECT_EQ(b.status.code(), StatusCode::kResourceExhausted) << b.status.message();
  auto info = s.get_tree(tree->tree_id);
  ASSERT_TRUE(info.ok());
  int live = 0;
  for (const BranchSummary& br : info->branches) live += br.live;
  EXPECT_EQ(live, 1);  // the searched branch survives; the beams are gone
  GenerateSpec more;
  more.tree_id = tree->tree_id;
  more.branch_ids = {tree->root_branch_id};
  more.sampling.temperature = 0;
  more.max_tokens = 2;
  EXPECT_TRUE(drain(**s.generate(more)).status.ok());
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

}  // namespace
}  // namespace treeserve
