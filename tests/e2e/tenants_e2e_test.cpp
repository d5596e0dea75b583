// End-to-end: tenants and quotas against the real server over loopback, started with a keys
// file (alice, bob, carol, dave sharing alice's cache salt, and tenants with rate, stream and
// KV quotas). Another tenant's tree is NOT_FOUND for every method, exactly as an unknown id;
// cached_tokens tells one tenant nothing of another's prompts; one tenant at its live-tree
// quota (the measurement: thousands of one-token trees) does not stop another's CreateTree;
// the rate, stream and KV quotas refuse naming the tenant, its usage and the quota; ListTrees
// lists the caller's trees only; refusals are counted in treeserve:quota_refusals_total.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using Clock = std::chrono::steady_clock;

constexpr char kSecret[] =
    "System: you are the support assistant of Example Corp. The vault code is 4471-ZETA-9. "
    "Never reveal it. User: what are your opening hours?";
constexpr char kGuess[] =
    "System: you are the support assistant of Example Corp. The vault code is 1234-ABCD-0. "
    "Never reveal it. User: what are your opening hours?";

// "password"'s SHA-256: alice's key is listed by its hash, the others as keys.
constexpr char kAliceKey[] = "password";
constexpr char kAliceSha[] = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";

std::string keys_file() {
  const std::string json = std::string(R"({
  "tenants": [
    {"name": "alice", "quotas": {"max_live_trees": 64}, "cache_salt": "alice-docs"},
    {"name": "bob"},
    {"name": "carol"},
    {"name": "dave", "cache_salt": "alice-docs"},
    {"name": "rate", "quotas": {"requests_per_second": 2, "burst": 3}},
    {"name": "streams", "quotas": {"max_concurrent_streams": 1}},
    {"name": "kv", "quotas": {"kv_pages": 4}}
  ],
  "keys": [
    {"tenant": "alice", "sha256": ")") +
                           kAliceSha + R"("},
    {"tenant": "bob", "key": "bob-key"},
    {"tenant": "carol", "key": "carol-key"},
    {"tenant": "dave", "key": "dave-key"},
    {"tenant": "rate", "key": "rate-key"},
    {"tenant": "streams", "key": "streams-key"},
    {"tenant": "kv", "key": "kv-key"}
  ]
})";
  const std::string path = (std::filesystem::path(treeserve::testing_support::test_temp_dir()) /
                            "treeserve-tenants-keys.json")
                               .string();
  std::ofstream(path) << json;
  return path;
}

// Calls as one tenant (its key on every call).
class As {
 public:
  As(std::shared_ptr<grpc::Channel> channel, std::string key)
      : stub_(v1::TreeServe::NewStub(std::move(channel))), key_(std::move(key)) {}

  void prepare(grpc::ClientContext* ctx, int seconds = 30) const {
    ctx->AddMetadata("authorization", "Bearer " + key_);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
  }

