// Tenants on the scheduler directly (CPU backend, tiny model; also in the sanitizer build):
// cache salts interned to namespaces, trees of another tenant NOT_FOUND for every call,
// cached_tokens partitioned by salt, and the quotas on live trees, live branches and KV pages,
// each refusal naming the tenant, its usage and the quota; ListTrees lists one tenant's trees.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "scheduler/detail/scheduler_impl.h"
#include "scheduler/scheduler.h"
#include "scheduler/tree_search.h"
#include "tests/scheduler/scheduler_test_util.h"

namespace treeserve {
namespace {

using testing::drain;
using testing::Drained;
using testing::expect_idle;
using testing::prompt;
using testing::serve;
using testing::Served;

TenantLimits tenant(const std::string& name) {
  TenantLimits t;
  t.tenant = name;
  return t;
}

GenerateSpec greedy(const std::string& who, const std::string& tree,
                    std::vector<std::string> branches, int max_tokens) {
  GenerateSpec g;
  g.tenant = who;
  g.tree_id = tree;
  g.branch_ids = std::move(branches);
  g.max_tokens = max_tokens;
  return g;
}

StatusOr<CreateTreeResult> create(Scheduler& s, const std::string& who,
                                  std::vector<int32_t> tokens) {
  CreateTreeOptions o;
  o.tenant = who;
  return s.create_tree(std::move(tokens), o);
}

void delete_all(Scheduler& s, const std::string& who) {
  auto list = s.list_trees(who);
  ASSERT_TRUE(list.ok());
  for (const TreeListing& t : list->trees) ASSERT_TRUE(s.delete_tree(t.tree_id, who).ok());
}

TEST(CacheSaltTable, InternsEachSaltOnceAndKeepsTenantsApart) {
  CacheSaltTable table;
  const CacheNamespace a = table.salt("team");
  EXPECT_NE(a, kDefaultCacheNamespace);
  EXPECT_EQ(table.salt("team"), a);  // the same salt, the same namespace
  const CacheNamespace b = table.salt("other");
  EXPECT_NE(b, a);
  // A tenant's own namespace is never a salt's, even when the salt is the tenant's name.
  const CacheNamespace own = table.private_to("team");
  EXPECT_NE(own, a);
  EXPECT_NE(own, b);
  EXPECT_EQ(table.private_to("team"), own);
  // Many salts, no collisions (ids are handed out, not hashed).
  std::set<CacheNamespace> ids = {a, b, own};
  for (int i = 0; i < 10000; ++i) ids.insert(table.salt("s" + std::to_string(i)));
  EXPECT_EQ(ids.size(), 10003u);
  EXPECT_EQ(table.size(), 10003u);
}

TEST(SchedulerTenants, ConfigurationIsChecked) {
  Served sv = serve(16);
  auto make = [&](std::vector<TenantLimits> tenants) {
    SchedulerOptions o;
    o.tenants = std::move(tenants);
    return Scheduler::create(sv.backend.get(), sv.tokenizer.get(), o, nullptr);
  };
  EXPECT_TRUE(make({tenant("a"), tenant("b")}).ok());
  auto twice = make({tenant("a"), tenant("a")});
  EXPECT_EQ(twice.status().message(), "tenants[1].tenant: 'a' is listed twice");
  TenantLimits bad = tenant("a");
  bad.kv_share = 1.5;
  EXPECT_EQ(make({bad}).status().message(),
            "tenants[0].kv_share: must be in [0, 1] (0 = no limit)");
  bad = tenant("a");
  bad.max_live_trees = -1;
  EXPECT_EQ(make({bad}).status().message(),
            "tenants[0].max_live_trees: must be >= 0 (0 = no limit)");
  EXPECT_EQ(make({tenant("")}).status().message(), "tenants[0].tenant: must not be empty");
}

// Every call naming another tenant's tree gets NOT_FOUND with the message an unknown id gets;
// the tree is untouched and its owner goes on using it.
TEST(SchedulerTenants, AnotherTenantsTreeIsNotFound) {
  SchedulerOptions o;
  o.tenants = {tenant("a"), tenant("b")};
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  auto tree = create(s, "a", prompt(20, 1));
  ASSERT_TRUE(tree.ok());
  const std::string id = tree->tree_id, root = tree->root_branch_id;
  const std::string unknown = "t_AAAAAAAAAAAAAAAAAAAAAA";
  auto expect_hidden = [&](const Status& foreign, const Status& missing) {
    EXPECT_EQ(foreign.code(), StatusCode::kNotFound) << foreign.message();
    std::string shape = foreign.message();
    shape.replace(shape.find(id), id.size(), unknown);
    EXPECT_EQ(shape, missing.message());
  };
  auto both = [&](auto call) { expect_hidden(call(id), call(unknown)); };
  both([&](const std::string& t) { return s.get_tree(t, {}, "b").status(); });
  both([&](const std::string& t) { return s.branch(t, root, 2, 0, nullptr, "b").status(); });
  both([&](const std::string& t) { return s.generate(greedy("b", t, {root}, 4)).status(); });
  both([&](const std::string& t) { return s.prune(t, {root}, false, "b").status(); });
  both([&](const std::string& t) {
    return s.verify(t, root, {5, 6}, {-1, 0}, SamplingParams{}, "b").status();
  });
  both([&](const std::string& t) { return s.delete_tree(t, "b").status(); });
  both([&](const std::string& t) { return s.hold_tree(t, "b"); });
  both([&](const std::string& t) {
    TreeSearchSpec spec;
    spec.tenant = "b";
    spec.tree_id = t;
    return run_tree_search(&s, *sv.tokenizer, spec, {}).status();
  });
  // The caller without a tenant ("") is a tenant like any other.
  EXPECT_EQ(s.get_tree(id).status().code(), StatusCode::kNotFound);
  // Untouched: the owner sees its one branch and decodes on it.
  auto info = s.get_tree(id, {}, "a");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->live_branches, 1);
  Drained d = drain(**s.generate(greedy("a", id, {root}, 3)));
  EXPECT_TRUE(d.status.ok()) << d.status.message();
  ASSERT_TRUE(s.delete_tree(id, "a").ok());
  expect_idle(s);
}

// cached_tokens: a prompt one tenant cached is reused (and reported) only for tenants with
// the same cache salt; the others get 0, for the exact prompt and for a guess alike.
TEST(SchedulerTenants, PrefixCacheIsPartitionedBySalt) {
  SchedulerOptions o;
  TenantLimits a = tenant("a"), b = tenant("b"), c = tenant("c"), d = tenant("d");
  a.cache_salt = "shared";
  c.cache_salt = "shared";
  o.tenants = {a, b, c, d};
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  const std::vector<int32_t> secret = prompt(40, 3);
  std::vector<int32_t> guess = secret;
  guess.back() = 7;
  auto first = create(s, "a", secret);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->cached_tokens, 0);
  // (Two tenants probe: a tenant's own probes share its own cache.)
  auto exact = create(s, "b", secret);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->cached_tokens, 0);
  auto wrong = create(s, "d", guess);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(wrong->cached_tokens, 0);
  auto again = create(s, "a", secret);  // the owner's cache works
  ASSERT_TRUE(again.ok());
  EXPECT_GT(again->cached_tokens, 30);
  auto shared = create(s, "c", guess);  // the same salt shares it
  ASSERT_TRUE(shared.ok());
  EXPECT_GT(shared->cached_tokens, 30);
  // An unconfigured tenant uses the default namespace, which has none of it either.
  auto stranger = create(s, "x", secret);
  ASSERT_TRUE(stranger.ok());
  EXPECT_EQ(stranger->cached_tokens, 0);
  for (const char* who : {"a", "b", "c", "d", "x"}) delete_all(s, who);
  expect_idle(s);
}

