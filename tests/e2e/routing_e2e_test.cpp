// End-to-end: replicas told apart by --replica-id (docs/api.md, "Routing across replicas"), two
// real servers on loopback with no proxy between them, so that a call can be sent to the wrong
// one on purpose. A tree made on A and named on B is FAILED_PRECONDITION naming A and the
// tree's route (every tree method, gRPC and HTTP), counted in B's
// treeserve:misrouted_calls_total; an id from before a restart is NOT_FOUND naming the
// restart; every response, errors included, names its replica in x-treeserve-replica; the
// x-treeserve-route header is checked, and a tree id's route is the header's or the prompt's
// routing key; GetServerInfo and /v1/server name the replica; a bad --replica-id stops start-up.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/route_key.h"
#include "proto/treeserve.grpc.pb.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using json = nlohmann::json;

constexpr const char* kPrompt = "Once upon a time, in a quiet village, there lived";

std::vector<std::string> with(std::vector<std::string> args, std::vector<std::string> more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

std::string port_address(int port) { return "127.0.0.1:" + std::to_string(port); }

// One replica: its server, stub, and HTTP and metrics ports.
struct Replica {
  Replica(const std::string& id)
      : http_port(pick_free_port()),
        metrics_port(pick_free_port()),
        server(with(backend_args(), {"--replica-id", id, "--http-listen", port_address(http_port),
                                     "--metrics-listen", port_address(metrics_port)})) {}
  bool start() {
    if (!server.wait_ready()) return false;
    stub = v1::TreeServe::NewStub(server.channel());
    return true;
  }
  httplib::Client http() const {
    httplib::Client c("127.0.0.1", http_port);
    c.set_read_timeout(60, 0);
    return c;
  }
  double metric(const std::string& name) const {
    httplib::Client c("127.0.0.1", metrics_port);
    auto res = c.Get("/metrics");
    if (!res || res->status != 200) return -1;
    const std::string key = "\n" + name + " ";
    const size_t at = res->body.find(key);
    return at == std::string::npos ? -1 : std::stod(res->body.substr(at + key.size()));
  }
  int http_port, metrics_port;
  ServerProcess server;
  std::unique_ptr<v1::TreeServe::Stub> stub;
};

// A client context with a deadline and, when given, the routing header.
std::unique_ptr<grpc::ClientContext> context(const std::string& route = "") {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  if (!route.empty()) ctx->AddMetadata(kRouteHeader, route);
  return ctx;
}

// The x-treeserve-replica a finished call's server sent ("" when none).
std::string replica_of(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerInitialMetadata();
  auto it = md.find(kReplicaHeader);
  return it == md.end() ? "" : std::string(it->second.data(), it->second.size());
}

v1::CreateTreeResponse create(Replica& r, const std::string& route, v1::Prompt prompt = {}) {
  if (!prompt.has_tokens() && !prompt.has_messages() && prompt.text().empty()) {
    prompt.set_text(kPrompt);
  }
  v1::CreateTreeRequest req;
  *req.mutable_prompt() = prompt;
  v1::CreateTreeResponse out;
  auto ctx = context(route);
  const grpc::Status s = r.stub->CreateTree(ctx.get(), req, &out);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return out;
}

void remove(Replica& r, const std::string& tree_id) {
  v1::DeleteTreeRequest req;
  req.set_tree_id(tree_id);
  v1::DeleteTreeResponse out;
  auto ctx = context();
  EXPECT_TRUE(r.stub->DeleteTree(ctx.get(), req, &out).ok());
}

std::string misroute_message(const std::string& tree_id, const std::string& route) {
  return "tree " + tree_id +
         " lives on replica 'r-a', not on this replica 'r-b': send its calls with the header "
         "x-treeserve-route: " +
         route + " so the proxy routes them to 'r-a' (if 'r-a' has stopped, its trees are gone)";
}

class RoutingE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    a_ = new Replica("r-a");
    b_ = new Replica("r-b");
    ASSERT_TRUE(a_->start()) << a_->server.output();
    ASSERT_TRUE(b_->start()) << b_->server.output();
  }
  static void TearDownTestSuite() {
    for (Replica* r : {a_, b_}) {
      EXPECT_EQ(r->server.terminate(), 0) << r->server.output();
      delete r;
    }
  }
  static inline Replica* a_ = nullptr;
  static inline Replica* b_ = nullptr;
};

