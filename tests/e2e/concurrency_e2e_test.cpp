// Concurrency soak: 32 client threads issue random tree operations (TreeSearch included)
// against one server (CPU backend, tiny model, a small KV pool so exhaustion happens) for a
// fixed time.
// Passes when the server never crashes, every error is one the API documents for the
// situation, and after deleting every tree the pool is idle (pages balance).
// TREESERVE_SOAK_SECONDS overrides the duration (default 60).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using grpc::StatusCode;

struct Shared {
  std::mutex mu;
  std::vector<std::string> trees;
  std::atomic<int64_t> ops{0}, tokens{0}, errors_ok{0}, searches_done{0};
  std::mutex bad_mu;
  std::vector<std::string> bad;  // undocumented errors

  std::string pick(std::mt19937& rng) {
    std::lock_guard<std::mutex> l(mu);
    if (trees.empty()) return "";
    return trees[rng() % trees.size()];
  }
  void add(const std::string& t) {
    std::lock_guard<std::mutex> l(mu);
    trees.push_back(t);
  }
  void remove(const std::string& t) {
    std::lock_guard<std::mutex> l(mu);
    std::erase(trees, t);
  }
  // The codes a racing client may legitimately see: ids deleted or pruned by another
  // thread, busy branches, a full pool, its own cancellation or deadline.
  void check(const grpc::Status& s, const char* op) {
    ++ops;
    if (s.ok()) return;
    switch (s.error_code()) {
      case StatusCode::NOT_FOUND:
      case StatusCode::FAILED_PRECONDITION:
      case StatusCode::RESOURCE_EXHAUSTED:
      case StatusCode::CANCELLED:
      case StatusCode::DEADLINE_EXCEEDED:
        ++errors_ok;
        return;
      default: {
        std::lock_guard<std::mutex> l(bad_mu);
        bad.push_back(std::string(op) + ": " + std::to_string(s.error_code()) + " " +
                      s.error_message());
      }
    }
  }
};

