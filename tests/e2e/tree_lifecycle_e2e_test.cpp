// End-to-end: what a shared server promises about the life of a tree, against the real
// treeserve binary (CPU backend, tiny model, loopback gRPC). A CreateTree whose client gives
// up leaves no tree and no pages; thousands of forks and prunes leave GetTree fast and the
// server's memory flat; an idle tree expires after its lease (and the metric counts it);
// GetTree pages through a tree's live branches.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string write_config(const std::string& name, const std::string& json) {
  const std::string path = treeserve::testing_support::test_temp_dir() + "/" + name;
  std::ofstream(path) << json;
  return path;
}

std::vector<std::string> with(std::vector<std::string> extra) {
  std::vector<std::string> args = backend_args();
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

v1::Prompt tokens(const std::vector<int32_t>& ids) {
  v1::Prompt p;
  for (int32_t id : ids) p.mutable_tokens()->add_ids(id);
  return p;
}

// n token ids in [3, 503) that no other test's prompt shares.
std::vector<int32_t> unique_prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p(n);
  for (int32_t& t : p) t = 3 + int32_t(rng() % 500);
  return p;
}

class Client {
 public:
  explicit Client(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::TreeServe::NewStub(std::move(channel))) {}

  grpc::Status create_tree(const v1::Prompt& prompt, v1::CreateTreeResponse* resp,
                           int64_t lease_ms = 0, milliseconds deadline = milliseconds(0)) {
    grpc::ClientContext ctx;
    if (deadline.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    v1::CreateTreeRequest req;
    *req.mutable_prompt() = prompt;
    req.set_lease_ms(lease_ms);
    return stub_->CreateTree(&ctx, req, resp);
  }

  std::vector<std::string> branch(const std::string& tree, const std::string& branch, int n) {
    grpc::ClientContext ctx;
    v1::BranchRequest req;
    req.set_tree_id(tree);
    req.set_branch_id(branch);
    req.set_n(n);
    v1::BranchResponse resp;
    grpc::Status s = stub_->Branch(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.branch_ids().begin(), resp.branch_ids().end()};
  }

  grpc::Status prune(const std::string& tree, const std::vector<std::string>& ids,
                     v1::PruneResponse* resp) {
    grpc::ClientContext ctx;
    v1::PruneRequest req;
    req.set_tree_id(tree);
    for (const std::string& id : ids) req.add_branch_ids(id);
    return stub_->Prune(&ctx, req, resp);
  }

  grpc::Status get_tree(const std::string& tree, v1::TreeInfo* info, int32_t page_size = 0,
                        const std::string& page_token = "") {
    grpc::ClientContext ctx;
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    req.set_page_size(page_size);
    req.set_page_token(page_token);
    return stub_->GetTree(&ctx, req, info);
  }

  grpc::Status delete_tree(const std::string& tree) {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree);
    v1::DeleteTreeResponse resp;
    return stub_->DeleteTree(&ctx, req, &resp);
  }

  v1::ServerInfo info() {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    return info;
  }

  void expect_idle() {
    v1::ServerInfo i = info();
    EXPECT_EQ(i.live_trees(), 0);
    EXPECT_EQ(i.live_branches(), 0);
    EXPECT_EQ(i.kv_pages_free() + i.kv_pages_evictable(), i.kv_pages_total());
  }

 private:
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

// Polls `done` every 20 ms for up to `limit`; true once it holds.
bool eventually(const std::function<bool()>& done, milliseconds limit = milliseconds(10000)) {
  const auto end = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return true;
}

int64_t rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string key;
  while (in >> key) {
    if (key == "VmRSS:") {
      int64_t kib = 0;
      in >> kib;
      return kib;
    }
    std::getline(in, key);
  }
  return -1;
}

