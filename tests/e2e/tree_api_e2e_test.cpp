// End-to-end tests of the tree API (CreateTree, Branch, Generate, Prune, Verify, GetTree,
// DeleteTree) against the real treeserve binary: CPU backend, tiny model, loopback gRPC.
// Every test ends by checking that the server is idle again: no live tree or branch, and
// every KV page either free or an evictable cached prefix (nothing leaked).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using std::chrono::milliseconds;

constexpr char kPromptText[] =
    "The old lighthouse keeper climbed the spiral stairs every evening and watched the ships "
    "sail past the rocks.";

struct Streamed {
  std::map<std::string, std::vector<int32_t>> tokens;  // per branch, in order
  std::map<std::string, v1::FinishReason> finish;
  std::map<std::string, std::string> text;
  std::vector<v1::GenerateResponse> all;
  grpc::Status status;
  // A one-branch call's tokens and finish reason (one-shot n = 1: the branch id is random).
  std::vector<int32_t> only_tokens() const {
    EXPECT_EQ(tokens.size(), 1u);
    return tokens.empty() ? std::vector<int32_t>{} : tokens.begin()->second;
  }
  v1::FinishReason only_finish() const {
    EXPECT_EQ(finish.size(), 1u);
    return finish.empty() ? v1::FINISH_NONE : finish.begin()->second;
  }
  // Each branch's tokens, branches in the order the stream first named them (their creation
  // order): comparable between calls, whose branch ids differ.
  std::vector<std::vector<int32_t>> in_order() const {
    std::vector<std::vector<int32_t>> out;
    std::set<std::string> seen;
    for (const v1::GenerateResponse& r : all) {
      if (seen.insert(r.branch_id()).second) out.push_back(tokens.at(r.branch_id()));
    }
    return out;
  }
};

class Client {
 public:
  explicit Client(std::shared_ptr<grpc::Channel> channel)
      : stub_(v1::TreeServe::NewStub(std::move(channel))) {}

  v1::CreateTreeResponse create_tree(const v1::Prompt& prompt, grpc::Status* status = nullptr) {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    *req.mutable_prompt() = prompt;
    v1::CreateTreeResponse resp;
    grpc::Status s = stub_->CreateTree(&ctx, req, &resp);
    if (status) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return resp;
  }
  v1::CreateTreeResponse create_tree(const std::string& text) {
    return create_tree(text_prompt(text));
  }

  std::vector<std::string> branch(const std::string& tree, const std::string& branch, int n,
                                  int at_offset = 0, grpc::Status* status = nullptr) {
    grpc::ClientContext ctx;
    v1::BranchRequest req;
    req.set_tree_id(tree);
    req.set_branch_id(branch);
    req.set_n(n);
    req.set_at_offset(at_offset);
    v1::BranchResponse resp;
    grpc::Status s = stub_->Branch(&ctx, req, &resp);
    if (status) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return {resp.branch_ids().begin(), resp.branch_ids().end()};
  }

  // Runs a Generate to its end. on_event may cancel (return false) after any message.
  Streamed generate(const v1::GenerateRequest& req,
                    std::function<bool(const v1::GenerateResponse&)> on_event = nullptr,
                    milliseconds deadline = milliseconds(0)) {
    grpc::ClientContext ctx;
    if (deadline.count() > 0) ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    Streamed out;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse r;
    bool cancelled = false;
    while (reader->Read(&r)) {
      out.all.push_back(r);
      if (r.token_id() >= 0) out.tokens[r.branch_id()].push_back(r.token_id());
      out.text[r.branch_id()] += r.text();
      if (r.finish_reason() != v1::FINISH_NONE) out.finish[r.branch_id()] = r.finish_reason();
      if (on_event && !cancelled && !on_event(r)) {
        ctx.TryCancel();
        cancelled = true;
      }
    }
    out.status = reader->Finish();
    return out;
  }

