// What a shared server promises about trees, driven on the scheduler directly (CPU backend,
// tiny model; also in the sanitizer build): cancellation keeps work (Generate, beam search),
// callers that give up leave nothing behind (CreateTree, Branch), a failed prefill leaves no
// tree, ids are random, ended branches leave the tree's tables (GetTree stays small and
// paged), and idle trees expire after their lease unless a call holds or renews them.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <thread>

#include "common/metrics.h"
#include "common/route_key.h"
#include "engine/backend.h"
#include "scheduler/scheduler.h"
#include "scheduler/tree_search.h"
#include "tests/scheduler/scheduler_test_util.h"

namespace treeserve {
namespace {

using testing::beam_spec;
using testing::drain;
using testing::Drained;
using testing::expect_idle;
using testing::prompt;
using testing::serve;
using testing::Served;

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

GenerateSpec greedy_on(const std::string& tree, std::vector<std::string> ids, int max_tokens) {
  GenerateSpec g;
  g.tree_id = tree;
  g.branch_ids = std::move(ids);
  g.sampling.temperature = 0;
  g.max_tokens = max_tokens;
  return g;
}

// The CPU backend, with a forward that fails or sleeps on demand.
class WrappedBackend final : public Backend {
 public:
  explicit WrappedBackend(Backend* inner) : inner_(inner) {}
  std::string_view name() const override { return "wrapped"; }
  const ModelConfig& model_config() const override { return inner_->model_config(); }
  const KvLayout& kv_layout() const override { return inner_->kv_layout(); }
  Status forward(const StepBatch& batch, Logits* out) override {
    if (fail.load()) return Internal("injected failure");
    if (int ms = delay_ms.load(); ms > 0) std::this_thread::sleep_for(milliseconds(ms));
    return inner_->forward(batch, out);
  }
  std::atomic<bool> fail{false};
  std::atomic<int> delay_ms{0};