void client_thread(int id, std::shared_ptr<grpc::Channel> channel, Shared* shared,
                   std::chrono::steady_clock::time_point end) {
  auto stub = v1::TreeServe::NewStub(channel);
  std::mt19937 rng(1234 + id);
  const std::vector<std::string> prefixes = {
      "You are a careful assistant. Think step by step about the puzzle below.",
      "Few-shot examples: apple is a fruit; carrot is a vegetable; tomato is",
      "Document one: the harbour was quiet. Document two: the ships came back at dawn."};
  // A random listed branch of the tree; *root says whether it is the root (no parent).
  auto rand_branch = [&](const std::string& tree, bool* root = nullptr) -> std::string {
    grpc::ClientContext ctx;
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    v1::TreeInfo info;
    grpc::Status s = stub->GetTree(&ctx, req, &info);
    shared->check(s, "GetTree");
    if (!s.ok() || info.branches_size() == 0) return "";
    const v1::BranchInfo& b = info.branches(rng() % info.branches_size());
    if (root) *root = b.parent_branch_id().empty();
    return b.branch_id();
  };
  while (std::chrono::steady_clock::now() < end) {
    const int op = rng() % 100;
    if (op < 12) {  // CreateTree over a shared prefix
      grpc::ClientContext ctx;
      v1::CreateTreeRequest req;
      req.mutable_prompt()->set_text(prefixes[rng() % prefixes.size()] + " #" +
                                     std::to_string(rng() % 50));
      v1::CreateTreeResponse resp;
      grpc::Status s = stub->CreateTree(&ctx, req, &resp);
      shared->check(s, "CreateTree");
      if (s.ok()) shared->add(resp.tree_id());
    } else if (op < 30) {  // Branch
      std::string tree = shared->pick(rng);
      if (tree.empty()) continue;
      std::string b = rand_branch(tree);
      if (b.empty()) continue;
      grpc::ClientContext ctx;
      v1::BranchRequest req;
      req.set_tree_id(tree);
      req.set_branch_id(b);
      req.set_n(1 + rng() % 4);
      v1::BranchResponse resp;
      shared->check(stub->Branch(&ctx, req, &resp), "Branch");
    } else if (op < 60) {  // Generate: run out, cancel midway, or hit a deadline
      v1::GenerateRequest req;
      req.mutable_sampling()->set_max_tokens(1 + rng() % 24);
      req.mutable_sampling()->set_temperature((rng() % 2) ? 0.8f : 0.0f);
      req.mutable_sampling()->set_seed(rng());
      if (rng() % 5 == 0) {
        req.mutable_prompt()->set_text(prefixes[rng() % prefixes.size()]);
        req.set_n(1 + rng() % 4);
      } else {
        std::string tree = shared->pick(rng);
        if (tree.empty()) continue;
        std::string b = rand_branch(tree);
        if (b.empty()) continue;
        req.set_tree_id(tree);
        req.add_branch_ids(b);
        if (rng() % 3 == 0) req.mutable_append()->set_text(" and then");
      }
      if (rng() % 8 == 0) {  // a short beam search instead of sampling
        req.mutable_beam_search()->set_beam_width(1 + rng() % 3);
        if (req.tree_id().empty()) req.set_n(1);
      }
      grpc::ClientContext ctx;
      const int mode = rng() % 6;
      if (mode == 0) {
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(5 + rng() % 50));
      }
      auto reader = stub->Generate(&ctx, req);
      v1::GenerateResponse r;
      int n = 0;
      while (reader->Read(&r)) {
        ++shared->tokens;
        if (mode == 1 && ++n == 3) ctx.TryCancel();
      }
      shared->check(reader->Finish(), "Generate");
    } else if (op < 65) {  // TreeSearch: logprob or client scored; run out, cancel, deadline
      std::string tree = shared->pick(rng);
      if (tree.empty()) continue;
      std::string b = rand_branch(tree);
      if (b.empty()) continue;
      v1::TreeSearchRequest first;
      v1::TreeSearchStart* start = first.mutable_start();
      start->set_tree_id(tree);
      start->set_branch_id(b);
      start->set_expand(1 + rng() % 3);
      start->set_keep(1 + rng() % 2);
      start->set_depth(1 + rng() % 3);
      start->mutable_sampling()->set_max_tokens(1 + rng() % 8);
      start->mutable_sampling()->set_temperature(0.8f);
      start->mutable_sampling()->set_seed(rng());
      const bool by_client = rng() % 2;
      start->set_score_mode(by_client ? v1::SCORE_CLIENT : v1::SCORE_LOGPROB);
      grpc::ClientContext ctx;
      const int mode = rng() % 5;
      if (mode == 0) {
        ctx.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(5 + rng() % 50));
      }
      auto stream = stub->TreeSearch(&ctx);
      stream->Write(first);
      if (!by_client) stream->WritesDone();
      v1::TreeSearchResponse r;
      while (stream->Read(&r)) {
        if (!r.has_level()) continue;
        shared->tokens += r.level().candidates_size();
        if (mode == 1) {
          ctx.TryCancel();
        } else if (by_client) {
          v1::TreeSearchRequest scores;
          for (const auto& c : r.level().candidates()) {
            (*scores.mutable_scores()->mutable_scores())[c.branch_id()] = float(rng() % 100);
          }
          stream->Write(scores);
        }
      }
      if (by_client) stream->WritesDone();
      grpc::Status s = stream->Finish();
      shared->check(s, "TreeSearch");
      if (s.ok()) ++shared->searches_done;
    } else if (op < 75) {  // Prune (sometimes retaining KV)
      std::string tree = shared->pick(rng);
      if (tree.empty()) continue;
      bool root = false;
      std::string b = rand_branch(tree, &root);
      if (b.empty() || root) continue;
      grpc::ClientContext ctx;
      v1::PruneRequest req;
      req.set_tree_id(tree);
      req.add_branch_ids(b);
      req.set_retain_kv(rng() % 2);
      v1::PruneResponse resp;
      shared->check(stub->Prune(&ctx, req, &resp), "Prune");
    } else if (op < 85) {  // Verify a small random token tree
      std::string tree = shared->pick(rng);
      if (tree.empty()) continue;
      std::string b = rand_branch(tree);
      if (b.empty()) continue;
      grpc::ClientContext ctx;
      v1::VerifyRequest req;
      req.set_tree_id(tree);
      req.set_branch_id(b);
      const int t = 1 + rng() % 12;
      for (int i = 0; i < t; ++i) {
        req.add_tokens(3 + rng() % 500);
        req.add_parents(i == 0 ? -1 : static_cast<int32_t>(rng() % (i + 1)) - 1);
      }
      v1::VerifyResponse resp;
      shared->check(stub->Verify(&ctx, req, &resp), "Verify");
    } else if (op < 92) {  // DeleteTree
      std::string tree = shared->pick(rng);
      if (tree.empty()) continue;
      grpc::ClientContext ctx;
      v1::DeleteTreeRequest req;
      req.set_tree_id(tree);
      v1::DeleteTreeResponse resp;
      grpc::Status s = stub->DeleteTree(&ctx, req, &resp);
      shared->check(s, "DeleteTree");
      shared->remove(tree);
    } else {  // GetServerInfo
      grpc::ClientContext ctx;
      v1::ServerInfo info;
      grpc::Status s = stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
      shared->check(s, "GetServerInfo");
      if (s.ok() && info.kv_pages_free() > info.kv_pages_total()) {
        std::lock_guard<std::mutex> l(shared->bad_mu);
        shared->bad.push_back("free pages above total");
      }
    }
  }
}

TEST(Concurrency, ThirtyTwoClientsRandomTreeOperations) {
  int seconds = 60;
  if (const char* env = std::getenv("TREESERVE_SOAK_SECONDS")) seconds = std::atoi(env);
  // 96 pages x 16 tokens: small enough that trees compete for pages.
  ServerProcess server({"--backend", "cpu", "--kv-cache-bytes", std::to_string(96 * 16 * 4096)});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Shared shared;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  std::vector<std::thread> threads;
  for (int i = 0; i < 32; ++i) {
    threads.emplace_back(client_thread, i, server.channel(), &shared, end);
  }
  for (auto& t : threads) t.join();
  for (const std::string& b : shared.bad) ADD_FAILURE() << "undocumented error: " << b;
  EXPECT_GT(shared.ops.load(), 500);
  EXPECT_GT(shared.tokens.load(), 500);
  EXPECT_GT(shared.searches_done.load(), 0);
  std::printf(
      "soak: %lld calls, %lld streamed tokens, %lld documented errors, %lld tree searches "
      "completed in %d s\n",
      static_cast<long long>(shared.ops.load()), static_cast<long long>(shared.tokens.load()),
      static_cast<long long>(shared.errors_ok.load()),
      static_cast<long long>(shared.searches_done.load()), seconds);

  // Delete every tree that is left; the pool must be back to idle.
  auto stub = v1::TreeServe::NewStub(server.channel());
  for (const std::string& t : shared.trees) {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(t);
    v1::DeleteTreeResponse resp;
    grpc::Status s = stub->DeleteTree(&ctx, req, &resp);
    EXPECT_TRUE(s.ok() || s.error_code() == StatusCode::NOT_FOUND) << s.error_message();
  }
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.live_trees(), 0);
  EXPECT_EQ(info.live_branches(), 0);
  EXPECT_EQ(info.kv_pages_free() + info.kv_pages_evictable(), info.kv_pages_total());
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