  v1::PruneResponse prune(const std::string& tree, std::vector<std::string> ids,
                          bool retain_kv = false, grpc::Status* status = nullptr) {
    grpc::ClientContext ctx;
    v1::PruneRequest req;
    req.set_tree_id(tree);
    for (auto& id : ids) req.add_branch_ids(id);
    req.set_retain_kv(retain_kv);
    v1::PruneResponse resp;
    grpc::Status s = stub_->Prune(&ctx, req, &resp);
    if (status) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return resp;
  }

  grpc::Status verify(const std::string& tree, const std::string& branch,
                      std::vector<int32_t> tokens, std::vector<int32_t> parents,
                      v1::VerifyResponse* resp, float temperature = 0) {
    grpc::ClientContext ctx;
    v1::VerifyRequest req;
    req.set_tree_id(tree);
    req.set_branch_id(branch);
    for (int32_t t : tokens) req.add_tokens(t);
    for (int32_t p : parents) req.add_parents(p);
    req.mutable_sampling()->set_temperature(temperature);
    return stub_->Verify(&ctx, req, resp);
  }

  v1::TreeInfo get_tree(const std::string& tree, grpc::Status* status = nullptr) {
    grpc::ClientContext ctx;
    v1::GetTreeRequest req;
    req.set_tree_id(tree);
    v1::TreeInfo info;
    grpc::Status s = stub_->GetTree(&ctx, req, &info);
    if (status) {
      *status = s;
    } else {
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    return info;
  }

  grpc::Status delete_tree(const std::string& tree, int64_t* freed = nullptr) {
    grpc::ClientContext ctx;
    v1::DeleteTreeRequest req;
    req.set_tree_id(tree);
    v1::DeleteTreeResponse resp;
    grpc::Status s = stub_->DeleteTree(&ctx, req, &resp);
    if (freed) *freed = resp.freed_tokens();
    return s;
  }

  std::vector<int32_t> tokenize(const std::string& text) {
    grpc::ClientContext ctx;
    v1::TokenizeRequest req;
    req.set_text(text);
    v1::TokenizeResponse resp;
    EXPECT_TRUE(stub_->Tokenize(&ctx, req, &resp).ok());
    return {resp.ids().begin(), resp.ids().end()};
  }

  v1::ServerInfo info() {
    grpc::ClientContext ctx;
    v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
    return info;
  }

  // No live tree or branch and no page held by anything but evictable cache.
  void expect_idle() {
    v1::ServerInfo i = info();
    EXPECT_EQ(i.live_trees(), 0);
    EXPECT_EQ(i.live_branches(), 0);
    EXPECT_EQ(i.kv_pages_free() + i.kv_pages_evictable(), i.kv_pages_total())
        << "free " << i.kv_pages_free() << " evictable " << i.kv_pages_evictable();
  }

  static v1::Prompt text_prompt(const std::string& text) {
    v1::Prompt p;
    p.set_text(text);
    return p;
  }
  static v1::Prompt token_prompt(const std::vector<int32_t>& ids) {
    v1::Prompt p;
    for (int32_t id : ids) p.mutable_tokens()->add_ids(id);
    return p;
  }

 private:
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

v1::GenerateRequest on_branches(const std::string& tree, std::vector<std::string> ids,
                                int max_tokens, float temperature = 0, uint64_t seed = 0) {
  v1::GenerateRequest req;
  req.set_tree_id(tree);
  for (auto& id : ids) req.add_branch_ids(id);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(temperature);
  req.mutable_sampling()->set_seed(seed);
  return req;
}

v1::GenerateRequest one_shot(const v1::Prompt& prompt, int n, int max_tokens, float temperature = 0,
                             uint64_t seed = 0) {
  v1::GenerateRequest req;
  *req.mutable_prompt() = prompt;
  req.set_n(n);
  req.mutable_sampling()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(temperature);
  req.mutable_sampling()->set_seed(seed);
  return req;
}

// One server for the suite; every test ends with the pool idle.
class TreeApi : public SharedServerTest<Client> {};

TEST_F(TreeApi, CreateTreeReusesTheRadixCacheAcrossTrees) {
  auto first = client_->create_tree(kPromptText);
  EXPECT_FALSE(first.tree_id().empty());
  EXPECT_EQ(first.root_branch_id().substr(0, 2), "b_");
  EXPECT_EQ(first.tree_id().substr(0, 2), "t_");
  EXPECT_GT(first.prompt_tokens(), 16);
  EXPECT_EQ(first.cached_tokens(), 0);
  auto second = client_->create_tree(kPromptText);
  EXPECT_NE(second.tree_id(), first.tree_id());
  EXPECT_EQ(second.prompt_tokens(), first.prompt_tokens());
  // A live tree's prompt is shared at once: everything but the last two tokens is reused
  // (the last token's KV is computed by the first Generate step, with its logits; the one
  // before is recomputed so that the prefill has a query row).
  EXPECT_EQ(second.cached_tokens(), first.prompt_tokens() - 2);
  EXPECT_TRUE(client_->delete_tree(first.tree_id()).ok());
  EXPECT_TRUE(client_->delete_tree(second.tree_id()).ok());
  // A deleted tree's KV stays as evictable cache and serves the next tree.
  auto third = client_->create_tree(kPromptText);
  EXPECT_EQ(third.cached_tokens(), first.prompt_tokens() - 2);
  EXPECT_TRUE(client_->delete_tree(third.tree_id()).ok());
}

// The central property: branches decoding together over shared KV produce exactly the
// tokens each full sequence produces alone.
TEST_F(TreeApi, ForkedBranchesDecodeExactlyLikeIndependentSequences) {
  std::vector<int32_t> prompt = client_->tokenize(kPromptText);
  prompt.insert(prompt.begin(), 1);  // BOS, as a text prompt gets
  auto tree = client_->create_tree(Client::token_prompt(prompt));
  auto ids = client_->branch(tree.tree_id(), tree.root_branch_id(), 3);
  ASSERT_EQ(ids.size(), 3u);
  const std::vector<std::string> suffixes = {" Then", " The sea was calm", " 42"};
  std::map<std::string, std::vector<int32_t>> full;
  for (size_t i = 0; i < ids.size(); ++i) {
    // Append a different suffix to each branch (one Generate per branch, max 1 token), then
    // decode all three together.
    auto req = on_branches(tree.tree_id(), {ids[i]}, 1);
    *req.mutable_append() = Client::text_prompt(suffixes[i]);
    Streamed s = client_->generate(req);
    ASSERT_TRUE(s.status.ok()) << s.status.error_message();
    std::vector<int32_t> seq = prompt;
    for (int32_t t : client_->tokenize(suffixes[i])) seq.push_back(t);
    seq.push_back(s.tokens[ids[i]].at(0));
    full[ids[i]] = seq;
  }
  Streamed together = client_->generate(on_branches(tree.tree_id(), ids, 8));
  ASSERT_TRUE(together.status.ok()) << together.status.error_message();
  for (const std::string& id : ids) {
    ASSERT_EQ(together.tokens[id].size(), 8u) << id;
    EXPECT_EQ(together.finish[id], v1::FINISH_LENGTH);
    // The same sequence alone, as a one-shot request (greedy).
    Streamed alone = client_->generate(one_shot(Client::token_prompt(full[id]), 1, 8));
    ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
    EXPECT_EQ(alone.only_tokens(), together.tokens[id]) << "branch " << id;
  }
  auto info = client_->get_tree(tree.tree_id());
  EXPECT_EQ(info.branches_size(), 4);
  for (const auto& b : info.branches()) {
    if (b.branch_id() == tree.root_branch_id()) continue;
    EXPECT_EQ(b.parent_branch_id(), tree.root_branch_id());
    EXPECT_TRUE(b.live());
  }
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, OneShotGenerateWithNBranchesIsSeeded) {
  auto run = [&](uint64_t seed) {
    Streamed s = client_->generate(one_shot(Client::text_prompt(kPromptText), 4, 6, 1.0f, seed));
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    return s;
  };
  Streamed a = run(7), b = run(7), c = run(8);
  ASSERT_EQ(a.tokens.size(), 4u);
  for (auto& [id, toks] : a.tokens) {
    EXPECT_EQ(toks.size(), 6u) << id;
    EXPECT_EQ(a.finish[id], v1::FINISH_LENGTH) << id;
  }
  EXPECT_EQ(a.in_order(), b.in_order());  // same seed, same tree: same tokens
  EXPECT_NE(a.in_order(), c.in_order());
  // Branches of one request draw independently.
  std::set<std::vector<int32_t>> distinct;
  for (auto& [id, toks] : a.tokens) distinct.insert(toks);
  EXPECT_GT(distinct.size(), 1u);
}

TEST_F(TreeApi, StopConditionsAndLogprobs) {
  // Greedy: the first token is known, so stopping on it ends after one token.
  Streamed probe = client_->generate(one_shot(Client::text_prompt(kPromptText), 1, 3));
  ASSERT_EQ(probe.only_tokens().size(), 3u);
  auto req = one_shot(Client::text_prompt(kPromptText), 1, 50);
  req.mutable_sampling()->add_stop_token_ids(probe.only_tokens()[1]);
  Streamed stopped = client_->generate(req);
  ASSERT_TRUE(stopped.status.ok());
  EXPECT_EQ(stopped.only_tokens().size(), 2u);
  EXPECT_EQ(stopped.only_finish(), v1::FINISH_STOP);

  auto lp = one_shot(Client::text_prompt(kPromptText), 1, 4);
  lp.mutable_sampling()->set_logprobs(3);
  Streamed with_lp = client_->generate(lp);
  ASSERT_TRUE(with_lp.status.ok());
  for (const auto& r : with_lp.all) {
    if (r.token_id() < 0) continue;
    ASSERT_EQ(r.top_logprobs_size(), 3);
    EXPECT_LE(r.logprob(), 0.0f);
    EXPECT_GE(r.top_logprobs(0).logprob(), r.top_logprobs(1).logprob());
    EXPECT_GE(r.top_logprobs(1).logprob(), r.top_logprobs(2).logprob());
    // Greedy: the sampled token is the most likely one.
    EXPECT_EQ(r.top_logprobs(0).token_id(), r.token_id());
    EXPECT_FLOAT_EQ(r.top_logprobs(0).logprob(), r.logprob());
  }
}

TEST_F(TreeApi, GenerationStopsAtTheModelContext) {
  std::vector<int32_t> prompt(2040);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + int32_t(i * 29 % 500);
  Streamed s = client_->generate(one_shot(Client::token_prompt(prompt), 1, 50));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.only_finish(), v1::FINISH_LENGTH);
  EXPECT_EQ(s.only_tokens().size(), 8u);  // 2040 + 8 = 2048 positions
}

TEST_F(TreeApi, PruneMidStreamStopsOnlyThatBranch) {
  auto tree = client_->create_tree(kPromptText);
  auto ids = client_->branch(tree.tree_id(), tree.root_branch_id(), 2);
  int seen_a = 0;
  bool pruned = false;
  Streamed s =
      client_->generate(on_branches(tree.tree_id(), ids, 60), [&](const v1::GenerateResponse& r) {
        if (r.branch_id() == ids[0] && ++seen_a == 2 && !pruned) {
          pruned = true;
          Client other(server_->channel());
          auto p = other.prune(tree.tree_id(), {ids[0]});
          EXPECT_EQ(p.pruned_branches(), 1);
        }
        return true;
      });
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.finish[ids[0]], v1::FINISH_PRUNED);
  EXPECT_LT(s.tokens[ids[0]].size(), 60u);
  EXPECT_EQ(s.finish[ids[1]], v1::FINISH_LENGTH);
  EXPECT_EQ(s.tokens[ids[1]].size(), 60u);
  auto info = client_->get_tree(tree.tree_id());
  // The pruned branch has left the tree; the others are listed, live.
  EXPECT_EQ(info.branches_size(), 2);
  for (const auto& b : info.branches()) {
    EXPECT_NE(b.branch_id(), ids[0]);
    EXPECT_TRUE(b.live()) << b.branch_id();
  }
  // Its id is unknown now; the other branch continues.
  grpc::Status st;
  Streamed again = client_->generate(on_branches(tree.tree_id(), {ids[0]}, 2));
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, PruneTakesDescendantsAndFreesPrivatePages) {
  auto tree = client_->create_tree(kPromptText);
  auto kids = client_->branch(tree.tree_id(), tree.root_branch_id(), 2);
  ASSERT_TRUE(client_->generate(on_branches(tree.tree_id(), kids, 40)).status.ok());
  auto grandkids = client_->branch(tree.tree_id(), kids[0], 2);
  ASSERT_TRUE(client_->generate(on_branches(tree.tree_id(), grandkids, 40)).status.ok());
  const int64_t free_before = client_->info().kv_pages_free();
  auto p = client_->prune(tree.tree_id(), {kids[0]});
  EXPECT_EQ(p.pruned_branches(), 3);  // kids[0] and both grandchildren
  EXPECT_GT(p.freed_tokens(), 80);
  EXPECT_GT(client_->info().kv_pages_free(), free_before);
  auto info = client_->get_tree(tree.tree_id());
  int live = 0;
  for (const auto& b : info.branches()) live += b.live();
  EXPECT_EQ(live, 2);  // the root and kids[1]
  EXPECT_EQ(info.branches_size(), 2) << "pruned branches leave the tree";
  grpc::Status st;
  client_->branch(tree.tree_id(), kids[0], 1, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

// A Generate the server stops (its client cancelled, or its deadline passed) loses no work:
// the branches stay live with every token they got, and once the server has noticed (within
// a step) they decode on where they stopped.
void expect_stopped_and_usable(Client& c, const v1::CreateTreeResponse& tree,
                               const std::vector<std::string>& ids, const Streamed& seen) {
  grpc::Status last;
  Streamed next;
  for (int i = 0; i < 300; ++i) {
    next = c.generate(on_branches(tree.tree_id(), ids, 2));
    last = next.status;
    // FAILED_PRECONDITION (busy) until the server has stopped the call.
    if (last.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_TRUE(last.ok()) << last.error_message();
  auto info = c.get_tree(tree.tree_id());
  std::map<std::string, v1::BranchInfo> by_id;
  for (const auto& b : info.branches()) by_id[b.branch_id()] = b;
  for (const std::string& id : ids) {
    ASSERT_TRUE(by_id.count(id)) << id << " is gone";
    EXPECT_TRUE(by_id[id].live());
    EXPECT_EQ(next.tokens[id].size(), 2u) << id;
    // Its tokens: the prompt, at least what the client saw, the 2 just generated; the
    // context (2048) was never reached.
    const auto got = seen.tokens.count(id) ? seen.tokens.at(id).size() : 0;
    EXPECT_GE(by_id[id].length(), tree.prompt_tokens() + int32_t(got) + 2) << id;
    EXPECT_LT(by_id[id].length(), 2047) << id;
  }
}

TEST_F(TreeApi, CancelledGenerateKeepsItsBranchesAndTokens) {
  auto tree = client_->create_tree(kPromptText);
  auto ids = client_->branch(tree.tree_id(), tree.root_branch_id(), 2);
  int events = 0;
  Streamed s = client_->generate(on_branches(tree.tree_id(), ids, 4000),
                                 [&](const v1::GenerateResponse&) { return ++events < 4; });
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED);
  expect_stopped_and_usable(*client_, tree, ids, s);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, DeadlineKeepsTheBranchesAndTheirTokens) {
  auto tree = client_->create_tree(kPromptText);
  // Up to the end of the tiny model's 2048-position context; the deadline must come first on
  // any backend (the CUDA one with graphs decodes the whole context in ~0.2 s, so the deadline
  // is short; the branch must stop early whether it ran a few steps or none).
  const std::vector<std::string> root = {tree.root_branch_id()};
  Streamed s =
      client_->generate(on_branches(tree.tree_id(), root, 4000), nullptr, milliseconds(40));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  expect_stopped_and_usable(*client_, tree, root, s);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, BranchAtOffsetRewinds) {
  auto tree = client_->create_tree(kPromptText);
  const std::string root = tree.root_branch_id();
  ASSERT_TRUE(client_->generate(on_branches(tree.tree_id(), {root}, 10)).status.ok());
  const int32_t len = client_->get_tree(tree.tree_id()).branches(0).length();
  EXPECT_EQ(len, tree.prompt_tokens() + 10);
  // Rewinding to the prompt and decoding greedily again repeats the same 10 tokens.
  auto ids = client_->branch(tree.tree_id(), root, 1, tree.prompt_tokens());
  auto info = client_->get_tree(tree.tree_id());
  EXPECT_EQ(info.branches(1).length(), tree.prompt_tokens());
  EXPECT_EQ(info.total_tokens(), len);  // the rewound branch shares everything it has
  Streamed a = client_->generate(on_branches(tree.tree_id(), ids, 10));
  ASSERT_TRUE(a.status.ok());
  Streamed ref = client_->generate(one_shot(Client::text_prompt(kPromptText), 1, 10));
  EXPECT_EQ(a.tokens[ids[0]], ref.only_tokens());
  grpc::Status st;
  client_->branch(tree.tree_id(), root, 1, len + 1, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, VerifyAcceptsTheGreedyPathAndAppendsIt) {
  auto tree = client_->create_tree(kPromptText);
  // What greedy decoding would produce next, from a copy of the branch.
  const std::string root = tree.root_branch_id();
  auto probe = client_->branch(tree.tree_id(), root, 1);
  Streamed g = client_->generate(on_branches(tree.tree_id(), probe, 5));
  const std::vector<int32_t> greedy = g.tokens[probe[0]];
  ASSERT_EQ(greedy.size(), 5u);
  const int32_t wrong = (greedy[0] + 1) % 512;
  // Token tree: two roots (right and wrong), the right chain continues two levels with a
  // wrong sibling on the way.
  //   0: greedy[0] (root)  1: wrong (root)  2: greedy[1] (under 0)
  //   3: wrong' (under 0)  4: greedy[2] (under 2)
  const int32_t wrong2 = (greedy[1] + 7) % 512;
  v1::VerifyResponse r;
  grpc::Status s =
      client_->verify(tree.tree_id(), root, {greedy[0], wrong, greedy[1], wrong2, greedy[2]},
                      {-1, -1, 0, 0, 2}, &r);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(std::vector<int32_t>(r.accepted_tokens().begin(), r.accepted_tokens().end()),
            std::vector<int32_t>(greedy.begin(), greedy.begin() + 3));
  EXPECT_EQ(r.bonus_token(), greedy[3]);
  auto info = client_->get_tree(tree.tree_id());
  EXPECT_EQ(info.branches(0).length(), tree.prompt_tokens() + 4);
  // Decoding on after the accepted path continues the greedy sequence.
  Streamed after = client_->generate(on_branches(tree.tree_id(), {root}, 1));
  EXPECT_EQ(after.tokens[root].at(0), greedy[4]);
  // A tree with no right token accepts nothing and returns the model's token as bonus.
  v1::VerifyResponse none;
  ASSERT_TRUE(client_->verify(tree.tree_id(), root, {wrong}, {-1}, &none).ok());
  EXPECT_EQ(none.accepted_tokens_size(), 0);
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
}

TEST_F(TreeApi, BeamSearchStreamsTheBestBeams) {
  auto req = one_shot(Client::text_prompt(kPromptText), 1, 5);
  req.mutable_beam_search()->set_beam_width(3);
  Streamed s = client_->generate(req);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  ASSERT_EQ(s.tokens.size(), 3u);
  float previous = 1e30f;
  for (const auto& r : s.all) {
    if (r.finish_reason() == v1::FINISH_NONE) continue;
    EXPECT_LE(r.score(), previous);
    previous = r.score();
  }
  // width 1 is greedy
  auto one = one_shot(Client::text_prompt(kPromptText), 1, 5);
  one.mutable_beam_search()->set_beam_width(1);
  Streamed b1 = client_->generate(one);
  Streamed greedy = client_->generate(one_shot(Client::text_prompt(kPromptText), 1, 5));
  ASSERT_EQ(b1.tokens.size(), 1u);
  EXPECT_EQ(b1.tokens.begin()->second, greedy.only_tokens());
  auto bad = one_shot(Client::text_prompt(kPromptText), 2, 5);
  bad.mutable_beam_search()->set_beam_width(2);
  EXPECT_EQ(client_->generate(bad).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  bad = one_shot(Client::text_prompt(kPromptText), 1, 5);
  bad.mutable_beam_search()->set_beam_width(-1);
  EXPECT_EQ(client_->generate(bad).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(TreeApi, ErrorTable) {
  auto tree = client_->create_tree(kPromptText);
  const std::string root = tree.root_branch_id();
  grpc::Status st;
  // NOT_FOUND: unknown tree / branch, on every method that takes them.
  client_->branch("nope", root, 1, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  client_->branch(tree.tree_id(), "b_unknown", 1, 0, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client_->generate(on_branches("nope", {root}, 1)).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client_->generate(on_branches(tree.tree_id(), {"b7"}, 1)).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  client_->prune("nope", {root}, false, &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  v1::VerifyResponse vr;
  EXPECT_EQ(client_->verify("nope", root, {1}, {-1}, &vr).error_code(),
            grpc::StatusCode::NOT_FOUND);
  client_->get_tree("nope", &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client_->delete_tree("nope").error_code(), grpc::StatusCode::NOT_FOUND);

  // INVALID_ARGUMENT, naming the field.
  auto expect_invalid = [](const grpc::Status& s, const std::string& field) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field;
    EXPECT_NE(s.error_message().find(field), std::string::npos) << s.error_message();
  };
  client_->create_tree(Client::text_prompt(""), &st);
  expect_invalid(st, "prompt");
  client_->create_tree(Client::token_prompt({1, 512}), &st);
  expect_invalid(st, "prompt.tokens.ids[1]");
  client_->create_tree(Client::token_prompt(std::vector<int32_t>(9000, 5)), &st);
  expect_invalid(st, "prompt");
  // The tiny model's context is 2048 positions.
  client_->create_tree(Client::token_prompt(std::vector<int32_t>(2048, 5)), &st);
  expect_invalid(st, "prompt");
  EXPECT_NE(st.error_message().find("context"), std::string::npos) << st.error_message();
  client_->branch(tree.tree_id(), root, 0, 0, &st);
  expect_invalid(st, "n");
  client_->branch(tree.tree_id(), root, 100000, 0, &st);
  expect_invalid(st, "n");
  auto bad = on_branches(tree.tree_id(), {root}, 1);
  bad.mutable_sampling()->set_temperature(-1);
  expect_invalid(client_->generate(bad).status, "temperature");
  bad.mutable_sampling()->set_temperature(std::nanf(""));
  expect_invalid(client_->generate(bad).status, "temperature");
  bad = on_branches(tree.tree_id(), {root}, 1);
  bad.mutable_sampling()->set_top_p(1.5f);
  expect_invalid(client_->generate(bad).status, "top_p");
  bad = on_branches(tree.tree_id(), {root}, 1);
  bad.mutable_sampling()->set_top_k(-3);
  expect_invalid(client_->generate(bad).status, "top_k");
  bad = on_branches(tree.tree_id(), {root}, 1);
  bad.mutable_sampling()->set_logprobs(21);
  expect_invalid(client_->generate(bad).status, "logprobs");
  bad = on_branches(tree.tree_id(), {root}, -2);
  expect_invalid(client_->generate(bad).status, "max_tokens");
  bad = on_branches(tree.tree_id(), {root}, 1);
  bad.mutable_sampling()->add_stop("");
  expect_invalid(client_->generate(bad).status, "stop[0]");
  bad = on_branches(tree.tree_id(), {root, root}, 1);
  expect_invalid(client_->generate(bad).status, "branch_ids");
  expect_invalid(client_->generate(one_shot(Client::text_prompt(""), 1, 1)).status, "prompt");
  expect_invalid(client_->generate(one_shot(Client::text_prompt("x"), -1, 1)).status, "n");
  expect_invalid(client_->verify(tree.tree_id(), root, {1, 2}, {-1, 1}, &vr), "parents[1]");
  expect_invalid(client_->verify(tree.tree_id(), root, {1, 2}, {-1}, &vr), "parents");
  expect_invalid(client_->verify(tree.tree_id(), root, {}, {}, &vr), "tokens");
  expect_invalid(client_->verify(tree.tree_id(), root, {600}, {-1}, &vr), "tokens[0]");

  // NOT_FOUND: pruned branches (they leave the tree).
  auto kid = client_->branch(tree.tree_id(), root, 1);
  client_->prune(tree.tree_id(), kid);
  EXPECT_EQ(client_->generate(on_branches(tree.tree_id(), kid, 1)).status.error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client_->verify(tree.tree_id(), kid[0], {1}, {-1}, &vr).error_code(),
            grpc::StatusCode::NOT_FOUND);
  // Nothing above harmed the tree: it still decodes.
  Streamed ok = client_->generate(on_branches(tree.tree_id(), {root}, 2));
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_TRUE(client_->delete_tree(tree.tree_id()).ok());
  EXPECT_EQ(client_->delete_tree(tree.tree_id()).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A server with a KV pool of 8 pages x 16 tokens: requests that can never fit are refused
// at once, a request that does not fit now waits for running work and then completes.
TEST(TreeApiSmallPool, ExhaustionRefusesOrQueues) {
  // Tiny model, float32 KV: 4 layers x 2 (K, V) x 2 kv heads x 64 dims x 4 B = 4 KiB/token.
  ServerProcess server({"--backend", "cpu", "--kv-cache-bytes", std::to_string(8 * 16 * 4096)});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  Client c(server.channel());
  ASSERT_EQ(c.info().kv_pages_total(), 8);
  grpc::Status st;
  c.create_tree(Client::token_prompt(std::vector<int32_t>(200, 7)), &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();

  // A one-shot request grows to 8 pages (90 prompt + 30 generated tokens); a tree of 40
  // tokens (3 pages) arriving meanwhile waits, and completes once the one-shot ends.
  std::vector<int32_t> prompt(90);
  for (int i = 0; i < 90; ++i) prompt[i] = 3 + (i * 37) % 500;
  std::thread creator;
  grpc::Status queued_status;
  v1::CreateTreeResponse queued;
  Streamed s =
      c.generate(one_shot(Client::token_prompt(prompt), 1, 30), [&](const v1::GenerateResponse&) {
        if (!creator.joinable()) {
          creator = std::thread([&] {
            Client other(server.channel());
            queued = other.create_tree(Client::token_prompt(std::vector<int32_t>(40, 9)),
                                       &queued_status);
          });
        }
        return true;
      });
  creator.join();
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  EXPECT_EQ(s.only_tokens().size(), 30u);
  EXPECT_TRUE(queued_status.ok()) << queued_status.error_message();
  EXPECT_EQ(queued.prompt_tokens(), 40);
  // With that tree holding 3 pages, another 6-page request cannot run (nothing running will
  // free pages): refused, and the existing tree is unharmed.
  c.create_tree(Client::token_prompt(std::vector<int32_t>(96, 11)), &st);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  Streamed more = c.generate(on_branches(queued.tree_id(), {queued.root_branch_id()}, 5));
  EXPECT_TRUE(more.status.ok()) << more.status.error_message();
  EXPECT_TRUE(c.delete_tree(queued.tree_id()).ok());
  c.expect_idle();
  fprintf(stderr, "T before terminate\n");
  EXPECT_EQ(server.terminate(), 0) << server.output();
  fprintf(stderr, "%s", server.output().c_str());
}

}  // namespace
}  // namespace treeserve::testing
