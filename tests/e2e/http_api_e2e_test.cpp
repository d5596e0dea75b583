// The HTTP API end to end: the real server with --http-listen on loopback (CPU backend, tiny
// model), driven with cpp-httplib's client and raw sockets (the openai SDK and curl drive it
// in tests/http/). Greedy completions equal the gRPC one-shot Generate's tokens; the tree API
// mirrors the gRPC methods and their errors; errors have OpenAI's shape and the mapped HTTP
// status; a client that disconnects mid-stream frees its work; /health, /ready, keys, TLS and
// the viewer's files.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kPrompt = "Once upon a time, in a quiet village, there lived";

std::vector<std::string> with(std::vector<std::string> args, std::vector<std::string> more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// A JSON answer and its status (status -1: no answer).
struct Reply {
  int status = -1;
  json body;
  std::string raw;
  httplib::Headers headers;
};

Reply reply_of(const httplib::Result& r) {
  Reply out;
  if (!r) return out;
  out.status = r->status;
  out.raw = r->body;
  out.headers = r->headers;
  out.body = json::parse(r->body, nullptr, /*allow_exceptions=*/false);
  return out;
}

// The server-sent events of a body: each "data: " line's payload.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    out.push_back(body.substr(at + 6, end - at - 6));
    at = end;
  }
  return out;
}

class HttpApiE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    port_ = pick_free_port();
    server_ = new ServerProcess(
        with(backend_args(), {"--http-listen", "127.0.0.1:" + std::to_string(port_)}));
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
    stub_ = v1::TreeServe::NewStub(server_->channel()).release();
  }
  static void TearDownTestSuite() {
    delete stub_;
    EXPECT_EQ(server_->terminate(), 0) << server_->output();
    delete server_;
  }
  void TearDown() override { expect_idle(); }

  static httplib::Client client() {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(120, 0);
    return c;
  }
  static Reply post(const std::string& path, const json& body) {
    return reply_of(client().Post(path.c_str(), body.dump(), "application/json"));
  }
  static Reply post_raw(const std::string& path, const std::string& body) {
    return reply_of(client().Post(path.c_str(), body, "application/json"));
  }
  static Reply get(const std::string& path) { return reply_of(client().Get(path.c_str())); }

  static v1::ServerInfo info() {
    grpc::ClientContext ctx;
    v1::ServerInfo out;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, {}, &out).ok());
    return out;
  }
  // No live tree or branch, every page free or evictable cache (waits up to 10 s).
  static bool idle(int timeout_s = 10) {
    const auto end = Clock::now() + std::chrono::seconds(timeout_s);
    for (;;) {
      const v1::ServerInfo s = info();
      if (s.live_trees() == 0 && s.live_branches() == 0 &&
          s.kv_pages_free() + s.kv_pages_evictable() == s.kv_pages_total()) {
        return true;
      }
      if (Clock::now() > end) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  static void expect_idle() { EXPECT_TRUE(idle()) << info().DebugString(); }

  // The gRPC one-shot Generate's tokens per branch, in the order the branches first spoke.
  static std::vector<std::vector<int32_t>> grpc_one_shot(const std::string& prompt, int n,
                                                         int max_tokens) {
    v1::GenerateRequest r;
    r.mutable_prompt()->set_text(prompt);
    r.set_n(n);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, r);
    std::vector<std::vector<int32_t>> out;
    std::map<std::string, size_t> index;
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      auto [it, fresh] = index.try_emplace(m.branch_id(), out.size());
      if (fresh) out.emplace_back();
      if (m.token_id() >= 0) out[it->second].push_back(m.token_id());
    }
    EXPECT_TRUE(reader->Finish().ok());
    return out;
  }

  static void expect_error(const Reply& r, int status, const std::string& param,
                           const std::string& code) {
    EXPECT_EQ(r.status, status) << r.raw;
    ASSERT_TRUE(r.body.is_object() && r.body.contains("error")) << r.raw;
    const json& e = r.body["error"];
    EXPECT_EQ(e["param"], param.empty() ? json(nullptr) : json(param)) << r.raw;
    EXPECT_EQ(e["code"], code) << r.raw;
    EXPECT_TRUE(e["message"].is_string() && e["type"].is_string()) << r.raw;
    if (!param.empty()) {
      EXPECT_EQ(e["message"].get<std::string>().rfind(param, 0), 0u) << r.raw;
    }
  }

  static inline ServerProcess* server_ = nullptr;
  static inline v1::TreeServe::Stub* stub_ = nullptr;
  static inline int port_ = 0;
};