 private:
  Backend* inner_;
};

// A scheduler over a WrappedBackend (the Served one stays idle).
struct Wrapped {
  Served base;
  std::unique_ptr<WrappedBackend> backend;
  std::unique_ptr<Scheduler> scheduler;
};

Wrapped serve_wrapped(int64_t pages, SchedulerOptions o = {}, ServerMetrics* metrics = nullptr) {
  Wrapped w;
  w.base = serve(pages);
  w.backend = std::make_unique<WrappedBackend>(w.base.backend.get());
  o.max_sequence_tokens = w.base.scheduler->options().max_sequence_tokens;
  w.scheduler =
      std::move(Scheduler::create(w.backend.get(), w.base.tokenizer.get(), o, metrics).value());
  return w;
}

std::map<std::string, BranchSummary> listed(Scheduler& s, const std::string& tree) {
  std::map<std::string, BranchSummary> out;
  auto info = s.get_tree(tree);
  EXPECT_TRUE(info.ok()) << info.status().message();
  if (!info.ok()) return out;
  for (const BranchSummary& b : info->branches) out[b.branch_id] = b;
  return out;
}

// A cancelled Generate keeps every branch and every token: the branches stay live, their
// lengths count the tokens streamed, and greedy decoding resumes exactly where it stopped.
TEST(SchedulerLifecycle, CancelledGenerateKeepsItsBranchesAndTokens) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(30, 1));
  ASSERT_TRUE(tree.ok());
  auto kids = s.branch(tree->tree_id, tree->root_branch_id, 3, 0);
  ASSERT_TRUE(kids.ok());
  const std::string ref = (*kids)[2];
  const std::vector<std::string> cut = {(*kids)[0], (*kids)[1]};
  Drained d = drain(**s.generate(greedy_on(tree->tree_id, cut, 1500)), 6);
  EXPECT_TRUE(d.status.ok()) << d.status.message();
  auto info = listed(s, tree->tree_id);
  ASSERT_EQ(info.size(), 4u);
  for (const std::string& id : cut) {
    EXPECT_EQ(d.finish[id], FinishReason::kCancelled) << id;
    ASSERT_LT(d.tokens[id].size(), 1500u);
    ASSERT_GE(d.tokens[id].size(), 1u);
    EXPECT_TRUE(info.at(id).live);
    EXPECT_EQ(info.at(id).length, 30 + int32_t(d.tokens[id].size())) << id;
  }
  // The tree is usable: the cancelled branches decode on; greedy, what they produce after the
  // cut continues the uncut sequence exactly.
  Drained more = drain(**s.generate(greedy_on(tree->tree_id, cut, 5)));
  ASSERT_TRUE(more.status.ok()) << more.status.message();
  const size_t longest = std::max(d.tokens[cut[0]].size(), d.tokens[cut[1]].size());
  Drained whole = drain(**s.generate(greedy_on(tree->tree_id, {ref}, int(longest) + 5)));
  ASSERT_TRUE(whole.status.ok());
  for (const std::string& id : cut) {
    std::vector<int32_t> joined = d.tokens[id];
    joined.insert(joined.end(), more.tokens[id].begin(), more.tokens[id].end());
    EXPECT_EQ(joined, std::vector<int32_t>(whole.tokens[ref].begin(),
                                           whole.tokens[ref].begin() + joined.size()))
        << id;
  }
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// A cancelled beam search keeps its beams (those with tokens) as live children of the
// searched branch; their last events say FINISH_CANCELLED (or why they ended before).
TEST(SchedulerLifecycle, CancelledBeamSearchKeepsItsBeams) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(20, 2));
  ASSERT_TRUE(tree.ok());
  auto stream = s.generate(beam_spec(tree->tree_id, tree->root_branch_id, 3, 1500));
  ASSERT_TRUE(stream.ok());
  std::this_thread::sleep_for(milliseconds(60));
  (*stream)->cancel();
  Drained d = drain(**stream);
  EXPECT_EQ(d.status.code(), StatusCode::kCancelled) << d.status.message();
  ASSERT_GE(d.tokens.size(), 1u);
  auto info = listed(s, tree->tree_id);
  EXPECT_EQ(info.size(), 1 + d.tokens.size());
  for (const auto& [id, tokens] : d.tokens) {
    ASSERT_TRUE(info.count(id)) << id;
    EXPECT_EQ(info.at(id).length, 20 + int32_t(tokens.size())) << id;
    EXPECT_TRUE(d.finish[id] == FinishReason::kCancelled || d.finish[id] == FinishReason::kEos)
        << id;
    // Parents are live: the root, or another kept beam.
    EXPECT_TRUE(info.count(info.at(id).parent_branch_id)) << info.at(id).parent_branch_id;
  }
  Drained more = drain(**s.generate(greedy_on(tree->tree_id, {d.tokens.begin()->first}, 2)));
  EXPECT_TRUE(more.status.ok()) << more.status.message();
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// A CreateTree whose caller gives up mid-prefill stops the prefill and leaves no tree and no
// pages; one whose result was ready first is removed too.
TEST(SchedulerLifecycle, AbandonedCreateTreeLeavesNothing) {
  SchedulerOptions o;
  o.max_step_tokens = 4;  // a 1500-token prompt takes ~375 steps
  Served sv = serve(256, o);
  Scheduler& s = *sv.scheduler;
  const int64_t free_before = s.stats().kv_pages_free;
  ASSERT_EQ(free_before, s.stats().kv_pages_total);
  const auto start = Clock::now();
  std::atomic<int> asked{0};
  CreateTreeOptions give_up;
  give_up.cancelled = [&] {
    ++asked;
    return Clock::now() - start > milliseconds(50);
  };
  auto r = s.create_tree(prompt(1500, 3), give_up);
  EXPECT_EQ(r.status().code(), StatusCode::kCancelled) << r.status().message();
  EXPECT_GT(asked.load(), 1) << "the caller was asked while it waited";
  EXPECT_LT(Clock::now() - start, milliseconds(2000)) << "the prefill was not stopped";
  SchedulerStats st = s.stats();
  EXPECT_EQ(st.live_trees, 0);
  EXPECT_EQ(st.waiting_requests, 0);
  EXPECT_EQ(st.kv_pages_free, free_before) << "pages the prefill computed are freed";

  // Gone before the (short) prefill finished its first wait: the ready tree is removed.
  CreateTreeOptions gone;
  gone.cancelled = [] { return true; };
  EXPECT_EQ(s.create_tree(prompt(3, 4), gone).status().code(), StatusCode::kCancelled);
  EXPECT_EQ(s.create_tree({7}, gone).status().code(), StatusCode::kCancelled);
  // (A prompt prefilled to the end is in the radix cache: its pages are evictable, not free.)
  expect_idle(s);
  EXPECT_EQ(s.create_tree(prompt(5), CreateTreeOptions{-1, nullptr}).status().code(),
            StatusCode::kInvalidArgument);
  expect_idle(s);
}

