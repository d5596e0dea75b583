// The HTTP API (docs/http-api.md) on a listener of its own (server.http_listen), with
// cpp-httplib: OpenAI's /v1/models, /v1/completions and /v1/chat/completions; the tree API
// as JSON (/v1/trees...) and /v1/server; the tree viewer's static files (/viewer, compiled
// into the binary); /health and /ready.
//
// It is a gateway, not a second service: each /v1 call becomes the TreeServe request message
// and runs through the TreeServe service itself over an in-process gRPC channel, so keys,
// tenants, quotas, validation, limits, draining and cancellation are the gRPC API's, and an
// error is the gRPC status mapped to an HTTP status in OpenAI's error shape. The HTTP layer
// reads JSON (a field of the wrong type is 400 naming it), checks the key first (so the
// failure log names the HTTP peer), and writes responses; a client that closes its connection
// during a streamed (or slow whole) response cancels its Generate call.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "proto/treeserve.grpc.pb.h"

namespace httplib {
class Server;
}

namespace treeserve {

class Authenticator;
class DetokenizerVocab;
class Tokenizer;
struct TlsMaterial;

namespace http {
struct ApiContext;
}

struct HttpApiOptions {
  std::string model_name;             // GET /v1/models, and each response's "model"
  int32_t threads = 64;               // connections served at once (server.http_threads)
  int64_t max_body_bytes = 64 << 20;  // larger request bodies get 413
  std::string replica_id = "local";   // every response's x-treeserve-replica (server.replica_id)
};

class HttpApiServer {
 public:
  // `channel`: an in-process channel of the gRPC server that runs the TreeServe service.
  // `auth` and `tls` may be null (no keys; plain HTTP). All outlive this object.
  HttpApiServer(std::shared_ptr<grpc::Channel> channel, Authenticator* auth, const TlsMaterial* tls,
                const Tokenizer* tokenizer, HttpApiOptions options);
  ~HttpApiServer();

  // Binds host:port (validated by the config) and serves; UNAVAILABLE if it cannot bind,
  // INVALID_ARGUMENT if the TLS files cannot be used.
  Status start(const std::string& address);
  // The model is loaded: /ready answers 200; `vocab` (the scheduler's) gives token texts.
  void set_ready(const DetokenizerVocab* vocab);
  // Shutting down: /ready answers 503 again (calls already get UNAVAILABLE from the service).
  void begin_drain() { ready_ = false; }
  // Stops listening and waits for the requests in flight to end.
  void stop();
  int port() const { return port_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TreeServe::Stub> stub_;
  const TlsMaterial* tls_;
  HttpApiOptions options_;
  std::unique_ptr<http::ApiContext> api_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  std::atomic<bool> ready_{false};
  int port_ = -1;
};

}  // namespace treeserve