// ---- OpenAI completions ----

TEST_F(HttpApiE2E, GreedyCompletionsEqualTheGrpcOneShotGenerate) {
  const auto expected = grpc_one_shot(kPrompt, 3, 12);
  ASSERT_EQ(expected.size(), 3u);
  Reply r = post("/v1/completions", {{"model", "any"},
                                     {"prompt", kPrompt},
                                     {"n", 3},
                                     {"max_tokens", 12},
                                     {"temperature", 0},
                                     {"return_token_ids", true}});
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["object"], "text_completion");
  ASSERT_EQ(r.body["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const json& c = r.body["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["token_ids"].get<std::vector<int32_t>>(), expected[i]) << i;
    EXPECT_EQ(c["finish_reason"], expected[i].size() == 12 ? "length" : "stop");
  }
  // Usage: the prompt (BOS + its tokens), 3 x 12 generated, the cache the gRPC call left.
  grpc::ClientContext ctx;
  v1::TokenizeRequest tr;
  tr.set_text(kPrompt);
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(stub_->Tokenize(&ctx, tr, &tokens).ok());
  const json& u = r.body["usage"];
  EXPECT_EQ(u["prompt_tokens"], tokens.ids_size() + 1);
  EXPECT_EQ(u["completion_tokens"], 36);
  EXPECT_EQ(u["total_tokens"], tokens.ids_size() + 1 + 36);
  EXPECT_GT(u["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);

  // Streamed: the same text per choice, the usage last, then [DONE].
  Reply s = post("/v1/completions", {{"prompt", kPrompt},
                                     {"n", 3},
                                     {"max_tokens", 12},
                                     {"temperature", 0},
                                     {"stream", true},
                                     {"stream_options", {{"include_usage", true}}}});
  ASSERT_EQ(s.status, 200) << s.raw;
  EXPECT_NE(s.headers.find("Content-Type")->second.find("text/event-stream"), std::string::npos);
  std::vector<std::string> events = sse_data(s.raw);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::vector<std::string> text(3);
  json usage;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json e = json::parse(events[i]);
    if (e["choices"].empty()) {
      usage = e["usage"];
      continue;
    }
    EXPECT_TRUE(e["usage"].is_null());
    text[e["choices"][0]["index"].get<size_t>()] += e["choices"][0]["text"].get<std::string>();
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(text[i], r.body["choices"][i]["text"]) << i;
  EXPECT_EQ(usage["completion_tokens"], 36);
}

TEST_F(HttpApiE2E, PromptFormsAndLogprobs) {
  grpc::ClientContext ctx;
  v1::TokenizeRequest tr;
  tr.set_text(kPrompt);
  v1::TokenizeResponse tokens;
  ASSERT_TRUE(stub_->Tokenize(&ctx, tr, &tokens).ok());
  std::vector<int32_t> ids = {1};  // the tiny model's BOS, as a text prompt gets it
  ids.insert(ids.end(), tokens.ids().begin(), tokens.ids().end());
  json base = {{"max_tokens", 5}, {"temperature", 0}, {"return_token_ids", true}};
  std::vector<json> outs;
  for (json prompt : {json(kPrompt), json(ids), json::array({kPrompt}), json::array({ids})}) {
    json body = base;
    body["prompt"] = prompt;
    Reply r = post("/v1/completions", body);
    ASSERT_EQ(r.status, 200) << r.raw;
    outs.push_back(r.body["choices"][0]["token_ids"]);
  }
  for (const json& o : outs) EXPECT_EQ(o, outs[0]);

  json body = base;
  body["prompt"] = kPrompt;
  body["logprobs"] = 2;
  Reply r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  const json& lp = r.body["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 5u);
  ASSERT_EQ(lp["token_logprobs"].size(), 5u);
  ASSERT_EQ(lp["text_offset"].size(), 5u);
  ASSERT_EQ(lp["top_logprobs"].size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u);
    EXPECT_LE(lp["top_logprobs"][i].size(), 2u);
    // Greedy: the chosen token is the most likely one.
    double best = -1e9;
    for (auto& [tok, v] : lp["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), best, 1e-5);
  }
  body["logprobs"] = 0;
  r = post("/v1/completions", body);
  ASSERT_EQ(r.status, 200) << r.raw;
  EXPECT_EQ(r.body["choices"][0]["logprobs"]["token_logprobs"].size(), 5u);
  // No alternatives asked for: an empty object per token (the SDK's type has no null there).
  const json& top0 = r.body["choices"][0]["logprobs"]["top_logprobs"][0];
  EXPECT_TRUE(top0.is_object() && top0.empty()) << top0.dump();
}

TEST_F(HttpApiE2E, StopStringsSeedsAndUnknownFields) {
  json body = {{"prompt", kPrompt}, {"max_tokens", 16}, {"temperature", 0}};
  Reply whole = post("/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.raw;
  const std::string text = whole.body["choices"][0]["text"];
  ASSERT_GE(text.size(), 4u);
  // A stop string inside the text ends it there (the stop string not returned).
  body["stop"] = text.substr(2, 2);
  Reply stopped = post("/v1/completions", body);
  ASSERT_EQ(stopped.status, 200) << stopped.raw;
  EXPECT_EQ(stopped.body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(text.rfind(stopped.body["choices"][0]["text"].get<std::string>(), 0), 0u);
  EXPECT_LT(stopped.body["choices"][0]["text"].get<std::string>().size(), text.size());
  // A seed repeats a sampled completion; unknown fields (and OpenAI's `user`) are ignored.
  json sampled = {{"prompt", kPrompt}, {"max_tokens", 8}, {"temperature", 1.0},
                  {"seed", 7},         {"user", "u"},     {"some_extension", {1, 2}}};
  Reply a = post("/v1/completions", sampled);
  Reply b = post("/v1/completions", sampled);
  ASSERT_EQ(a.status, 200) << a.raw;
  EXPECT_EQ(a.body["choices"][0]["text"], b.body["choices"][0]["text"]);
}

TEST_F(HttpApiE2E, ErrorsNameTheFieldWithTheMappedStatus) {
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"temperature", "hot"}}), 400,
               "temperature", "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"temperature", -1}}), 400,
               "temperature", "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"n", 0}}), 400, "n",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"n", 100000}}), 400, "n",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 0}}), 400, "max_tokens",
               "INVALID_ARGUMENT");
  // Over limits.max_tokens: the service's check, under the HTTP name.
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 1000000}}), 400,
               "max_tokens", "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", {5, 999999}}}), 400, "prompt[1]",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", {"a", "b"}}}), 400, "prompt",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", json::array()}}), 400, "prompt",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"max_tokens", 3}}), 400, "prompt", "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"stop", {"a", 3}}}), 400, "stop[1]",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"echo", true}}), 400, "echo",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/completions", {{"prompt", kPrompt}, {"stream_options", json::object()}}),
               400, "stream_options", "INVALID_ARGUMENT");
  expect_error(post_raw("/v1/completions", "{\"prompt\": "), 400, "", "INVALID_ARGUMENT");
  expect_error(post_raw("/v1/completions", "[1, 2]"), 400, "", "INVALID_ARGUMENT");
  // A large body labelled a form (curl -d's default type): 413, saying to send JSON.
  const std::string big = json({{"prompt", std::string(10000, 'a')}}).dump();
  Reply form = reply_of(client().Post("/v1/completions", big, "application/x-www-form-urlencoded"));
  EXPECT_EQ(form.status, 413) << form.raw;
  EXPECT_NE(form.raw.find("Content-Type: application/json"), std::string::npos) << form.raw;
  expect_error(get("/v1/nothing-here"), 404, "path", "NOT_FOUND");
  expect_error(get("/v1/completions"), 404, "path", "NOT_FOUND");
}