// A Branch whose caller is gone gets CANCELLED and leaves no new branch.
TEST(SchedulerLifecycle, AbandonedBranchLeavesNoBranches) {
  Served sv = serve(64);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(21, 5));  // mid-page: each child gets a page copy
  ASSERT_TRUE(tree.ok());
  const int64_t free_before = s.stats().kv_pages_free;
  EXPECT_EQ(
      s.branch(tree->tree_id, tree->root_branch_id, 4, 0, [] { return true; }).status().code(),
      StatusCode::kCancelled);
  // Gone while the fork ran: the checker says no before the call and yes after it.
  int calls = 0;
  EXPECT_EQ(s.branch(tree->tree_id, tree->root_branch_id, 4, 0, [&] { return ++calls > 1; })
                .status()
                .code(),
            StatusCode::kCancelled);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(listed(s, tree->tree_id).size(), 1u);
  EXPECT_EQ(s.stats().kv_pages_free, free_before);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerLifecycle, FailedPrefillLeavesNoTree) {
  Wrapped w = serve_wrapped(64);
  Scheduler& s = *w.scheduler;
  w.backend->fail = true;
  EXPECT_EQ(s.create_tree(prompt(40, 6)).status().code(), StatusCode::kInternal);
  expect_idle(s);
  EXPECT_EQ(s.stats().kv_pages_free, s.stats().kv_pages_total);
  w.backend->fail = false;
  auto ok = s.create_tree(prompt(40, 6));
  ASSERT_TRUE(ok.ok()) << ok.status().message();
  ASSERT_TRUE(s.delete_tree(ok->tree_id).ok());
  expect_idle(s);
}

// Branch ids are "b_" plus 22 URL-safe base64 characters (128 random bits), tree ids
// "t_<route>.local.<incarnation>.<32 hex digits>"; both differ on every run, and the sampling
// stream key is still the branch's index, so seeded sampling repeats.
TEST(SchedulerLifecycle, IdsAreRandomAndSeededSamplingRepeats) {
  auto run = [](std::string* tree_id, std::vector<std::string>* ids) {
    Served sv = serve(64);
    Scheduler& s = *sv.scheduler;
    auto tree = s.create_tree(prompt(12, 7));
    EXPECT_TRUE(tree.ok());
    *tree_id = tree->tree_id;
    auto kids = s.branch(tree->tree_id, tree->root_branch_id, 3, 0);
    EXPECT_TRUE(kids.ok());
    *ids = *kids;
    ids->insert(ids->begin(), tree->root_branch_id);
    GenerateSpec g = greedy_on(tree->tree_id, *kids, 6);
    g.sampling.temperature = 1.0f;
    g.sampling.seed = 42;
    Drained d = drain(**s.generate(g));
    std::vector<std::vector<int32_t>> out;
    for (const std::string& id : *kids) out.push_back(d.tokens[id]);
    EXPECT_TRUE(s.delete_tree(tree->tree_id).ok());
    return out;
  };
  std::string t1, t2;
  std::vector<std::string> b1, b2;
  auto first = run(&t1, &b1);
  auto second = run(&t2, &b2);  // a "restart": a new scheduler
  EXPECT_EQ(first, second);
  EXPECT_NE(t1, t2);
  auto well_formed = [](const std::string& id, const std::string& prefix) {
    if (id.size() != prefix.size() + 22 || id.compare(0, prefix.size(), prefix) != 0) return false;
    for (char c : id.substr(prefix.size())) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    }
    return true;
  };
  for (const std::string& t : {t1, t2}) {
    auto parts = parse_tree_id(t);
    ASSERT_TRUE(parts) << t;
    EXPECT_EQ(parts->replica, "local");
    EXPECT_EQ(parts->route, route_key_ids(prompt(12, 7)));
  }
  EXPECT_NE(parse_tree_id(t1)->incarnation, parse_tree_id(t2)->incarnation);  // 2^-32 to fail
  std::set<std::string> all(b1.begin(), b1.end());
  all.insert(b2.begin(), b2.end());
  EXPECT_EQ(all.size(), 8u);
  for (const std::string& id : all) EXPECT_TRUE(well_formed(id, "b_")) << id;
}

