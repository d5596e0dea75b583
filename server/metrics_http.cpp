// GET /metrics -> MetricsRegistry::render(), with cpp-httplib.
#include "server/metrics_http.h"

#include <httplib.h>

namespace treeserve {

MetricsHttpServer::MetricsHttpServer(const MetricsRegistry* registry) : registry_(registry) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

Status MetricsHttpServer::start(const std::string& address) {
  size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  int port = std::stoi(address.substr(colon + 1));
  http_ = std::make_unique<httplib::Server>();
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry_->render(), "text/plain; version=0.0.4");
  });
  if (port == 0) {
    port_ = http_->bind_to_any_port(host);
  } else {
    port_ = http_->bind_to_port(host, port) ? port : -1;
  }
  if (port_ < 0) return Unavailable("cannot listen for metrics on " + address);
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

void MetricsHttpServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace treeserve