// ---- the tree API ----

TEST_F(HttpApiE2E, TreeApiMirrorsTheGrpcMethods) {
  Reply created = post("/v1/trees", {{"prompt", kPrompt}, {"lease_ms", 60000}});
  ASSERT_EQ(created.status, 200) << created.raw;
  const std::string tree = created.body["id"];
  const std::string root = created.body["root_branch_id"];
  EXPECT_EQ(created.body["lease_ms"], 60000);
  EXPECT_GT(created.body["prompt_tokens"].get<int>(), 0);

  Reply listed = get("/v1/trees");
  ASSERT_EQ(listed.status, 200) << listed.raw;
  ASSERT_EQ(listed.body["data"].size(), 1u);
  EXPECT_EQ(listed.body["data"][0]["id"], tree);

  Reply kids = post("/v1/trees/" + tree + "/branch", {{"branch_id", root}, {"n", 4}});
  ASSERT_EQ(kids.status, 200) << kids.raw;
  ASSERT_EQ(kids.body["branch_ids"].size(), 4u);
  const json ids = kids.body["branch_ids"];

  Reply gen = post("/v1/trees/" + tree + "/generate",
                   {{"branch_ids", ids}, {"max_tokens", 6}, {"logprobs", 1}});
  ASSERT_EQ(gen.status, 200) << gen.raw;
  ASSERT_EQ(gen.body["branches"].size(), 4u);
  for (const json& b : gen.body["branches"]) {
    EXPECT_EQ(b["token_ids"].size(), 6u);
    EXPECT_EQ(b["logprobs"].size(), 6u);
    EXPECT_EQ(b["finish_reason"], "length");
    EXPECT_EQ(b["token_ids"], gen.body["branches"][0]["token_ids"]);  // greedy, same context
  }
  // Streamed, with an appended text: events tagged with their branch, then [DONE].
  Reply sse = post("/v1/trees/" + tree + "/generate", {{"branch_ids", {ids[0], ids[1]}},
                                                       {"append", " and then"},
                                                       {"max_tokens", 3},
                                                       {"stream", true}});
  ASSERT_EQ(sse.status, 200) << sse.raw;
  std::vector<std::string> events = sse_data(sse.raw);
  ASSERT_EQ(events.back(), "[DONE]");
  std::map<std::string, int> per_branch;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    json e = json::parse(events[i]);
    ++per_branch[e["branch_id"]];
    EXPECT_TRUE(e.contains("token_id") && e.contains("text") && e.contains("logprob"));
  }
  EXPECT_EQ(per_branch.size(), 2u);
  EXPECT_EQ(per_branch[ids[0]], 3);

  Reply detail = get("/v1/trees/" + tree + "?detail=1");
  ASSERT_EQ(detail.status, 200) << detail.raw;
  EXPECT_EQ(detail.body["live_branches"], 5);
  ASSERT_EQ(detail.body["branches"].size(), 5u);
  const json& r0 = detail.body["branches"][0];
  EXPECT_EQ(r0["id"], root);
  EXPECT_EQ(r0["parent"], "");
  EXPECT_EQ(r0["text"], kPrompt);
  EXPECT_EQ(r0["state"], "idle");
  for (size_t i = 1; i < 5; ++i) {
    const json& b = detail.body["branches"][i];
    EXPECT_EQ(b["parent"], root);
    EXPECT_EQ(b["fork_offset"], created.body["prompt_tokens"]);
    EXPECT_EQ(b["finish_reason"], "length");
    EXPECT_GT(b["kv_pages"].get<int>(), 0);
    EXPECT_LE(b["shared_pages"].get<int>(), b["kv_pages"].get<int>());
    EXPECT_FALSE(b["text"].get<std::string>().empty());
  }
  Reply plain = get("/v1/trees/" + tree + "?page_size=2");
  ASSERT_EQ(plain.status, 200) << plain.raw;
  EXPECT_EQ(plain.body["branches"].size(), 2u);
  EXPECT_FALSE(plain.body["branches"][0].contains("text"));
  EXPECT_FALSE(plain.body["next_page_token"].get<std::string>().empty());

  Reply verify = post("/v1/trees/" + tree + "/verify",
                      {{"branch_id", ids[2]}, {"tokens", {5, 6}}, {"parents", {-1, 0}}});
  ASSERT_EQ(verify.status, 200) << verify.raw;
  EXPECT_TRUE(verify.body["accepted_tokens"].is_array());
  EXPECT_TRUE(verify.body["bonus_token"].is_number_integer());

  Reply pruned = post("/v1/trees/" + tree + "/prune", {{"branch_ids", {ids[3]}}});
  ASSERT_EQ(pruned.status, 200) << pruned.raw;
  EXPECT_EQ(pruned.body["pruned_branches"], 1);
  EXPECT_GT(pruned.body["freed_tokens"].get<int>(), 0);

  // Errors, as gRPC gives them.
  expect_error(post("/v1/trees/" + tree + "/prune", {{"branch_ids", {ids[3]}}}), 404, "branch_id",
               "NOT_FOUND");
  expect_error(post("/v1/trees/t_nope/branch", {{"branch_id", root}}), 404, "tree_id", "NOT_FOUND");
  expect_error(post("/v1/trees/" + tree + "/generate", {{"branch_ids", json::array()}}), 400,
               "branch_ids", "INVALID_ARGUMENT");
  expect_error(post("/v1/trees/" + tree + "/generate", {{"branch_ids", {""}}}), 400,
               "branch_ids[0]", "INVALID_ARGUMENT");
  expect_error(post("/v1/trees/" + tree + "/branch", {{"branch_id", root}, {"n", 0}}), 400, "n",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/trees/" + tree + "/branch", {{"branch_id", 12}}), 400, "branch_id",
               "INVALID_ARGUMENT");
  expect_error(post("/v1/trees", {{"prompt", ""}}), 400, "prompt", "INVALID_ARGUMENT");
  expect_error(post("/v1/trees", {{"prompt", kPrompt}, {"lease_ms", -1}}), 400, "lease_ms",
               "INVALID_ARGUMENT");
  expect_error(get("/v1/trees/" + tree + "?page_size=x"), 400, "page_size", "INVALID_ARGUMENT");
  // A branch busy with another Generate: FAILED_PRECONDITION, 409. The detail says when the
  // long one runs (reading it does not make the branch busy).
  Reply long_one;
  std::thread busy([&] {
    long_one = post("/v1/trees/" + tree + "/generate",
                    {{"branch_ids", {ids[0]}}, {"max_tokens", 2000}, {"temperature", 1.0}});
  });
  bool generating = false;
  for (int i = 0; i < 1000 && !generating; ++i) {
    Reply d = get("/v1/trees/" + tree + "?detail=1");
    for (const json& b : d.body["branches"]) {
      generating = generating || (b["id"] == ids[0] && b["state"] == "generating");
    }
    if (!generating) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_TRUE(generating);
  expect_error(
      post("/v1/trees/" + tree + "/generate", {{"branch_ids", {ids[0]}}, {"max_tokens", 1}}), 409,
      "branch_ids", "FAILED_PRECONDITION");
  busy.join();
  EXPECT_EQ(long_one.status, 200) << long_one.raw;

  const Clock::time_point t0 = Clock::now();
  Reply deleted = reply_of(client().Delete(("/v1/trees/" + tree).c_str()));
  ASSERT_EQ(deleted.status, 200) << deleted.raw;
  EXPECT_GT(deleted.body["freed_tokens"].get<int>(), 0);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  expect_error(reply_of(client().Delete(("/v1/trees/" + tree).c_str())), 404, "tree_id",
               "NOT_FOUND");
}