// A CreateTree whose client gives up (its deadline passes, or it cancels) during a slow
// prefill (one prompt token per step) leaves no tree and returns every page it took.
TEST(TreeLifecycle, AbandonedCreateTreeLeavesNothing) {
  ServerProcess server(with(
      {"--config", write_config("slow_prefill.json", R"({"scheduler": {"max_step_tokens": 1}})")}));
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  const v1::ServerInfo before = c.info();
  ASSERT_EQ(before.kv_pages_free(), before.kv_pages_total());
  auto settled = [&] {
    v1::ServerInfo i = c.info();
    return i.live_trees() == 0 && i.kv_pages_free() == before.kv_pages_free();
  };

  v1::CreateTreeResponse resp;
  const auto start = Clock::now();
  grpc::Status s = c.create_tree(tokens(unique_prompt(1900, 1)), &resp, 0, milliseconds(150));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_TRUE(eventually(settled)) << "free " << c.info().kv_pages_free() << " of "
                                   << before.kv_pages_free() << ", trees " << c.info().live_trees();
  EXPECT_LT(Clock::now() - start, milliseconds(5000)) << "the prefill ran to its end";

  // The client cancels from another thread.
  grpc::ClientContext ctx;
  v1::CreateTreeRequest req;
  *req.mutable_prompt() = tokens(unique_prompt(1900, 2));
  std::thread canceller([&] {
    std::this_thread::sleep_for(milliseconds(150));
    ctx.TryCancel();
  });
  s = v1::TreeServe::NewStub(server.channel())->CreateTree(&ctx, req, &resp);
  canceller.join();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  EXPECT_TRUE(eventually(settled))
      << "free " << c.info().kv_pages_free() << " of " << before.kv_pages_free();

  // The server is unharmed: a tree made now works.
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(40, 3)), &resp).ok());
  EXPECT_TRUE(c.delete_tree(resp.tree_id()).ok());
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

