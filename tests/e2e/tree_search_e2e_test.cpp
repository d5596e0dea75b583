// End-to-end tests of the TreeSearch stream (tree-of-thought BFS on the server) against the
// real treeserve binary: CPU backend, tiny model, loopback gRPC. Logprob and client scoring,
// stop strings, the error table, cancellation, deadlines while the server waits for scores,
// and pool exhaustion; every test ends with the server idle (nothing leaked).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using std::chrono::milliseconds;

constexpr char kPrompt[] =
    "Q: The old lighthouse keeper counted the ships that sailed past the rocks. How many?\nA:";

struct SearchRun {
  std::vector<v1::TreeSearchLevel> levels;
  std::optional<v1::TreeSearchDone> done;
  grpc::Status status;
};

// What the client answers a level with: a message to send, or nothing (it just waits).
using Scorer = std::function<std::optional<v1::TreeSearchRequest>(const v1::TreeSearchLevel&)>;

v1::TreeSearchRequest scores_by(
    const v1::TreeSearchLevel& level,
    const std::function<float(const v1::TreeSearchCandidate&, int)>& f) {
  v1::TreeSearchRequest req;
  auto* m = req.mutable_scores()->mutable_scores();
  for (int i = 0; i < level.candidates_size(); ++i) {
    (*m)[level.candidates(i).branch_id()] = f(level.candidates(i), i);
  }
  return req;
}

class Client {
 public:
  explicit Client(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::TreeServe::NewStub(std::move(channel))) {}

  // cancel_at_level > 0: the client cancels the call once that level's message has arrived
  // and its reply (if any) is written.
  SearchRun search(const v1::TreeSearchRequest& first, Scorer scorer = nullptr,
                   milliseconds deadline = milliseconds(0), int cancel_at_level = 0) {
    grpc::ClientContext ctx;
    if (deadline.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    SearchRun out;
    auto stream = stub_->TreeSearch(&ctx);
    bool open = stream->Write(first);
    if (open && !scorer) {
      stream->WritesDone();
      open = false;
    }
    v1::TreeSearchResponse r;
    while (stream->Read(&r)) {
      if (r.has_level()) {
        out.levels.push_back(r.level());
        if (open) {
          std::optional<v1::TreeSearchRequest> reply = scorer(r.level());
          if (reply) open = stream->Write(*reply);
        }
        if (r.level().level() == cancel_at_level) ctx.TryCancel();
      } else if (r.has_done()) {
        out.done = r.done();
      }
    }
    if (open) stream->WritesDone();
    out.status = stream->Finish();
    return out;
  }

  v1::CreateTreeResponse create_tree(const std::string& text) {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text(text);
    v1::CreateTreeResponse resp;
    grpc::Status s = stub_->CreateTree(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  v1::TreeInfo get_tree(const std::string& tree) {
    grpc::ClientContext ctx;
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    v1::TreeInfo info;
    grpc::Status s = stub_->GetTree(&ctx, req, &info);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return info;
  }

  std::set<std::string> live(const std::string& tree) {
    std::set<std::string> out;
    const v1::TreeInfo info = get_tree(tree);
    for (const v1::BranchInfo& b : info.branches()) {
      if (b.live()) out.insert(b.branch_id());
    }
    return out;
  }

  // The server prunes a cancelled search's branches just after the client sees the status.
  std::set<std::string> live_settled(const std::string& tree, size_t want) {
    std::set<std::string> now = live(tree);
    for (int i = 0; i < 100 && now.size() != want; ++i) {
      std::this_thread::sleep_for(milliseconds(20));
      now = live(tree);
    }
    return now;
  }

  grpc::Status generate(const std::string& tree, const std::string& branch, int max_tokens) {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_tree_id(tree);
    req.add_branch_ids(branch);
    req.mutable_sampling()->set_max_tokens(max_tokens);
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse r;
    while (reader->Read(&r)) {
    }
    return reader->Finish();
  }

  void delete_tree(const std::string& tree) {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree);
    v1::DeleteTreeResponse resp;
    EXPECT_TRUE(stub_->DeleteTree(&ctx, req, &resp).ok());
  }

  void expect_idle() {
    grpc::ClientContext ctx;
    v1::ServerInfo i;
    ASSERT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &i).ok());
    EXPECT_EQ(i.live_trees(), 0);
    EXPECT_EQ(i.live_branches(), 0);
    EXPECT_EQ(i.kv_pages_free() + i.kv_pages_evictable(), i.kv_pages_total())
        << "free " << i.kv_pages_free() << " evictable " << i.kv_pages_evictable();
  }