// ---- disconnects ----

// Sends a raw HTTP request and reads the answer until `events` SSE events arrived (events > 0)
// or `wait` passed, then closes the socket. Returns what it read.
std::string post_and_hang_up(int port, const std::string& path, const json& body, int events,
                             std::chrono::milliseconds wait = std::chrono::seconds(60)) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string payload = body.dump();
  const std::string req = "POST " + path +
                          " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          "Content-Length: " +
                          std::to_string(payload.size()) + "\r\n\r\n" + payload;
  EXPECT_EQ(::send(fd, req.data(), req.size(), 0), ssize_t(req.size()));
  timeval tv{0, 50 * 1000};  // recv wakes up every 50 ms to look at the clock
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[4096];
  const auto end = Clock::now() + wait;
  auto count = [&] {
    size_t n = 0;
    for (size_t at = got.find("data: "); at != std::string::npos; at = got.find("data: ", at + 1)) {
      ++n;
    }
    return n;
  };
  while (Clock::now() < end && (events == 0 || count() < size_t(events))) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n > 0) got.append(buf, size_t(n));
  }
  ::close(fd);
  return got;
}

TEST_F(HttpApiE2E, ADisconnectMidStreamStopsTheGeneration) {
  const int64_t steps_before = info().decode_steps();
  const std::string got = post_and_hang_up(port_, "/v1/completions",
                                           {{"prompt", kPrompt},
                                            {"n", 4},
                                            {"max_tokens", 4000},
                                            {"stream", true},
                                            {"stop_token_ids", json::array()}},
                                           5);
  EXPECT_NE(got.find("200 OK"), std::string::npos) << got;
  // The one-shot tree goes: the pool is idle again long before 4 x 4000 tokens.
  ASSERT_TRUE(idle()) << info().DebugString();
  EXPECT_LT(info().decode_steps() - steps_before, 3000) << "the generation ran on";
}