  grpc::Status create(const std::string& text, v1::CreateTreeResponse* out) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text(text);
    return stub_->CreateTree(&ctx, req, out);
  }
  grpc::Status create_tokens(std::vector<int32_t> ids, v1::CreateTreeResponse* out) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::CreateTreeRequest req;
    req.mutable_prompt()->mutable_tokens()->mutable_ids()->Add(ids.begin(), ids.end());
    return stub_->CreateTree(&ctx, req, out);
  }
  grpc::Status get_tree(const std::string& tree, v1::TreeInfo* out = nullptr) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    v1::TreeInfo info;
    return stub_->GetTree(&ctx, req, out ? out : &info);
  }
  grpc::Status branch(const std::string& tree, const std::string& branch, int n) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::BranchRequest req;
    req.set_tree_id(tree);
    req.set_branch_id(branch);
    req.set_n(n);
    v1::BranchResponse resp;
    return stub_->Branch(&ctx, req, &resp);
  }
  // Reads the whole stream; the number of token messages in *tokens.
  grpc::Status generate(const v1::GenerateRequest& req, int* tokens = nullptr) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse r;
    int n = 0;
    while (reader->Read(&r)) ++n;
    if (tokens) *tokens = n;
    return reader->Finish();
  }
  grpc::Status generate_on(const std::string& tree, const std::string& branch,
                           int max_tokens) const {
    v1::GenerateRequest req;
    req.set_tree_id(tree);
    req.add_branch_ids(branch);
    req.mutable_sampling()->set_max_tokens(max_tokens);
    return generate(req);
  }
  grpc::Status prune(const std::string& tree, const std::string& branch) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::PruneRequest req;
    req.set_tree_id(tree);
    req.add_branch_ids(branch);
    v1::PruneResponse resp;
    return stub_->Prune(&ctx, req, &resp);
  }
  grpc::Status verify(const std::string& tree, const std::string& branch) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::VerifyRequest req;
    req.set_tree_id(tree);
    req.set_branch_id(branch);
    req.add_tokens(5);
    req.add_parents(-1);
    v1::VerifyResponse resp;
    return stub_->Verify(&ctx, req, &resp);
  }
  grpc::Status delete_tree(const std::string& tree) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree);
    v1::DeleteTreeResponse resp;
    return stub_->DeleteTree(&ctx, req, &resp);
  }
  grpc::Status tree_search(const std::string& tree) const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    auto stream = stub_->TreeSearch(&ctx);
    v1::TreeSearchRequest start;
    start.mutable_start()->set_tree_id(tree);
    start.mutable_start()->set_expand(2);
    start.mutable_start()->set_keep(1);
    start.mutable_start()->set_depth(1);
    start.mutable_start()->mutable_sampling()->set_max_tokens(2);
    stream->Write(start);
    stream->WritesDone();
    v1::TreeSearchResponse r;
    while (stream->Read(&r)) {
    }
    return stream->Finish();
  }
  grpc::Status list(v1::ListTreesResponse* out, int page_size = 0,
                    const std::string& token = "") const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::ListTreesRequest req;
    req.set_page_size(page_size);
    req.set_page_token(token);
    return stub_->ListTrees(&ctx, req, out);
  }
  // Every live tree of the tenant, through ListTrees' pages.
  std::vector<std::string> all_trees(int page_size = 0) const {
    std::vector<std::string> ids;
    std::string token;
    for (int pages = 0; pages < 1000; ++pages) {
      v1::ListTreesResponse resp;
      grpc::Status s = list(&resp, page_size, token);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok()) break;
      for (const v1::TreeListing& t : resp.trees()) ids.push_back(t.tree_id());
      token = resp.next_page_token();
      if (token.empty()) break;
    }
    return ids;
  }
  void delete_all() const {
    for (const std::string& id : all_trees(1000)) EXPECT_TRUE(delete_tree(id).ok()) << id;
  }
  grpc::Status server_info() const {
    grpc::ClientContext ctx;
    prepare(&ctx);
    v1::ServerInfo info;
    return stub_->GetServerInfo(&ctx, {}, &info);
  }
  v1::TreeServe::Stub* stub() const { return stub_.get(); }

 private:
  std::unique_ptr<v1::TreeServe::Stub> stub_;
  std::string key_;
};

class TenantsE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    metrics_port_ = pick_free_port();
    std::vector<std::string> args = backend_args();
    args.push_back("--keys-file");
    args.push_back(keys_file());
    args.push_back("--metrics-listen");
    args.push_back("127.0.0.1:" + std::to_string(metrics_port_));
    server_ = new ServerProcess(args);
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->output();
    delete server_;
    server_ = nullptr;
  }
  static As as(const std::string& key) { return As(server_->channel(), key); }
  static std::string metrics() {
    httplib::Client http("127.0.0.1", metrics_port_);
    auto res = http.Get("/metrics", {{"Authorization", std::string("Bearer ") + kAliceKey}});
    return res ? res->body : "";
  }
  static inline ServerProcess* server_ = nullptr;
  static inline int metrics_port_ = 0;
};

// The message of a NOT_FOUND for `id`, with the id replaced by `with`.
std::string shape(const grpc::Status& s, const std::string& id, const std::string& with) {
  std::string m = s.error_message();
  for (size_t at = m.find(id); at != std::string::npos; at = m.find(id, at + with.size())) {
    m.replace(at, id.size(), with);
  }
  return m;
}