// A tree of A named on B: every tree method is FAILED_PRECONDITION with the message naming A,
// B and the route, the call is counted, and the tree on A is untouched.
TEST_F(RoutingE2E, TreeOfAnotherReplicaNamesIt) {
  const v1::CreateTreeResponse tree = create(*a_, "user.7");
  const std::string& id = tree.tree_id();
  const std::string want = misroute_message(id, "user.7");
  const double before = b_->metric("treeserve:misrouted_calls_total");
  ASSERT_GE(before, 0);
  std::vector<std::pair<std::string, grpc::Status>> calls;
  auto call = [&](const std::string& name, auto&& fn) {
    auto ctx = context("user.7");
    calls.emplace_back(name, fn(ctx.get()));
    EXPECT_EQ(replica_of(*ctx), "r-b") << name;
  };
  call("Branch", [&](grpc::ClientContext* c) {
    v1::BranchRequest r;
    r.set_tree_id(id);
    r.set_branch_id(tree.root_branch_id());
    r.set_n(1);
    v1::BranchResponse out;
    return b_->stub->Branch(c, r, &out);
  });
  call("Generate", [&](grpc::ClientContext* c) {
    v1::GenerateRequest r;
    r.set_tree_id(id);
    r.add_branch_ids(tree.root_branch_id());
    auto reader = b_->stub->Generate(c, r);
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
    }
    return reader->Finish();
  });
  call("Prune", [&](grpc::ClientContext* c) {
    v1::PruneRequest r;
    r.set_tree_id(id);
    r.add_branch_ids(tree.root_branch_id());
    v1::PruneResponse out;
    return b_->stub->Prune(c, r, &out);
  });
  call("Verify", [&](grpc::ClientContext* c) {
    v1::VerifyRequest r;
    r.set_tree_id(id);
    r.set_branch_id(tree.root_branch_id());
    r.add_tokens(5);
    r.add_parents(-1);
    v1::VerifyResponse out;
    return b_->stub->Verify(c, r, &out);
  });
  call("GetTree", [&](grpc::ClientContext* c) {
    v1::GetTreeRequest r;
    r.set_tree_id(id);
    v1::TreeInfo out;
    return b_->stub->GetTree(c, r, &out);
  });
  call("DeleteTree", [&](grpc::ClientContext* c) {
    v1::DeleteTreeRequest r;
    r.set_tree_id(id);
    v1::DeleteTreeResponse out;
    return b_->stub->DeleteTree(c, r, &out);
  });
  call("TreeSearch", [&](grpc::ClientContext* c) {
    auto stream = b_->stub->TreeSearch(c);
    v1::TreeSearchRequest r;
    r.mutable_start()->set_tree_id(id);
    r.mutable_start()->set_expand(2);
    r.mutable_start()->set_keep(1);
    r.mutable_start()->set_depth(1);
    stream->Write(r);
    stream->WritesDone();
    v1::TreeSearchResponse m;
    while (stream->Read(&m)) {
    }
    return stream->Finish();
  });
  for (const auto& [name, status] : calls) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << name;
    EXPECT_EQ(status.error_message(), want) << name;
  }
  EXPECT_EQ(b_->metric("treeserve:misrouted_calls_total"), before + double(calls.size()));
  EXPECT_EQ(a_->metric("treeserve:misrouted_calls_total"), 0);

  // A still has the tree, whole.
  v1::GetTreeRequest get;
  get.set_tree_id(id);
  v1::TreeInfo info;
  auto ctx = context("user.7");
  ASSERT_TRUE(a_->stub->GetTree(ctx.get(), get, &info).ok());
  EXPECT_EQ(info.live_branches(), 1);
  EXPECT_EQ(replica_of(*ctx), "r-a");
  remove(*a_, id);
}