// 2,000 rounds of Branch(n = 256) + Prune on one tree: the pruned branches leave the tree, so
// GetTree answers in under 5 ms with the one live branch, and the server's RSS stays flat.
TEST(TreeLifecycle, ForkAndPruneChurnKeepsGetTreeFastAndMemoryFlat) {
  ServerProcess server(backend_args());
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  v1::CreateTreeResponse tree;
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(100, 4)), &tree).ok());
  auto get_tree_ms = [&] {
    std::vector<double> ms;
    for (int i = 0; i < 15; ++i) {
      v1::TreeInfo info;
      const auto t0 = Clock::now();
      EXPECT_TRUE(c.get_tree(tree.tree_id(), &info).ok());
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      EXPECT_EQ(info.branches_size(), 1);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double fresh_ms = get_tree_ms();
  int64_t rss_warm = 0;
  for (int round = 0; round < 2000; ++round) {
    if (round == 200) rss_warm = rss_kib(server.pid());
    std::vector<std::string> kids = c.branch(tree.tree_id(), tree.root_branch_id(), 256);
    ASSERT_EQ(kids.size(), 256u) << "round " << round;
    v1::PruneResponse p;
    ASSERT_TRUE(c.prune(tree.tree_id(), kids, &p).ok()) << "round " << round;
    ASSERT_EQ(p.pruned_branches(), 256);
  }
  const int64_t rss_end = rss_kib(server.pid());
  const double churned_ms = get_tree_ms();
  v1::TreeInfo info;
  ASSERT_TRUE(c.get_tree(tree.tree_id(), &info).ok());
  EXPECT_EQ(info.live_branches(), 1);
  EXPECT_LT(info.ByteSizeLong(), 1000u);
  EXPECT_LT(churned_ms, 5.0) << "median GetTree after the churn (fresh tree: " << fresh_ms
                             << " ms)";
  ASSERT_GT(rss_warm, 0);
  // Flat: a queue or table that grew by even a dozen bytes per branch would add ~5 MB here.
  EXPECT_LT(rss_end - rss_warm, 3 * 1024)
      << "RSS grew from " << rss_warm << " KiB to " << rss_end << " KiB over 1,800 rounds";
  std::fprintf(stderr,
               "GetTree median: %.3f ms fresh, %.3f ms after 2000 rounds; RSS %ld -> %ld KiB\n",
               fresh_ms, churned_ms, long(rss_warm), long(rss_end));
  EXPECT_TRUE(c.delete_tree(tree.tree_id()).ok());
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

// Leases: a tree nobody touches expires (GetTree then says NOT_FOUND, the metric counts it);
// calls renew the lease; the default comes from the config; a lease over the maximum is
// refused naming it.
TEST(TreeLifecycle, IdleTreesExpireAfterTheirLease) {
  const int port = pick_free_port();
  ServerProcess server(
      with({"--metrics-listen", "127.0.0.1:" + std::to_string(port), "--config",
            write_config("lease.json",
                         R"({"server": {"tree_lease_default_s": 1, "tree_lease_max_s": 30}})")}));
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  auto expired_metric = [&]() -> double {
    httplib::Client http("127.0.0.1", port);
    auto res = http.Get("/metrics");
    if (!res || res->status != 200) return -1;
    const std::string key = "\ntreeserve:tree_leases_expired_total ";
    size_t at = res->body.find(key);
    return at == std::string::npos ? -1 : std::stod(res->body.substr(at + key.size()));
  };
  EXPECT_EQ(expired_metric(), 0);

  v1::CreateTreeResponse idle, renewed, by_default;
  const int64_t now_ms =
      std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(30, 5)), &idle, 600).ok());
  EXPECT_EQ(idle.lease_ms(), 600);
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(30, 6)), &renewed, 600).ok());
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(30, 7)), &by_default).ok());
  EXPECT_EQ(by_default.lease_ms(), 1000);
  v1::TreeInfo info;
  ASSERT_TRUE(c.get_tree(idle.tree_id(), &info).ok());
  EXPECT_EQ(info.lease_ms(), 600);
  EXPECT_GE(info.expires_at_unix_ms(), now_ms + 500);
  EXPECT_LE(info.expires_at_unix_ms(), now_ms + 600 + 2000);

  // `renewed` is named every 200 ms; the others are left alone.
  const auto until = Clock::now() + milliseconds(1800);
  while (Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(200));
    ASSERT_TRUE(c.get_tree(renewed.tree_id(), &info).ok()) << "a renewed tree expired";
  }
  grpc::Status s = c.get_tree(idle.tree_id(), &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  s = c.get_tree(by_default.tree_id(), &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(expired_metric(), 2);
  EXPECT_EQ(c.info().live_trees(), 1);

  // Over the maximum (30 s): INVALID_ARGUMENT naming the field and the maximum.
  v1::CreateTreeResponse too_long;
  s = c.create_tree(tokens(unique_prompt(5, 8)), &too_long, 31000);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("lease_ms"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("server.tree_lease_max_s = 30"), std::string::npos)
      << s.error_message();
  s = c.create_tree(tokens(unique_prompt(5, 8)), &too_long, -1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Left alone, the last one goes too; its KV stays as evictable cache.
  EXPECT_TRUE(eventually([&] { return c.info().live_trees() == 0; }, milliseconds(5000)));
  EXPECT_EQ(expired_metric(), 3);
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

// GetTree pages through the live branches in creation order; a bad page token or size is
// INVALID_ARGUMENT naming the field; a page size over the maximum gets the maximum.
TEST(TreeLifecycle, GetTreePages) {
  ServerProcess server(backend_args());
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  v1::CreateTreeResponse tree;
  ASSERT_TRUE(c.create_tree(tokens(unique_prompt(20, 9)), &tree).ok());
  std::vector<std::string> all = {tree.root_branch_id()};
  for (int i = 0; i < 2; ++i) {
    for (const std::string& id : c.branch(tree.tree_id(), tree.root_branch_id(), 150)) {
      all.push_back(id);
    }
  }
  v1::PruneResponse p;
  ASSERT_TRUE(c.prune(tree.tree_id(), {all[7], all[200]}, &p).ok());
  all.erase(all.begin() + 200);
  all.erase(all.begin() + 7);  // 299 live

  v1::TreeInfo info;
  ASSERT_TRUE(c.get_tree(tree.tree_id(), &info).ok());  // page_size 0: up to 1024
  EXPECT_EQ(info.branches_size(), 299);
  EXPECT_TRUE(info.next_page_token().empty());
  EXPECT_EQ(info.live_branches(), 299);

  std::vector<std::string> paged;
  std::string token;
  int pages = 0;
  do {
    ASSERT_TRUE(c.get_tree(tree.tree_id(), &info, 100, token).ok());
    EXPECT_EQ(info.live_branches(), 299);
    EXPECT_EQ(info.total_tokens(), 20);
    for (const auto& b : info.branches()) {
      paged.push_back(b.branch_id());
      EXPECT_TRUE(b.live());
    }
    token = info.next_page_token();
  } while (!token.empty() && ++pages < 10);
  EXPECT_EQ(pages, 2);  // three pages: 100, 100, 99
  EXPECT_EQ(paged, all);

  ASSERT_TRUE(c.get_tree(tree.tree_id(), &info, 1000000).ok());
  EXPECT_EQ(info.branches_size(), 299);
  grpc::Status s = c.get_tree(tree.tree_id(), &info, -1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("page_size"), std::string::npos) << s.error_message();
  s = c.get_tree(tree.tree_id(), &info, 10, "not-a-token");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("page_token"), std::string::npos) << s.error_message();
  EXPECT_TRUE(c.delete_tree(tree.tree_id()).ok());
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
