// What the HTTP API costs over gRPC, against one running server (bench/http/run.sh starts
// the CPU server on the tiny model): the same greedy completions as gRPC one-shot Generate
// calls (the baseline) and as POST /v1/completions, both clients in C++ (grpc++ and
// cpp-httplib, keep-alive connections), so the difference is the server's HTTP path (JSON,
// the in-process gRPC hop, SSE) plus the client libraries.
//   1. requests/s of short whole completions at several concurrencies;
//   2. a streamed completion's time per token (first token to last, over tokens - 1) and its
//      time to first token, one request at a time: the added latency per token is the
//      difference of the medians.
// The two sides alternate in rounds, so drift (a warm cache, other load) falls on both.
// usage: bench_http --grpc HOST:PORT --http HOST:PORT [--rounds R] [--requests N]
//                   [--concurrency 1,4,16,64] [--short-tokens T] [--stream-tokens T]
#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "proto/treeserve.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
namespace v1 = treeserve::v1;

constexpr const char* kPrompt =
    "Once upon a time, in a quiet village at the edge of a great forest, there lived";

struct Options {
  std::string grpc = "127.0.0.1:50051";
  std::string http_host = "127.0.0.1";
  int http_port = 8000;
  int rounds = 5;
  int requests = 200;  // per round and side, whole completions
  std::vector<int> concurrency = {1, 4, 16, 64};
  int short_tokens = 4;
  int stream_tokens = 64;
  int stream_requests = 20;  // per round and side
};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One completion; returns the tokens received, or -1 on an error (printed).
using Request = std::function<int()>;

int grpc_whole(v1::TreeServe::Stub& stub, int max_tokens) {
  v1::GenerateRequest r;
  r.mutable_prompt()->set_text(kPrompt);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  grpc::ClientContext ctx;
  auto reader = stub.Generate(&ctx, r);
  v1::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) tokens += m.token_id() >= 0;
  grpc::Status s = reader->Finish();
  if (!s.ok()) {
    std::fprintf(stderr, "gRPC: %s\n", s.error_message().c_str());
    return -1;
  }
  return tokens;
}

int http_whole(httplib::Client& c, int max_tokens) {
  const json body = {{"prompt", kPrompt}, {"max_tokens", max_tokens}, {"temperature", 0}};
  auto res = c.Post("/v1/completions", body.dump(), "application/json");
  if (!res || res->status != 200) {
    std::fprintf(stderr, "HTTP: %s\n",
                 res ? res->body.c_str() : httplib::to_string(res.error()).c_str());
    return -1;
  }
  return json::parse(res->body)["usage"]["completion_tokens"].get<int>();
}

// Requests/s of `n` requests over `threads` threads, each with its own client.
double rate(int threads, int n, const std::function<Request()>& make) {
  std::atomic<int> next{0}, failed{0};
  std::vector<std::thread> pool;
  const auto start = Clock::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      Request request = make();
      while (next.fetch_add(1) < n) {
        if (request() < 0) ++failed;
      }
    });
  }
  for (auto& t : pool) t.join();
  const double s = seconds(Clock::now() - start);
  if (failed > 0) std::fprintf(stderr, "%d requests failed\n", failed.load());
  return n / s;
}

// A streamed completion's timing.
struct StreamTiming {
  double ttft = 0;       // seconds to the first token
  double per_token = 0;  // seconds per token after the first
  int tokens = 0;
};

StreamTiming grpc_stream(v1::TreeServe::Stub& stub, int max_tokens) {
  v1::GenerateRequest r;
  r.mutable_prompt()->set_text(kPrompt);
  r.mutable_sampling()->set_max_tokens(max_tokens);
  grpc::ClientContext ctx;
  const auto start = Clock::now();
  auto reader = stub.Generate(&ctx, r);
  v1::GenerateResponse m;
  StreamTiming t;
  Clock::time_point first, last;
  while (reader->Read(&m)) {
    if (m.token_id() < 0) continue;
    last = Clock::now();
    if (t.tokens++ == 0) first = last;
  }
  reader->Finish();
  t.ttft = seconds(first - start);
  t.per_token = t.tokens > 1 ? seconds(last - first) / (t.tokens - 1) : 0;
  return t;
}