// Responses name the replica, successes and errors alike, unary and streaming; GetServerInfo
// says which replica it is.
TEST_F(RoutingE2E, EveryResponseNamesItsReplica) {
  auto ctx = context();
  v1::ServerInfo info;
  ASSERT_TRUE(a_->stub->GetServerInfo(ctx.get(), {}, &info).ok());
  EXPECT_EQ(info.replica_id(), "r-a");
  EXPECT_EQ(replica_of(*ctx), "r-a");

  ctx = context();
  v1::GetTreeRequest unknown;
  unknown.set_tree_id("t_unknown");  // not of the id form: an unknown tree, as always
  v1::TreeInfo out;
  grpc::Status s = b_->stub->GetTree(ctx.get(), unknown, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(s.error_message().find("unknown tree 't_unknown'"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(replica_of(*ctx), "r-b");

  ctx = context();
  v1::GenerateRequest one_shot;
  one_shot.mutable_prompt()->set_text(kPrompt);
  one_shot.mutable_sampling()->set_max_tokens(3);
  auto reader = a_->stub->Generate(ctx.get(), one_shot);
  v1::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) tokens += m.token_id() >= 0;
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(tokens, 3);
  EXPECT_EQ(replica_of(*ctx), "r-a");
}

// The header: a value that is not a routing key, or two values, is INVALID_ARGUMENT naming it
// (on any method), and the response still names the replica.
TEST_F(RoutingE2E, InvalidRouteHeaderIsRefused) {
  for (const std::string& bad :
       {std::string("has space"), std::string(65, 'k'), std::string("a/b"), std::string()}) {
    auto ctx = context();
    ctx->AddMetadata(kRouteHeader, bad);
    v1::CreateTreeRequest req;
    req.mutable_prompt()->set_text(kPrompt);
    v1::CreateTreeResponse out;
    const grpc::Status s = a_->stub->CreateTree(ctx.get(), req, &out);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_EQ(s.error_message().rfind("x-treeserve-route: must be 1 to 64 characters", 0), 0u)
        << s.error_message();
    EXPECT_EQ(replica_of(*ctx), "r-a");
  }
  auto ctx = context("k1");
  ctx->AddMetadata(kRouteHeader, "k2");
  v1::ServerInfo info;
  const grpc::Status s = a_->stub->GetServerInfo(ctx.get(), {}, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message().rfind("x-treeserve-route: given 2 times", 0), 0u)
      << s.error_message();
}

// A new tree's route is the header's value, else the routing key of its prompt as sent (text,
// token ids), and its replica segment is the server's.
TEST_F(RoutingE2E, TreeIdsCarryTheRoute) {
  const v1::CreateTreeResponse routed = create(*a_, "session-42");
  EXPECT_EQ(routed.tree_id().rfind("t_session-42.r-a.", 0), 0u) << routed.tree_id();

  const v1::CreateTreeResponse by_text = create(*a_, "");
  auto parts = parse_tree_id(by_text.tree_id());
  ASSERT_TRUE(parts) << by_text.tree_id();
  EXPECT_EQ(parts->route, route_key_text(kPrompt));
  EXPECT_EQ(parts->replica, "r-a");
  EXPECT_EQ(parts->incarnation, parse_tree_id(routed.tree_id())->incarnation);

  v1::Prompt ids;
  const std::vector<int32_t> prompt_ids = {1, 351, 3186 % 512, 42};
  for (int32_t id : prompt_ids) ids.mutable_tokens()->add_ids(id);
  const v1::CreateTreeResponse by_ids = create(*a_, "", ids);
  ASSERT_TRUE(parse_tree_id(by_ids.tree_id())) << by_ids.tree_id();
  EXPECT_EQ(parse_tree_id(by_ids.tree_id())->route, route_key_ids(prompt_ids));

  for (const auto& id : {routed.tree_id(), by_text.tree_id(), by_ids.tree_id()}) remove(*a_, id);
}

// A restarted replica: an id of its earlier run is NOT_FOUND naming the restart.
TEST(RoutingRestart, TreesOfAnEarlierRunAreGone) {
  std::string id;
  {
    Replica c("r-c");
    ASSERT_TRUE(c.start()) << c.server.output();
    id = create(c, "").tree_id();
    ASSERT_EQ(c.server.terminate(), 0) << c.server.output();
  }
  Replica again("r-c");
  ASSERT_TRUE(again.start()) << again.server.output();
  v1::GetTreeRequest get;
  get.set_tree_id(id);
  v1::TreeInfo out;
  auto ctx = context(route_of_tree(id));
  const grpc::Status s = again.stub->GetTree(ctx.get(), get, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "tree " + id +
                                   " was made by an earlier run of replica 'r-c', which "
                                   "restarted: its trees were lost");
  EXPECT_EQ(replica_of(*ctx), "r-c");
  EXPECT_EQ(again.metric("treeserve:misrouted_calls_total"), 0);
  EXPECT_EQ(again.server.terminate(), 0);
}

// The HTTP tree API: the header sets the route, a tree of A named on B's HTTP listener is 409
// with the message, an invalid header is 400 naming it, and every answer carries
// x-treeserve-replica; /v1/server names the replica.
TEST_F(RoutingE2E, HttpTreeApi) {
  httplib::Client a = a_->http(), b = b_->http();
  const httplib::Headers routed = {{kRouteHeader, "http.route"}};
  auto created =
      a.Post("/v1/trees", routed, json({{"prompt", kPrompt}}).dump(), "application/json");
  ASSERT_TRUE(created);
  ASSERT_EQ(created->status, 200) << created->body;
  EXPECT_EQ(created->get_header_value(kReplicaHeader), "r-a");
  const std::string id = json::parse(created->body)["id"];
  EXPECT_EQ(id.rfind("t_http.route.r-a.", 0), 0u) << id;

  auto unrouted = a.Post("/v1/trees", json({{"prompt", kPrompt}}).dump(), "application/json");
  ASSERT_TRUE(unrouted);
  ASSERT_EQ(unrouted->status, 200) << unrouted->body;
  const std::string keyed = json::parse(unrouted->body)["id"];
  EXPECT_EQ(parse_tree_id(keyed)->route, route_key_text(kPrompt)) << keyed;

  const double before = b_->metric("treeserve:misrouted_calls_total");
  auto wrong = b.Get(("/v1/trees/" + id).c_str(), routed);
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 409) << wrong->body;
  EXPECT_EQ(wrong->get_header_value(kReplicaHeader), "r-b");
  const json error = json::parse(wrong->body)["error"];
  EXPECT_EQ(error["code"], "FAILED_PRECONDITION");
  EXPECT_EQ(error["message"], "tree " + id +
                                  " lives on replica 'r-a', not on this replica 'r-b': send its "
                                  "calls with the header x-treeserve-route: http.route so the "
                                  "proxy routes them to 'r-a' (if 'r-a' has stopped, its trees "
                                  "are gone)");
  EXPECT_EQ(b_->metric("treeserve:misrouted_calls_total"), before + 1);

  auto bad = a.Get(("/v1/trees/" + id).c_str(), {{kRouteHeader, "not a key"}});
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400) << bad->body;
  EXPECT_EQ(bad->get_header_value(kReplicaHeader), "r-a");
  EXPECT_EQ(json::parse(bad->body)["error"]["message"].get<std::string>().rfind(
                "x-treeserve-route: must be 1 to 64 characters", 0),
            0u)
      << bad->body;

  auto server = b.Get("/v1/server");
  ASSERT_TRUE(server);
  EXPECT_EQ(json::parse(server->body)["replica_id"], "r-b") << server->body;
  auto health = b.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->get_header_value(kReplicaHeader), "r-b");

  for (const std::string& t : {id, keyed}) {
    auto del = a.Delete(("/v1/trees/" + t).c_str(), routed);
    ASSERT_TRUE(del);
    EXPECT_EQ(del->status, 200) << del->body;
  }
}

// A --replica-id that is not one stops the start, naming the flag and the key.
TEST(RoutingStart, InvalidReplicaIdIsAStartUpError) {
  const RunResult r = run_treeserve_to_exit(
      with(backend_args(), {"--replica-id", "Replica_1", "--listen", "127.0.0.1:0"}));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("server.replica_id (--replica-id): must be 1 to 32 characters of "
                          "[a-z0-9-] starting with a letter or a digit, got 'Replica_1'"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace treeserve::testing