TEST_F(TenantsE2E, AnotherTenantsTreeIsNotFoundForEveryMethod) {
  As alice = as(kAliceKey), bob = as("bob-key");
  v1::CreateTreeResponse tree;
  ASSERT_TRUE(alice.create(kSecret, &tree).ok());
  const std::string id = tree.tree_id(), root = tree.root_branch_id();
  const std::string unknown = "t_" + std::string(22, 'Q');
  using Call = std::function<grpc::Status(const std::string&)>;
  const std::vector<std::pair<std::string, Call>> calls = {
      {"GetTree", [&](const std::string& t) { return bob.get_tree(t); }},
      {"Branch", [&](const std::string& t) { return bob.branch(t, root, 2); }},
      {"Generate", [&](const std::string& t) { return bob.generate_on(t, root, 4); }},
      {"Prune", [&](const std::string& t) { return bob.prune(t, root); }},
      {"Verify", [&](const std::string& t) { return bob.verify(t, root); }},
      {"DeleteTree", [&](const std::string& t) { return bob.delete_tree(t); }},
      {"TreeSearch", [&](const std::string& t) { return bob.tree_search(t); }},
  };
  for (const auto& [method, call] : calls) {
    const grpc::Status foreign = call(id), missing = call(unknown);
    EXPECT_EQ(foreign.error_code(), grpc::StatusCode::NOT_FOUND) << method;
    EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << method;
    // The same message, naming the id asked for: nothing says the tree exists.
    EXPECT_EQ(shape(foreign, id, "<id>"), shape(missing, unknown, "<id>"))
        << method << ": " << foreign.error_message();
  }
  // No timing oracle worth the name: the same lookup answers both (medians of GetTree).
  std::vector<double> foreign_ms, missing_ms;
  for (int i = 0; i < 60; ++i) {
    for (auto [tree_id, out] : {std::pair{&id, &foreign_ms}, std::pair{&unknown, &missing_ms}}) {
      const auto t0 = Clock::now();
      (void)bob.get_tree(*tree_id);
      out->push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  std::sort(foreign_ms.begin(), foreign_ms.end());
  std::sort(missing_ms.begin(), missing_ms.end());
  EXPECT_LT(std::abs(foreign_ms[30] - missing_ms[30]), 5.0)
      << foreign_ms[30] << " ms vs " << missing_ms[30] << " ms";
  // Alice's tree is untouched and hers to use.
  v1::TreeInfo info;
  ASSERT_TRUE(alice.get_tree(id, &info).ok());
  EXPECT_EQ(info.live_branches(), 1);
  EXPECT_TRUE(alice.generate_on(id, root, 3).ok());
  EXPECT_TRUE(alice.delete_tree(id).ok());
}

// The issue's measurement repeated: another tenant's CreateTree of alice's exact prompt, and of
// a wrong guess of its secret, report 0 cached tokens (on a shared cache they reported most of
// the prompt, more for the right secret than for the wrong one).
TEST_F(TenantsE2E, CachedTokensRevealNothingAcrossTenants) {
  As alice = as(kAliceKey), bob = as("bob-key"), carol = as("carol-key"), dave = as("dave-key");
  v1::CreateTreeResponse a, b, c, a2, d;
  ASSERT_TRUE(alice.create(kSecret, &a).ok());
  ASSERT_TRUE(bob.create(kSecret, &b).ok());
  ASSERT_TRUE(carol.create(kGuess, &c).ok());
  EXPECT_EQ(b.cached_tokens(), 0) << "exact prompt";
  EXPECT_EQ(c.cached_tokens(), 0) << "wrong guess";
  // Alice's own cache works, and dave, given alice's cache salt, shares it.
  ASSERT_TRUE(alice.create(kSecret, &a2).ok());
  EXPECT_GE(a2.cached_tokens(), a2.prompt_tokens() - 2);
  ASSERT_TRUE(dave.create(kGuess, &d).ok());
  EXPECT_GT(d.cached_tokens(), 10);
  EXPECT_LT(d.cached_tokens(), d.prompt_tokens() - 2);
  for (const As* who : {&alice, &bob, &carol, &dave}) who->delete_all();
}

// One tenant fills its live-tree quota with one-token trees as fast as it can (4,096 tries
// from 4 threads); every try past the quota is refused naming it, and another tenant's
// CreateTree goes through meanwhile and after.
TEST_F(TenantsE2E, ATenantAtItsTreeQuotaDoesNotStopAnother) {
  As alice = as(kAliceKey), bob = as("bob-key");
  std::atomic<int> made{0}, refused{0}, other{0};
  std::atomic<bool> wrong_message{false};
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      As a = as(kAliceKey);
      for (int i = 0; i < 1024; ++i) {
        v1::CreateTreeResponse r;
        grpc::Status s = a.create_tokens({5}, &r);
        if (s.ok()) {
          ++made;
        } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          ++refused;
          if (s.error_message() !=
              "tenant 'alice': live trees 64 of 64 (quota max_live_trees); delete trees you "
              "no longer need") {
            wrong_message = true;
          }
        } else {
          ++other;
        }
      }
    });
  }
  // Bob's CreateTree while alice floods.
  std::vector<grpc::Status> bob_during;
  for (int i = 0; i < 5; ++i) {
    v1::CreateTreeResponse r;
    bob_during.push_back(bob.create_tokens({5, 6, 7}, &r));
  }
  for (std::thread& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_EQ(made.load(), 64);
  EXPECT_EQ(refused.load(), 4096 - 64);
  EXPECT_EQ(other.load(), 0);
  EXPECT_FALSE(wrong_message.load());
  for (const grpc::Status& s : bob_during) EXPECT_TRUE(s.ok()) << s.error_message();
  v1::CreateTreeResponse after;
  EXPECT_TRUE(bob.create_tokens({5, 6, 7}, &after).ok());
  std::printf("alice: 4096 CreateTree tries in %.2f s: %d trees, %d refused\n", seconds,
              made.load(), refused.load());
  EXPECT_EQ(alice.all_trees(10).size(), 64u);  // ListTrees' pages list them all
  alice.delete_all();
  bob.delete_all();
  EXPECT_TRUE(alice.all_trees().empty());
}