TEST_F(HttpApiE2E, ADisconnectFromATreeGenerateKeepsTheBranches) {
  Reply created = post("/v1/trees", {{"prompt", kPrompt}});
  ASSERT_EQ(created.status, 200) << created.raw;
  const std::string tree = created.body["id"];
  Reply kids = post("/v1/trees/" + tree + "/branch",
                    {{"branch_id", created.body["root_branch_id"]}, {"n", 2}});
  ASSERT_EQ(kids.status, 200) << kids.raw;
  post_and_hang_up(port_, "/v1/trees/" + tree + "/generate",
                   {{"branch_ids", kids.body["branch_ids"]},
                    {"max_tokens", 4000},
                    {"temperature", 1.0},
                    {"stream", true}},
                   4);
  // Both branches stop (FINISH_CANCELLED) and stay, with the tokens they have.
  bool stopped = false;
  Reply detail;
  for (int i = 0; i < 500 && !stopped; ++i) {
    detail = get("/v1/trees/" + tree + "?detail=1");
    stopped = true;
    for (size_t b = 1; b < detail.body["branches"].size(); ++b) {
      stopped = stopped && detail.body["branches"][b]["state"] == "idle" &&
                detail.body["branches"][b]["finish_reason"] == "cancelled";
    }
    if (!stopped) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(stopped) << detail.raw;
  EXPECT_EQ(detail.body["live_branches"], 3);
  EXPECT_LT(detail.body["branches"][1]["length"].get<int>(),
            created.body["prompt_tokens"].get<int>() + 4000);
  ASSERT_EQ(reply_of(client().Delete(("/v1/trees/" + tree).c_str())).status, 200);
}

TEST_F(HttpApiE2E, ADisconnectDuringASlowWholeResponseStopsIt) {
  const int64_t steps_before = info().decode_steps();
  // A whole (not streamed) answer that takes longer than the commit delay: the server starts
  // the response with spaces and notices the closed socket.
  post_and_hang_up(port_, "/v1/completions",
                   {{"prompt", kPrompt}, {"n", 8}, {"max_tokens", 4000}, {"temperature", 1.0}}, 0,
                   std::chrono::milliseconds(1500));
  ASSERT_TRUE(idle(20)) << info().DebugString();
  EXPECT_LT(info().decode_steps() - steps_before, 3500) << "the generation ran on";
}

// ---- the rest of the surface ----

TEST_F(HttpApiE2E, ModelsServerHealthAndViewer) {
  Reply models = get("/v1/models");
  ASSERT_EQ(models.status, 200) << models.raw;
  EXPECT_EQ(models.body["object"], "list");
  EXPECT_EQ(models.body["data"][0]["object"], "model");
  const std::string model = models.body["data"][0]["id"];
  Reply completion = post("/v1/completions", {{"prompt", kPrompt}, {"max_tokens", 1}});
  EXPECT_EQ(completion.body["model"], model);

  Reply server = get("/v1/server");
  ASSERT_EQ(server.status, 200) << server.raw;
  for (const char* key : {"kv_pages_total", "kv_pages_free", "kv_pages_evictable", "live_trees",
                          "live_branches", "page_size", "decode_steps"}) {
    EXPECT_TRUE(server.body[key].is_number_integer()) << key << " " << server.raw;
  }
  EXPECT_TRUE(server.body["kv_cache_dtype"].is_string()) << server.raw;
  EXPECT_EQ(get("/health").body, json({{"status", "ok"}}));
  EXPECT_EQ(get("/ready").body, json({{"status", "ready"}}));

  auto page = client().Get("/viewer");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_NE(page->get_header_value("Content-Type").find("text/html"), std::string::npos);
  EXPECT_NE(page->body.find("<html"), std::string::npos);
  auto script = client().Get("/viewer/viewer.js");
  ASSERT_TRUE(script);
  EXPECT_EQ(script->status, 200);
  EXPECT_NE(script->get_header_value("Content-Type").find("javascript"), std::string::npos);
  expect_error(get("/viewer/nope.js"), 404, "path", "NOT_FOUND");

  // One connection serves many requests (keep-alive).
  httplib::Client c = client();
  for (int i = 0; i < 20; ++i) {
    auto r = c.Get("/health");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
  }
}

TEST(HttpApiStartup, ReadyOnlyOnceTheModelIsLoaded) {
  const int port = pick_free_port();
  ::setenv("TREESERVE_LOAD_DELAY_MS", "3000", 1);
  ServerProcess server({"--backend", "cpu", "--http-listen", std::to_string(port)});
  ::unsetenv("TREESERVE_LOAD_DELAY_MS");
  httplib::Client c("127.0.0.1", port);
  // The port alone means loopback; the listener is up while the model loads.
  int health = -1;
  for (int i = 0; i < 200 && health < 0; ++i) {
    if (auto r = c.Get("/health")) {
      health = r->status;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  EXPECT_EQ(health, 200) << server.output();
  auto ready = c.Get("/ready");
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->status, 503);
  Reply loading = reply_of(c.Post("/v1/completions", R"({"prompt": "x"})", "application/json"));
  EXPECT_EQ(loading.status, 503) << loading.raw;
  EXPECT_EQ(loading.body["error"]["code"], "UNAVAILABLE");
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_EQ(c.Get("/ready")->status, 200);
  EXPECT_NE(server.output().find("HTTP API on http://127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << server.output();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(HttpApiStartup, APortInUseIsAStartupError) {
  const int port = pick_free_port();
  ServerProcess first({"--backend", "cpu", "--http-listen", std::to_string(port)});
  ASSERT_TRUE(first.wait_ready()) << first.output();
  RunResult second = run_treeserve_to_exit({"--backend", "cpu", "--listen", "127.0.0.1:0",
                                            "--http-listen", "127.0.0.1:" + std::to_string(port)});
  EXPECT_NE(second.exit_code, 0);
  EXPECT_NE(second.output.find("cannot listen for HTTP on 127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << second.output;
  EXPECT_EQ(first.terminate(), 0) << first.output();
}

TEST(HttpApiAuth, KeysAndTls) {
  signal(SIGPIPE, SIG_IGN);
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(treeserve::testing_support::test_temp_dir()) / "treeserve-http-tls";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string cert = (dir / "server.crt").string(), key = (dir / "server.key").string();
  ASSERT_EQ(std::system(("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
                         "-nodes -keyout " +
                         key + " -out " + cert +
                         " -days 2 -subj /CN=localhost -addext "
                         "subjectAltName=IP:127.0.0.1 >/dev/null 2>&1")
                            .c_str()),
            0);
  const int port = pick_free_port();
  ::setenv("TREESERVE_API_KEY", "http-secret", 1);
  ServerProcess server({"--backend", "cpu", "--http-listen", "127.0.0.1:" + std::to_string(port),
                        "--tls-cert", cert, "--tls-key", key},
                       grpc::SslCredentials({.pem_root_certs = [&] {
                         std::ifstream in(cert);
                         return std::string(std::istreambuf_iterator<char>(in), {});
                       }()}));
  ::unsetenv("TREESERVE_API_KEY");
  ASSERT_TRUE(server.wait_ready()) << server.output();

  httplib::SSLClient https("127.0.0.1", port);
  https.set_ca_cert_path(cert.c_str());
  https.enable_server_certificate_verification(true);
  // No key, a wrong key: 401 in OpenAI's shape (the failure logged with the HTTP peer).
  Reply none = reply_of(https.Get("/v1/models"));
  EXPECT_EQ(none.status, 401) << none.raw;
  EXPECT_EQ(none.body["error"]["code"], "UNAUTHENTICATED");
  EXPECT_EQ(none.headers.find("WWW-Authenticate")->second, "Bearer");
  Reply wrong = reply_of(https.Post("/v1/completions", {{"Authorization", "Bearer nope"}},
                                    R"({"prompt": "x"})", "application/json"));
  EXPECT_EQ(wrong.status, 401) << wrong.raw;
  // The key: served.
  const httplib::Headers auth = {{"Authorization", "Bearer http-secret"}};
  EXPECT_EQ(reply_of(https.Get("/v1/models", auth)).status, 200);
  Reply ok = reply_of(https.Post("/v1/completions", auth, R"({"prompt": "x", "max_tokens": 2})",
                                 "application/json"));
  EXPECT_EQ(ok.status, 200) << ok.raw;
  Reply tree = reply_of(https.Post("/v1/trees", auth, R"({"prompt": "x"})", "application/json"));
  ASSERT_EQ(tree.status, 200) << tree.raw;
  EXPECT_EQ(reply_of(https.Get("/v1/trees", auth)).body["data"].size(), 1u);
  EXPECT_EQ(
      reply_of(https.Delete(("/v1/trees/" + tree.body["id"].get<std::string>()).c_str(), auth))
          .status,
      200);
  // Health, readiness and the viewer's files need no key.
  EXPECT_EQ(reply_of(https.Get("/health")).status, 200);
  EXPECT_EQ(reply_of(https.Get("/ready")).status, 200);
  EXPECT_EQ(reply_of(https.Get("/viewer")).status, 200);
  // Plain HTTP on the TLS port gets nowhere.
  httplib::Client plain("127.0.0.1", port);
  plain.set_read_timeout(5, 0);
  auto refused = plain.Get("/health");
  EXPECT_TRUE(!refused || refused->status != 200);
  EXPECT_NE(server.output().find("auth: refused GET /v1/models from 127.0.0.1:"), std::string::npos)
      << server.output();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(HttpApiAuth, TenantsAndQuotasAreTheGrpcOnes) {
  namespace fs = std::filesystem;
  const fs::path keys =
      fs::path(treeserve::testing_support::test_temp_dir()) / "treeserve-http-keys.json";
  std::ofstream(keys) << R"({
    "tenants": [{"name": "team-a", "quotas": {"max_live_trees": 1}}, {"name": "team-b"}],
    "keys": [{"tenant": "team-a", "key": "key-a"}, {"tenant": "team-b", "key": "key-b"}]})";
  const int port = pick_free_port();
  ServerProcess server(
      {"--backend", "cpu", "--http-listen", std::to_string(port), "--keys-file", keys.string()});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  httplib::Client c("127.0.0.1", port);
  const httplib::Headers a = {{"Authorization", "Bearer key-a"}};
  const httplib::Headers b = {{"Authorization", "Bearer key-b"}};
  Reply tree = reply_of(c.Post("/v1/trees", a, R"({"prompt": "x"})", "application/json"));
  ASSERT_EQ(tree.status, 200) << tree.raw;
  const std::string id = tree.body["id"];
  // team-a's quota of one live tree: 429, the quota named.
  Reply second = reply_of(c.Post("/v1/trees", a, R"({"prompt": "y"})", "application/json"));
  EXPECT_EQ(second.status, 429) << second.raw;
  EXPECT_EQ(second.body["error"]["code"], "RESOURCE_EXHAUSTED");
  EXPECT_NE(second.body["error"]["message"].get<std::string>().find("team-a"), std::string::npos)
      << second.raw;
  // team-b sees none of team-a's trees: the same 404 as an id never issued.
  Reply other = reply_of(c.Get(("/v1/trees/" + id).c_str(), b));
  EXPECT_EQ(other.status, 404) << other.raw;
  EXPECT_EQ(reply_of(c.Get("/v1/trees", b)).body["data"].size(), 0u);
  EXPECT_EQ(reply_of(c.Get("/v1/trees", a)).body["data"].size(), 1u);
  EXPECT_EQ(reply_of(c.Delete(("/v1/trees/" + id).c_str(), b)).status, 404);
  EXPECT_EQ(reply_of(c.Post("/v1/completions", b, R"({"prompt": "x", "max_tokens": 2})",
                            "application/json"))
                .status,
            200);
  EXPECT_EQ(reply_of(c.Delete(("/v1/trees/" + id).c_str(), a)).status, 200);
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