 private:
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

v1::TreeSearchRequest start(const std::string& tree, int k, int b, int depth, int max_tokens,
                            v1::TreeSearchScoreMode mode = v1::SCORE_LOGPROB) {
  v1::TreeSearchRequest req;
  v1::TreeSearchStart* s = req.mutable_start();
  s->set_tree_id(tree);
  s->set_expand(k);
  s->set_keep(b);
  s->set_depth(depth);
  s->set_score_mode(mode);
  s->mutable_sampling()->set_temperature(1.0f);
  s->mutable_sampling()->set_seed(3);
  s->mutable_sampling()->set_max_tokens(max_tokens);
  return req;
}

// The ids of the best `b` candidates by score (ties to the earlier one).
std::vector<std::string> best_by_score(const v1::TreeSearchLevel& level, size_t b) {
  std::vector<const v1::TreeSearchCandidate*> order;
  for (const auto& c : level.candidates()) order.push_back(&c);
  std::stable_sort(order.begin(), order.end(),
                   [](auto* x, auto* y) { return x->score() > y->score(); });
  std::vector<std::string> out;
  for (size_t i = 0; i < b && i < order.size(); ++i) out.push_back(order[i]->branch_id());
  return out;
}

// One server for the suite; every test ends with the pool idle.
class TreeSearchApi : public SharedServerTest<Client> {};

TEST_F(TreeSearchApi, LogprobSearchKeepsTheBestPaths) {
  auto tree = client_->create_tree(kPrompt);
  SearchRun run = client_->search(start(tree.tree_id(), 3, 2, 3, 6));
  ASSERT_TRUE(run.status.ok()) << run.status.error_message();
  ASSERT_EQ(run.levels.size(), 3u);
  ASSERT_TRUE(run.done.has_value());
  EXPECT_EQ(run.done->levels(), 3);
  std::map<std::string, v1::TreeSearchCandidate> by_id;
  std::vector<std::string> kept = {tree.root_branch_id()};
  for (const v1::TreeSearchLevel& level : run.levels) {
    ASSERT_EQ(size_t(level.candidates_size()), 3 * kept.size());
    for (const auto& c : level.candidates()) {
      EXPECT_NE(std::find(kept.begin(), kept.end(), c.parent_branch_id()), kept.end())
          << c.branch_id() << " hangs off " << c.parent_branch_id() << ", not a kept node";
      EXPECT_GE(c.tokens(), 1);
      EXPECT_LE(c.tokens(), 6);
      EXPECT_LE(c.score(), 0.0f);
      EXPECT_LE(c.logprob(), 0.0f);
      by_id[c.branch_id()] = c;
    }
    kept = best_by_score(level, 2);
  }
  // The done message lists the last level's best two, best first; each branch holds its
  // path: the root's tokens, then every thought along the way.
  ASSERT_EQ(run.done->leaves_size(), 2);
  EXPECT_EQ(run.done->leaves(0).branch_id(), kept[0]);
  EXPECT_EQ(run.done->leaves(1).branch_id(), kept[1]);
  v1::TreeInfo info = client_->get_tree(tree.tree_id());
  std::map<std::string, int> length;
  for (const auto& b : info.branches()) length[b.branch_id()] = b.length();
  std::set<std::string> expect_live = {tree.root_branch_id()};
  for (const v1::TreeSearchLeaf& leaf : run.done->leaves()) {
    EXPECT_EQ(leaf.score(), by_id[leaf.branch_id()].score());
    EXPECT_EQ(length[leaf.branch_id()], tree.prompt_tokens() + leaf.tokens());
    int path_tokens = 0;
    for (std::string id = leaf.branch_id(); by_id.count(id); id = by_id[id].parent_branch_id()) {
      path_tokens += by_id[id].tokens();
      expect_live.insert(id);
    }
    EXPECT_EQ(leaf.tokens(), path_tokens);
    EXPECT_FALSE(leaf.text().empty());
  }
  EXPECT_EQ(client_->live(tree.tree_id()), expect_live);  // the losers were pruned
  EXPECT_TRUE(client_->generate(tree.tree_id(), run.done->leaves(0).branch_id(), 3).ok());
  client_->delete_tree(tree.tree_id());
}

TEST_F(TreeSearchApi, ClientScoresDecideAndStopStringsEndThoughts) {
  auto tree = client_->create_tree(kPrompt);
  v1::TreeSearchRequest req = start(tree.tree_id(), 3, 1, 3, 12, v1::SCORE_CLIENT);
  req.mutable_start()->mutable_sampling()->add_stop(" ");
  // The client prefers each level's last candidate.
  SearchRun run = client_->search(req, [](const v1::TreeSearchLevel& level) {
    return scores_by(level, [](const v1::TreeSearchCandidate&, int i) { return float(i); });
  });
  ASSERT_TRUE(run.status.ok()) << run.status.error_message();
  ASSERT_EQ(run.levels.size(), 3u);
  for (size_t l = 0; l < run.levels.size(); ++l) {
    const std::string parent =
        l == 0 ? tree.root_branch_id() : run.levels[l - 1].candidates(2).branch_id();
    for (const auto& c : run.levels[l].candidates()) {
      EXPECT_EQ(c.parent_branch_id(), parent);
      EXPECT_EQ(c.text().find(' '), std::string::npos) << "the stop string is cut: " << c.text();
      EXPECT_TRUE(c.finish_reason() == v1::FINISH_STOP || c.finish_reason() == v1::FINISH_LENGTH)
          << c.finish_reason();
    }
  }
  ASSERT_TRUE(run.done.has_value());
  ASSERT_EQ(run.done->leaves_size(), 1);
  EXPECT_EQ(run.done->leaves(0).branch_id(), run.levels[2].candidates(2).branch_id());
  EXPECT_EQ(run.done->leaves(0).score(), 2.0f);
  EXPECT_EQ(run.done->leaves(0).level(), 3);
  EXPECT_EQ(client_->live(tree.tree_id()).size(), 4u);  // root + one kept node per level
  client_->delete_tree(tree.tree_id());
}

TEST_F(TreeSearchApi, ErrorTable) {
  auto tree = client_->create_tree(kPrompt);
  const std::string t = tree.tree_id();
  const std::set<std::string> root = {tree.root_branch_id()};
  auto code = [&](const v1::TreeSearchRequest& first, Scorer scorer = nullptr) {
    SearchRun run = client_->search(first, scorer);
    EXPECT_FALSE(run.done.has_value());
    EXPECT_EQ(client_->live(t), root) << "the tree is as it was";
    return run.status.error_code();
  };
  v1::TreeSearchRequest req = start("t_unknown", 2, 1, 1, 4);
  EXPECT_EQ(code(req), grpc::StatusCode::NOT_FOUND);
  req = start(t, 2, 1, 1, 4);
  req.mutable_start()->set_branch_id("b_unknown");
  EXPECT_EQ(code(req), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(code(start(t, 0, 1, 1, 4)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(start(t, 2, 0, 1, 4)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(start(t, 2, 1, 0, 4)), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(start(t, 17, 16, 1, 4)), grpc::StatusCode::INVALID_ARGUMENT);   // > max_n
  EXPECT_EQ(code(start(t, 2, 1, 3, 2000)), grpc::StatusCode::INVALID_ARGUMENT);  // > max_tokens
  req = start(t, 2, 1, 1, 4);
  req.mutable_start()->mutable_sampling()->set_temperature(-1);
  EXPECT_EQ(code(req), grpc::StatusCode::INVALID_ARGUMENT);
  req = start(t, 2, 1, 1, 4);
  req.mutable_start()->set_score_mode(static_cast<v1::TreeSearchScoreMode>(7));
  EXPECT_EQ(code(req), grpc::StatusCode::INVALID_ARGUMENT);
  v1::TreeSearchRequest only_scores;
  only_scores.mutable_scores();
  EXPECT_EQ(code(only_scores), grpc::StatusCode::INVALID_ARGUMENT);

  // Bad scores at level 2, after level 1 kept a branch: the search ends, everything it made
  // is pruned.
  const v1::TreeSearchRequest client_mode = start(t, 2, 1, 2, 4, v1::SCORE_CLIENT);
  auto at_level_two =
      [](std::function<void(const v1::TreeSearchLevel&, v1::TreeSearchRequest*)> spoil) -> Scorer {
    return [spoil](const v1::TreeSearchLevel& level) {
      v1::TreeSearchRequest r = scores_by(level, [](auto&, int i) { return float(i); });
      if (level.level() == 2) spoil(level, &r);
      return r;
    };
  };
  EXPECT_EQ(code(client_mode, at_level_two([](auto& level, v1::TreeSearchRequest* r) {
                   r->mutable_scores()->mutable_scores()->erase(level.candidates(0).branch_id());
                 })),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(client_mode, at_level_two([](auto&, v1::TreeSearchRequest* r) {
                   (*r->mutable_scores()->mutable_scores())["b_stranger"] = 1;
                 })),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(client_mode, at_level_two([](auto& level, v1::TreeSearchRequest* r) {
                   (*r->mutable_scores()->mutable_scores())[level.candidates(1).branch_id()] =
                       std::numeric_limits<float>::quiet_NaN();
                 })),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(code(client_mode, at_level_two([](auto&, v1::TreeSearchRequest* r) {
                   *r = start("t_other", 1, 1, 1, 1);
                 })),
            grpc::StatusCode::INVALID_ARGUMENT);
  client_->delete_tree(t);
}

TEST_F(TreeSearchApi, CancelAndDeadlinePruneWhatTheSearchMade) {
  auto tree = client_->create_tree(kPrompt);
  const std::string t = tree.tree_id();
  const std::set<std::string> root = {tree.root_branch_id()};
  // Cancelled mid-search: the client scores level 1, keeping a thought that did not end (so
  // level 2 must generate), and cancels at once. The server is then reading those scores or
  // generating level 2, and depth 3 makes it wait for level 2's scores, which never come, so
  // the search cannot complete before it sees the cancel. (A cancel after a fixed delay would
  // not do: on a fast GPU the whole search, whose 1500-token thoughts of the 512-token tiny
  // model mostly end early with EOS, can finish first and rightly keep its leaves.)
  SearchRun cancelled = client_->search(
      start(t, 4, 1, 3, 64, v1::SCORE_CLIENT),
      [](const v1::TreeSearchLevel& level) -> std::optional<v1::TreeSearchRequest> {
        if (level.level() != 1) return std::nullopt;
        return scores_by(level, [](const v1::TreeSearchCandidate& c, int) {
          return c.finish_reason() == v1::FINISH_EOS ? 0.f : 1.f;
        });
      },
      milliseconds(0), /*cancel_at_level=*/1);
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED)
      << cancelled.status.error_message();
  ASSERT_FALSE(cancelled.levels.empty());
  int unfinished = 0;
  for (const v1::TreeSearchCandidate& c : cancelled.levels[0].candidates()) {
    unfinished += c.finish_reason() != v1::FINISH_EOS;
  }
  ASSERT_GT(unfinished, 0) << "every level-1 thought ended with EOS: nothing to cancel";
  EXPECT_FALSE(cancelled.done.has_value());
  EXPECT_EQ(client_->live_settled(t, 1), root);
  // The deadline passes while the server waits for the client's scores of level 2.
  SearchRun late = client_->search(
      start(t, 2, 1, 3, 4, v1::SCORE_CLIENT),
      [](const v1::TreeSearchLevel& level) -> std::optional<v1::TreeSearchRequest> {
        if (level.level() == 2) return std::nullopt;
        return scores_by(level, [](auto&, int) { return 0.0f; });
      },
      milliseconds(1500));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << late.status.error_message();
  EXPECT_EQ(late.levels.size(), 2u);
  EXPECT_EQ(client_->live_settled(t, 1), root);
  // The tree is still usable.
  SearchRun again = client_->search(start(t, 2, 1, 1, 3));
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  client_->delete_tree(t);
}

// A pool of 8 pages x 16 tokens: a search that outgrows it fails RESOURCE_EXHAUSTED and
// leaves the tree as it was.
TEST(TreeSearchSmallPool, ExhaustionPrunesTheSearch) {
  // Tiny model, float32 KV: 4 layers x 2 (K, V) x 2 kv heads x 64 dims x 4 B = 4 KiB/token.
  ServerProcess server({"--backend", "cpu", "--kv-cache-bytes", std::to_string(8 * 16 * 4096)});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  auto tree = c.create_tree(kPrompt);
  SearchRun run = c.search(start(tree.tree_id(), 4, 2, 3, 60));
  EXPECT_EQ(run.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << run.status.error_message();
  EXPECT_EQ(c.live(tree.tree_id()), std::set<std::string>{tree.root_branch_id()});
  SearchRun small = c.search(start(tree.tree_id(), 2, 1, 2, 4));
  EXPECT_TRUE(small.status.ok()) << small.status.error_message();
  c.delete_tree(tree.tree_id());
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

// A client that never sends a level's scores: the server waits
// limits.tree_search_score_timeout_ms, then ends the search DEADLINE_EXCEEDED (naming the
// key) and prunes what it made; the tree is as it was and usable.
TEST(TreeSearchScoreTimeout, WaitsTheConfiguredTimeThenPrunes) {
  const std::string config = treeserve::testing_support::test_temp_dir() + "/score_timeout.json";
  std::ofstream(config) << R"({"limits": {"tree_search_score_timeout_ms": 500}})";
  std::vector<std::string> args = backend_args();
  args.insert(args.end(), {"--config", config});
  ServerProcess server(args);
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  auto tree = c.create_tree(kPrompt);
  const auto begin = std::chrono::steady_clock::now();
  SearchRun run =
      c.search(start(tree.tree_id(), 2, 1, 3, 4, v1::SCORE_CLIENT),
               [](const v1::TreeSearchLevel& level) -> std::optional<v1::TreeSearchRequest> {
                 if (level.level() == 2) return std::nullopt;  // never scores level 2
                 return scores_by(level, [](auto&, int i) { return float(i); });
               });
  const auto waited = std::chrono::steady_clock::now() - begin;
  EXPECT_EQ(run.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << run.status.error_message();
  EXPECT_NE(run.status.error_message().find("limits.tree_search_score_timeout_ms"),
            std::string::npos)
      << run.status.error_message();
  EXPECT_EQ(run.levels.size(), 2u);
  EXPECT_FALSE(run.done.has_value());
  EXPECT_GE(waited, milliseconds(500));
  EXPECT_LT(waited, milliseconds(20000));
  EXPECT_EQ(c.live_settled(tree.tree_id(), 1), std::set<std::string>{tree.root_branch_id()});
  SearchRun again = c.search(start(tree.tree_id(), 2, 1, 1, 3));
  EXPECT_TRUE(again.status.ok()) << again.status.error_message();
  c.delete_tree(tree.tree_id());
  c.expect_idle();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
