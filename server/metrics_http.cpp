// GET /metrics -> MetricsRegistry::render(), with cpp-httplib (its SSLServer for HTTPS).
#include "server/metrics_http.h"

#include "server/http_listener.h"

namespace treeserve {

MetricsHttpServer::MetricsHttpServer(const MetricsRegistry* registry, Authenticator* auth,
                                     const TlsMaterial* tls)
    : registry_(registry), auth_(auth), tls_(tls) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

Status MetricsHttpServer::start(const std::string& address) {
  StatusOr<std::unique_ptr<httplib::Server>> server = make_http_server(tls_, "metrics listener");
  if (!server.ok()) return server.status();
  http_ = std::move(*server);
  http_->Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    StatusOr<Principal> who = authenticate_http(auth_, req);
    if (!who.ok()) {
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(who.status().message() + "\n", "text/plain");
      return;
    }
    res.set_content(registry_->render(), "text/plain; version=0.0.4");
  });
  StatusOr<int> port = bind_http_server(*http_, address, "metrics");
  if (!port.ok()) return port.status();
  port_ = *port;
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

void MetricsHttpServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace treeserve
