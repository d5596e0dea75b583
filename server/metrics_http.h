// Serves the metrics registry as Prometheus text over HTTP (GET /metrics) on its own thread.
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

class MetricsHttpServer {
 public:
  explicit MetricsHttpServer(const MetricsRegistry* registry);
  ~MetricsHttpServer();
  // Binds host:port (validated by the config) and starts serving; UNAVAILABLE if it cannot.
  Status start(const std::string& address);
  void stop();
  int port() const { return port_; }

 private:
  const MetricsRegistry* registry_;
  std::unique_ptr<httplib::Server> http_;
  std::thread thread_;
  int port_ = -1;
};

}  // namespace treeserve