// One tenant at its tree quota (the measurement behind it: one client made thousands of
// one-token trees and everyone else's CreateTree failed) stops only itself.
TEST(SchedulerTenants, TreeQuotaStopsOnlyItsTenant) {
  SchedulerOptions o;
  TenantLimits a = tenant("a");
  a.max_live_trees = 8;
  o.tenants = {a, tenant("b")};
  o.max_live_trees = 64;
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  int made = 0;
  Status refused;
  for (int i = 0; i < 4096 && refused.ok(); ++i) {
    auto t = create(s, "a", {5});
    if (t.ok()) {
      ++made;
    } else {
      refused = t.status();
    }
  }
  EXPECT_EQ(made, 8);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            "tenant 'a': live trees 8 of 8 (quota max_live_trees); delete trees you no longer "
            "need");
  EXPECT_TRUE(is_tenant_quota_refusal(refused));
  auto b = create(s, "b", {5});
  EXPECT_TRUE(b.ok()) << b.status().message();
  // A one-shot Generate is not a tree of the quota (its streams are bounded elsewhere).
  GenerateSpec one;
  one.tenant = "a";
  one.prompt = prompt(5);
  one.max_tokens = 2;
  EXPECT_TRUE(drain(**s.generate(one)).status.ok());
  // Deleting one makes room for one.
  auto list = s.list_trees("a");
  ASSERT_TRUE(list.ok());
  ASSERT_TRUE(s.delete_tree(list->trees[0].tree_id, "a").ok());
  EXPECT_TRUE(create(s, "a", {5}).ok());
  EXPECT_FALSE(create(s, "a", {5}).ok());
  for (const char* who : {"a", "b"}) delete_all(s, who);
  expect_idle(s);
}