StreamTiming http_stream(httplib::Client& c, int max_tokens) {
  const json body = {{"prompt", kPrompt},
                     {"max_tokens", max_tokens},
                     {"temperature", 0},
                     {"stream", true},
                     {"return_token_ids", true}};
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  StreamTiming t;
  Clock::time_point first, last;
  std::string pending;
  const auto start = Clock::now();
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    pending.append(data, n);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      // One token per event here (return_token_ids: each chunk names its token).
      if (event.rfind("data: {", 0) == 0 && event.find("\"token_ids\"") != std::string::npos) {
        last = Clock::now();
        if (t.tokens++ == 0) first = last;
      }
    }
    return true;
  };
  auto res = c.send(req);
  if (!res || res->status != 200) std::fprintf(stderr, "HTTP stream failed\n");
  t.ttft = seconds(first - start);
  t.per_token = t.tokens > 1 ? seconds(last - first) / (t.tokens - 1) : 0;
  return t;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--grpc") {
      o.grpc = v;
    } else if (k == "--http") {
      o.http_host = v.substr(0, v.rfind(':'));
      o.http_port = std::atoi(v.substr(v.rfind(':') + 1).c_str());
    } else if (k == "--rounds") {
      o.rounds = std::atoi(v.c_str());
    } else if (k == "--requests") {
      o.requests = std::atoi(v.c_str());
    } else if (k == "--short-tokens") {
      o.short_tokens = std::atoi(v.c_str());
    } else if (k == "--stream-tokens") {
      o.stream_tokens = std::atoi(v.c_str());
    } else if (k == "--concurrency") {
      o.concurrency.clear();
      std::stringstream ss(v);
      for (std::string part; std::getline(ss, part, ',');)
        o.concurrency.push_back(std::atoi(part.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel(o.grpc, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::TreeServe::NewStub(channel);
  auto make_grpc = [&] { return Request([&] { return grpc_whole(*stub, o.short_tokens); }); };
  auto make_http = [&] {
    auto c = std::make_shared<httplib::Client>(o.http_host, o.http_port);
    c->set_keep_alive(true);
    c->set_tcp_nodelay(true);
    return Request([c, &o] { return http_whole(*c, o.short_tokens); });
  };
  // Warm-up: the prompt enters the radix cache, connections open, code paths run once.
  for (int i = 0; i < 20; ++i) {
    make_grpc()();
    make_http()();
  }

  std::printf(
      "whole completions, %d tokens each (greedy, the prompt cached), %d requests x %d "
      "rounds per side; median of the rounds\n",
      o.short_tokens, o.requests, o.rounds);
  std::printf("%-12s %14s %14s %10s %18s\n", "concurrency", "gRPC req/s", "HTTP req/s", "HTTP/gRPC",
              "HTTP added ms/req");
  for (int c : o.concurrency) {
    std::vector<double> g, h;
    for (int r = 0; r < o.rounds; ++r) {
      g.push_back(rate(c, o.requests, make_grpc));
      h.push_back(rate(c, o.requests, make_http));
    }
    const double gm = median(g), hm = median(h);
    std::printf("%-12d %14.1f %14.1f %10.3f %18.3f\n", c, gm, hm, hm / gm, 1e3 * (c / hm - c / gm));
  }

  std::printf(
      "\nstreamed completion, up to %d tokens (greedy), one at a time, %d requests x %d "
      "rounds per side; medians\n",
      o.stream_tokens, o.stream_requests, o.rounds);
  std::vector<double> g_tok, h_tok, g_ttft, h_ttft;
  int tokens = 0;
  httplib::Client http(o.http_host, o.http_port);
  http.set_keep_alive(true);
  http.set_tcp_nodelay(true);
  for (int r = 0; r < o.rounds; ++r) {
    for (int i = 0; i < o.stream_requests; ++i) {
      StreamTiming g = grpc_stream(*stub, o.stream_tokens);
      StreamTiming h = http_stream(http, o.stream_tokens);
      g_tok.push_back(g.per_token);
      h_tok.push_back(h.per_token);
      g_ttft.push_back(g.ttft);
      h_ttft.push_back(h.ttft);
      tokens = h.tokens;
      if (g.tokens != h.tokens)
        std::fprintf(stderr, "token counts differ: %d vs %d\n", g.tokens, h.tokens);
    }
  }
  std::printf("%-22s %12s %12s %12s\n", "", "gRPC", "HTTP (SSE)", "added");
  std::printf("%-22s %12.3f %12.3f %12.3f\n", "ms per token", 1e3 * median(g_tok),
              1e3 * median(h_tok), 1e3 * (median(h_tok) - median(g_tok)));
  std::printf("%-22s %12.3f %12.3f %12.3f\n", "ms to first token", 1e3 * median(g_ttft),
              1e3 * median(h_ttft), 1e3 * (median(h_ttft) - median(g_ttft)));
  std::printf("tokens per stream: %d\n", tokens);
  return 0;
}
