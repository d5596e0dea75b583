// Serves the metrics registry as Prometheus text over HTTP or HTTPS (GET /metrics) on its own
// thread; with an enabled Authenticator, only to requests carrying
// "Authorization: Bearer <key>" (others get 401).
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "common/metrics.h"
#include "common/status.h"

namespace httplib {
class Server;
}

namespace treeserve {

class Authenticator;
struct TlsMaterial;

class MetricsHttpServer {
 public:
  // `auth` and `tls` may be null (no key asked for; plain HTTP); both outlive the server.
  explicit MetricsHttpServer(const MetricsRegistry* registry, Authenticator* auth = nullptr,
                             const TlsMaterial* tls = nullptr);
  ~MetricsHttpServer();
  // Binds host:port (validated by the config) and starts serving; UNAVAILABLE if it cannot,
  // INVALID_ARGUMENT if the TLS files cannot be used.
  Status start(const std::string& address);
  void stop();
  int port() const { return port_; }

 private:
  const MetricsRegistry* registry_;
  Authenticator* auth_;
  const TlsMaterial* tls_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = -1;
};

}  // namespace treeserve