TEST(SchedulerTenants, BranchQuotaCountsEveryLiveBranch) {
  SchedulerOptions o;
  TenantLimits a = tenant("a");
  a.max_live_branches = 6;
  o.tenants = {a};
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  auto t1 = create(s, "a", prompt(10));
  ASSERT_TRUE(t1.ok());
  ASSERT_TRUE(s.branch(t1->tree_id, t1->root_branch_id, 3, 0, nullptr, "a").ok());  // 4 live
  auto t2 = create(s, "a", prompt(10, 1));                                          // 5 live
  ASSERT_TRUE(t2.ok());
  auto over = s.branch(t2->tree_id, t2->root_branch_id, 2, 0, nullptr, "a");
  EXPECT_EQ(over.status().message(),
            "tenant 'a': live branches 5 of 6 (quota max_live_branches), 2 more needed; prune "
            "branches or delete trees");
  GenerateSpec one;  // one-shot: its root and n children
  one.tenant = "a";
  one.prompt = prompt(5);
  one.n = 2;
  EXPECT_EQ(s.generate(one).status().code(), StatusCode::kResourceExhausted);
  // A beam search needs its width in branches.
  GenerateSpec beam = greedy("a", t2->tree_id, {t2->root_branch_id}, 4);
  beam.beam_width = 3;
  EXPECT_EQ(s.generate(beam).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(s.branch(t2->tree_id, t2->root_branch_id, 1, 0, nullptr, "a").ok());  // 6 live
  EXPECT_FALSE(create(s, "a", prompt(3)).ok());  // a root is a branch too
  ASSERT_TRUE(s.prune(t1->tree_id, {t1->root_branch_id}, false, "a").ok());  // 4 fewer
  EXPECT_TRUE(s.branch(t2->tree_id, t2->root_branch_id, 4, 0, nullptr, "a").ok());
  delete_all(s, "a");
  expect_idle(s);
}

// KV pages: a tenant's namespace holds at most its quota. A request that could never fit is
// refused at once; work that outgrows the quota is refused naming it while another tenant's
// work runs on; and a tenant at its quota recycles its own cache, never another's.
TEST(SchedulerTenants, KvQuotaBoundsATenantsPages) {
  SchedulerOptions o;
  TenantLimits a = tenant("a");
  a.kv_pages = 4;  // 64 tokens
  o.tenants = {a, tenant("b")};
  Served sv = serve(24, o);
  Scheduler& s = *sv.scheduler;
  auto big = create(s, "a", prompt(100));
  EXPECT_EQ(big.status().message(),
            "tenant 'a': a prompt of 100 tokens needs 7 KV pages, more than the quota of 4 (quota "
            "kv_pages)");

  // a's generation outgrows its 4 pages while b's runs: a's is refused, b's finishes.
  auto ta = create(s, "a", prompt(60, 1));
  auto tb = create(s, "b", prompt(40, 2));
  ASSERT_TRUE(ta.ok() && tb.ok());
  auto sa = s.generate(greedy("a", ta->tree_id, {ta->root_branch_id}, 200));
  auto sb = s.generate(greedy("b", tb->tree_id, {tb->root_branch_id}, 120));
  ASSERT_TRUE(sa.ok() && sb.ok());
  Drained da = drain(**sa);
  Drained db = drain(**sb);
  EXPECT_EQ(da.status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(da.status.message(),
            "tenant 'a': KV pages 4 of 4 (quota kv_pages) held by live branches, and more "
            "needed; prune branches or delete trees");
  EXPECT_TRUE(db.status.ok()) << db.status.message();
  EXPECT_GT(db.tokens.begin()->second.size(), 0u);
  // a's branch keeps what it generated within its quota and stays usable.
  auto info = s.get_tree(ta->tree_id, {}, "a");
  ASSERT_TRUE(info.ok());
  EXPECT_LE(info->kv_pages, 4);
  EXPECT_GT(info->total_tokens, 60);
  delete_all(s, "a");
  delete_all(s, "b");
  expect_idle(s);

  // b caches a prompt; a churns through many prompts of its own (each cached on deletion):
  // a recycles its own cache, so b's prefix stays cached.
  const std::vector<int32_t> b_prompt = prompt(96, 5);  // 6 pages
  auto kept = create(s, "b", b_prompt);
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(s.delete_tree(kept->tree_id, "b").ok());
  for (int i = 0; i < 20; ++i) {
    auto t = create(s, "a", prompt(40, 10 + i));
    ASSERT_TRUE(t.ok()) << i << ": " << t.status().message();
    ASSERT_TRUE(s.delete_tree(t->tree_id, "a").ok());
  }
  auto back = create(s, "b", b_prompt);
  ASSERT_TRUE(back.ok());
  EXPECT_GE(back->cached_tokens, 80);
  delete_all(s, "b");
  expect_idle(s);
}

TEST(SchedulerTenants, ListTreesShowsOneTenantsTreesInPages) {
  SchedulerOptions o;
  o.tenants = {tenant("a"), tenant("b")};
  Served sv = serve(64, o);
  Scheduler& s = *sv.scheduler;
  std::vector<std::string> mine;
  for (int i = 0; i < 5; ++i) {
    auto t = create(s, "a", prompt(20, i));
    ASSERT_TRUE(t.ok());
    mine.push_back(t->tree_id);
    ASSERT_TRUE(create(s, "b", prompt(20, i)).ok());
  }
  ASSERT_TRUE(
      s.branch(mine[1], s.get_tree(mine[1], {}, "a")->branches[0].branch_id, 2, 0, nullptr, "a")
          .ok());
  std::vector<std::string> seen;
  TreePage page;
  page.page_size = 2;
  for (int pages = 0;; ++pages) {
    ASSERT_LT(pages, 5);
    auto list = s.list_trees("a", page);
    ASSERT_TRUE(list.ok()) << list.status().message();
    EXPECT_LE(list->trees.size(), 2u);
    for (const TreeListing& t : list->trees) {
      seen.push_back(t.tree_id);
      EXPECT_EQ(t.total_tokens, 20);  // forks share their parent's tokens
      EXPECT_EQ(t.live_branches, t.tree_id == mine[1] ? 3 : 1);
      EXPECT_GT(t.kv_pages, 0);
      EXPECT_GT(t.lease_ms, 0);
      EXPECT_GT(t.expires_at_unix_ms, t.created_at_unix_ms);
    }
    if (list->next_page_token.empty()) break;
    page.page_token = list->next_page_token;
  }
  EXPECT_EQ(seen, mine);  // oldest first, only a's
  page.page_token = "x";
  EXPECT_EQ(s.list_trees("a", page).status().message(),
            "page_token: 'x' is not a ListTrees page token");
  EXPECT_TRUE(s.list_trees("nobody")->trees.empty());
  for (const char* who : {"a", "b"}) delete_all(s, who);
  expect_idle(s);
}

}  // namespace
}  // namespace treeserve