// A tree id carries the caller's route (else its prompt's key), the replica and the run the
// options name; a route that is not a routing key, or a replica id that is not one, is refused.
TEST(SchedulerLifecycle, TreeIdsCarryRouteReplicaAndIncarnation) {
  SchedulerOptions o;
  o.replica_id = "r-7";
  o.incarnation = "0123abcd";
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  CreateTreeOptions with_route;
  with_route.route = "user.42";
  auto routed = s.create_tree(prompt(12, 3), with_route);
  ASSERT_TRUE(routed.ok()) << routed.status().message();
  EXPECT_EQ(routed->tree_id.rfind("t_user.42.r-7.0123abcd.", 0), 0u) << routed->tree_id;
  auto keyed = s.create_tree(prompt(12, 3));
  ASSERT_TRUE(keyed.ok());
  auto parts = parse_tree_id(keyed->tree_id);
  ASSERT_TRUE(parts) << keyed->tree_id;
  EXPECT_EQ(parts->route, route_key_ids(prompt(12, 3)));
  EXPECT_EQ(parts->replica, "r-7");
  EXPECT_EQ(parts->incarnation, "0123abcd");
  CreateTreeOptions bad;
  bad.route = "not a key";
  EXPECT_EQ(s.create_tree(prompt(12, 3), bad).status().code(), StatusCode::kInvalidArgument);
  for (const std::string& id : {routed->tree_id, keyed->tree_id}) {
    EXPECT_TRUE(s.delete_tree(id).ok());
  }
  expect_idle(s);

  SchedulerOptions wrong;
  wrong.replica_id = "Replica_1";
  auto created = Scheduler::create(sv.backend.get(), sv.tokenizer.get(), wrong, nullptr);
  EXPECT_EQ(created.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(created.status().message().rfind("replica_id: must be 1 to 32", 0), 0u)
      << created.status().message();
}

// Forks and prunes do not grow a tree: after many rounds GetTree lists only the live branches
// and stays fast, and the KV pool is as before.
TEST(SchedulerLifecycle, PrunedBranchesLeaveTheTables) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(37, 8));
  ASSERT_TRUE(tree.ok());
  const int64_t free_before = s.stats().kv_pages_free;
  for (int round = 0; round < 300; ++round) {
    auto kids = s.branch(tree->tree_id, tree->root_branch_id, 64, 0);
    ASSERT_TRUE(kids.ok()) << kids.status().message();
    auto p = s.prune(tree->tree_id, *kids, false);
    ASSERT_TRUE(p.ok());
    ASSERT_EQ(p->pruned_branches, 64);
  }
  const auto t0 = Clock::now();
  auto info = s.get_tree(tree->tree_id);
  const auto took = Clock::now() - t0;
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->branches.size(), 1u);
  EXPECT_EQ(info->live_branches, 1);
  EXPECT_EQ(info->total_tokens, 37);
  EXPECT_LT(took, milliseconds(5));
  EXPECT_EQ(s.stats().kv_pages_free, free_before);
  // Prune takes descendants; a pruned id is unknown afterwards.
  auto a = s.branch(tree->tree_id, tree->root_branch_id, 1, 0);
  ASSERT_TRUE(a.ok());
  auto aa = s.branch(tree->tree_id, a->front(), 2, 0);
  ASSERT_TRUE(aa.ok());
  auto p = s.prune(tree->tree_id, *a, false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->pruned_branches, 3);
  EXPECT_EQ(s.prune(tree->tree_id, {aa->front()}, false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(listed(s, tree->tree_id).size(), 1u);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// A beam search drops beams whose continuations it forked earlier: the survivors hang off the
// nearest live ancestor, and the token count stays right.
TEST(SchedulerLifecycle, DroppedBeamsHandTheirChildrenUp) {
  Served sv = serve(256);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(25, 9));
  ASSERT_TRUE(tree.ok());
  Drained d = drain(**s.generate(beam_spec(tree->tree_id, tree->root_branch_id, 4, 12)));
  ASSERT_TRUE(d.status.ok()) << d.status.message();
  auto info = s.get_tree(tree->tree_id);
  ASSERT_TRUE(info.ok());
  std::map<std::string, const BranchSummary*> by_id;
  for (const BranchSummary& b : info->branches) by_id[b.branch_id] = &b;
  EXPECT_EQ(by_id.size(), 5u);
  for (const BranchSummary& b : info->branches) {
    if (b.branch_id == tree->root_branch_id) continue;
    ASSERT_TRUE(by_id.count(b.parent_branch_id)) << "parent of " << b.branch_id << " not live";
  }
  EXPECT_GE(info->total_tokens, 25 + 12);
  EXPECT_LE(info->total_tokens, 25 + 4 * 12);
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

TEST(SchedulerLifecycle, GetTreePages) {
  Served sv = serve(64);
  Scheduler& s = *sv.scheduler;
  auto tree = s.create_tree(prompt(10, 10));
  ASSERT_TRUE(tree.ok());
  auto kids = s.branch(tree->tree_id, tree->root_branch_id, 9, 0);
  ASSERT_TRUE(kids.ok());
  ASSERT_TRUE(s.prune(tree->tree_id, {(*kids)[4]}, false).ok());
  std::vector<std::string> all = {tree->root_branch_id};
  for (size_t i = 0; i < kids->size(); ++i) {
    if (i != 4) all.push_back((*kids)[i]);
  }
  std::vector<std::string> paged;
  TreePage page{3, ""};
  int pages = 0;
  do {
    auto r = s.get_tree(tree->tree_id, page);
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_LE(r->branches.size(), 3u);
    EXPECT_EQ(r->live_branches, 9);
    EXPECT_EQ(r->total_tokens, 10);
    for (const BranchSummary& b : r->branches) paged.push_back(b.branch_id);
    page.page_token = r->next_page_token;
    ++pages;
  } while (!page.page_token.empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(paged, all) << "creation order, each live branch once";
  auto whole = s.get_tree(tree->tree_id);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->branches.size(), 9u);
  EXPECT_TRUE(whole->next_page_token.empty());
  EXPECT_EQ(s.get_tree(tree->tree_id, {-1, ""}).status().code(), StatusCode::kInvalidArgument);
  for (const char* bad : {"x", "-1", "999999", "3z"}) {
    auto r = s.get_tree(tree->tree_id, {2, bad});
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("page_token"), std::string::npos);
  }
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// An idle tree is deleted once its lease runs out (its KV kept as cache; the metric counts
// it); calls renew the lease; a held tree or one with a running call does not expire.
TEST(SchedulerLifecycle, IdleTreesExpireAfterTheirLease) {
  MetricsRegistry registry;
  ServerMetrics metrics(&registry);
  SchedulerOptions o;
  o.tree_lease_default_ms = 300;
  Wrapped w = serve_wrapped(128, o, &metrics);
  Scheduler& s = *w.scheduler;
  auto idle = s.create_tree(prompt(40, 11));
  ASSERT_TRUE(idle.ok());
  EXPECT_EQ(idle->lease_ms, 300);
  auto info = s.get_tree(idle->tree_id);
  ASSERT_TRUE(info.ok());
  const int64_t now_ms =
      std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  EXPECT_EQ(info->lease_ms, 300);
  EXPECT_GT(info->expires_at_unix_ms, now_ms + 200);
  EXPECT_LE(info->expires_at_unix_ms, now_ms + 310);

  CreateTreeOptions long_lease;
  long_lease.lease_ms = 60000;
  auto kept = s.create_tree(prompt(8, 12), long_lease);
  ASSERT_TRUE(kept.ok());
  // Renewed by calls every 100 ms, a tree outlives its lease.
  auto renewed = s.create_tree(prompt(9, 13));
  ASSERT_TRUE(renewed.ok());
  for (int i = 0; i < 6; ++i) {
    std::this_thread::sleep_for(milliseconds(100));
    ASSERT_TRUE(s.get_tree(renewed->tree_id).ok()) << "renewed tree expired at " << i;
  }
  EXPECT_EQ(s.get_tree(idle->tree_id).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(metrics.tree_leases_expired_total->value(), 1);
  EXPECT_TRUE(s.get_tree(kept->tree_id).ok());

  // A held tree does not expire; let go, it does after a lease.
  ASSERT_TRUE(s.hold_tree(renewed->tree_id).ok());
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_EQ(s.stats().live_trees, 2);
  s.release_tree(renewed->tree_id);
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_EQ(s.stats().live_trees, 1);
  EXPECT_EQ(metrics.tree_leases_expired_total->value(), 2);
  EXPECT_EQ(s.hold_tree(renewed->tree_id).code(), StatusCode::kNotFound);

  // A tree with a Generate running past its lease survives it, and expires a lease later.
  auto busy = s.create_tree(prompt(16, 14));
  ASSERT_TRUE(busy.ok());
  w.backend->delay_ms = 2;  // 2000 tokens take more than 4 s
  GenerateSpec g = greedy_on(busy->tree_id, {busy->root_branch_id}, 2000);
  auto stream = s.generate(g);
  ASSERT_TRUE(stream.ok());
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_EQ(s.stats().live_trees, 2) << "a tree with a running Generate expired";
  (*stream)->cancel();
  Drained d = drain(**stream);
  EXPECT_GT(d.tokens[busy->root_branch_id].size(), 0u);
  EXPECT_EQ(d.finish[busy->root_branch_id], FinishReason::kCancelled);
  std::this_thread::sleep_for(milliseconds(700));
  EXPECT_EQ(s.stats().live_trees, 1);
  EXPECT_EQ(metrics.tree_leases_expired_total->value(), 3);
  ASSERT_TRUE(s.delete_tree(kept->tree_id).ok());
  expect_idle(s);
}

// One-shot trees have no lease: a one-shot call that runs longer than the default lease
// completes.
TEST(SchedulerLifecycle, OneShotTreesHaveNoLease) {
  SchedulerOptions o;
  o.tree_lease_default_ms = 50;
  o.max_step_tokens = 8;
  Wrapped w = serve_wrapped(128, o);
  w.backend->delay_ms = 2;  // ~80 steps: well past the lease
  Scheduler& s = *w.scheduler;
  GenerateSpec g;
  g.prompt = prompt(300, 15);
  g.n = 2;
  g.max_tokens = 40;
  g.sampling.temperature = 0;
  const auto start = Clock::now();
  Drained d = drain(**s.generate(g));
  EXPECT_GT(Clock::now() - start, milliseconds(50));
  ASSERT_TRUE(d.status.ok()) << d.status.message();
  EXPECT_EQ(d.tokens.size(), 2u);
  expect_idle(s);
}

}  // namespace
}  // namespace treeserve