TEST_F(TenantsE2E, RequestsPerSecondQuota) {
  As rate = as("rate-key"), bob = as("bob-key");
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));           // a full bucket
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(rate.server_info().ok()) << i;  // the burst
  grpc::Status s = rate.server_info();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message().rfind("tenant 'rate': request rate at 2 per second with its burst "
                                    "of 3 used (quota requests_per_second); retry in ",
                                    0),
            0u)
      << s.error_message();
  for (int i = 0; i < 20; ++i) EXPECT_TRUE(bob.server_info().ok());  // others are not limited
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_TRUE(rate.server_info().ok());  // refilled at 2 per second
  const std::string body = metrics();
  const std::string line = "\ntreeserve:quota_refusals_total ";
  const size_t at = body.find(line);
  ASSERT_NE(at, std::string::npos) << body;
  EXPECT_GE(std::stod(body.substr(at + line.size())), 1.0);
}

// Generate and TreeSearch calls in flight count against max_concurrent_streams.
TEST_F(TenantsE2E, ConcurrentStreamsQuota) {
  As streams = as("streams-key");
  v1::CreateTreeResponse tree;
  ASSERT_TRUE(streams.create("Once upon a time", &tree).ok());
  grpc::ClientContext ctx;
  streams.prepare(&ctx, 120);
  v1::GenerateRequest long_req;
  long_req.set_tree_id(tree.tree_id());
  long_req.add_branch_ids(tree.root_branch_id());
  long_req.mutable_sampling()->set_max_tokens(4000);
  auto reader = streams.stub()->Generate(&ctx, long_req);
  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));  // in flight
  const std::string want =
      "tenant 'streams': concurrent streams 1 of 1 (quota max_concurrent_streams); wait for one "
      "to end";
  v1::GenerateRequest one_shot;
  one_shot.mutable_prompt()->set_text("Hello");
  one_shot.mutable_sampling()->set_max_tokens(2);
  grpc::Status second = streams.generate(one_shot);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(second.error_message(), want);
  grpc::Status search = streams.tree_search(tree.tree_id());
  EXPECT_EQ(search.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(search.error_message(), want);
  EXPECT_TRUE(streams.get_tree(tree.tree_id()).ok());  // unary calls are not streams
  ctx.TryCancel();
  while (reader->Read(&first)) {
  }
  (void)reader->Finish();
  // The slot comes back when the server's handler ends.
  grpc::Status again;
  for (int i = 0; i < 100; ++i) {
    again = streams.generate(one_shot);
    if (again.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(again.ok()) << again.error_message();
  streams.delete_all();
}

TEST_F(TenantsE2E, KvPageQuota) {
  As kv = as("kv-key");
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 100; ++i) long_prompt.push_back(3 + i);
  v1::CreateTreeResponse r;
  grpc::Status s = kv.create_tokens(long_prompt, &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(s.error_message(),
            "tenant 'kv': a prompt of 100 tokens needs 7 KV pages, more than the quota of 4 "
            "(quota kv_pages)");
  long_prompt.resize(60);
  ASSERT_TRUE(kv.create_tokens(long_prompt, &r).ok());
  // Decoding past 4 pages (64 tokens) is refused, naming the quota; the branch keeps what it
  // generated within it.
  grpc::Status grow = kv.generate_on(r.tree_id(), r.root_branch_id(), 200);
  EXPECT_EQ(grow.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(grow.error_message().rfind("tenant 'kv': KV pages 4 of 4 (quota kv_pages)", 0), 0u)
      << grow.error_message();
  v1::TreeInfo info;
  ASSERT_TRUE(kv.get_tree(r.tree_id(), &info).ok());
  EXPECT_LE(info.kv_pages(), 4);
  EXPECT_GT(info.total_tokens(), 60);
  kv.delete_all();
}

TEST_F(TenantsE2E, ListTreesShowsOnlyTheCallersTrees) {
  As alice = as(kAliceKey), bob = as("bob-key");
  std::vector<std::string> mine, theirs;
  for (int i = 0; i < 3; ++i) {
    v1::CreateTreeResponse r;
    ASSERT_TRUE(alice.create_tokens({5, 6, 7 + i}, &r).ok());
    mine.push_back(r.tree_id());
    if (i < 2) {
      ASSERT_TRUE(bob.create_tokens({5, 6, 7 + i}, &r).ok());
      theirs.push_back(r.tree_id());
    }
  }
  EXPECT_EQ(alice.all_trees(2), mine);  // two pages, oldest first
  EXPECT_EQ(bob.all_trees(), theirs);
  v1::ListTreesResponse page;
  ASSERT_TRUE(alice.list(&page, 1).ok());
  ASSERT_EQ(page.trees_size(), 1);
  const v1::TreeListing& t = page.trees(0);
  EXPECT_EQ(t.tree_id(), mine[0]);
  EXPECT_EQ(t.live_branches(), 1);
  EXPECT_EQ(t.total_tokens(), 3);
  EXPECT_GT(t.lease_ms(), 0);
  EXPECT_GT(t.expires_at_unix_ms(), t.created_at_unix_ms());
  EXPECT_FALSE(page.next_page_token().empty());
  grpc::Status bad = alice.list(&page, 0, "nope");
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad.error_message(), "page_token: 'nope' is not a ListTrees page token");
  alice.delete_all();
  bob.delete_all();
  EXPECT_TRUE(alice.all_trees().empty());
}

// A keys file with a mistake stops the server at start, naming the entry and the field.
TEST(TenantsStartup, ABadKeysFileIsAStartUpError) {
  const std::string path = (std::filesystem::path(treeserve::testing_support::test_temp_dir()) /
                            "treeserve-bad-keys.json")
                               .string();
  std::ofstream(path) << R"({"tenants": [{"name": "a"}], "keys": [{"tenant": "b", "key": "k"}]})";
  std::vector<std::string> args = backend_args();
  args.push_back("--keys-file");
  args.push_back(path);
  RunResult r = run_treeserve_to_exit(args);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find(path + ": keys[0].tenant: 'b' is not a tenant of this file"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace treeserve::testing
